"""Teachers made from the student (on-policy self-distillation): ``teacher=ema|lagged|live``.

Each is an in-process scorer (dense logits, every estimator and metric) whose weights follow the
student through ``sync``, called by the trainer after every applied update (a skipped step is
no update; each of PPO's updates is one):

* ``ema``: theta_T <- theta_T + (1 - decay) * (theta_S - theta_T), starting from the student's
  starting weights (so the first step's teacher IS the student);
* ``lagged``: theta_T = the student's weights after the last multiple of ``refresh_every``
  applied updates (the starting weights before the first refresh);
* ``live``: the current student module itself, scored without gradient and with dropout off; only
  with privileged context (``teacher.privileged``), else it would score D(S || S) = 0.

The copies (ema, lagged) are teacher state: ``state_dict`` holds every weight by parameter name
and the update count, saved in every checkpoint and restored on resume. What identifies such a
teacher in the run's fingerprint is its config (kind, decay / refresh_every, privileged), never a
hash of weights that change every step.
"""

from __future__ import annotations

import copy
import math

import torch

from opd_exp.training.scoring import InProcessTeacher, dropout_off

UPDATES = "updates"  # the state key of the applied-update count


def _params(model) -> dict[str, torch.nn.Parameter]:
    """Parameters by name; a tied embedding and head count once (as ``named_parameters`` gives)."""
    return dict(model.named_parameters())


def frozen_copy(student):
    """A copy of the student's current weights, frozen (no grad, eval mode), on its device."""
    twin = copy.deepcopy(student)
    return twin.eval().requires_grad_(False)


class StudentCopyTeacher(InProcessTeacher):
    """A frozen copy of the student whose weights ``sync`` moves (subclasses say how)."""

    kind = "copy"

    def __init__(self, model, vocab_size: int, **kw):
        super().__init__(model, vocab_size, **kw)
        self.updates = 0
        self._distance: float | None = None

    def sync(self, student, step: int) -> None:
        self.updates += 1
        with torch.no_grad():
            self._move(_params(self.model), _params(student))
            self._distance = weight_distance(self.model, student)

    def _move(self, mine: dict, theirs: dict) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"weights.{n}": p.detach().contiguous().clone() for n, p in _params(self.model).items()}
        out[UPDATES] = torch.tensor(self.updates, dtype=torch.int64)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        mine = _params(self.model)
        want = {f"weights.{n}" for n in mine} | {UPDATES}
        if set(state) != want:
            missing, extra = sorted(want - set(state)), sorted(set(state) - want)
            raise ValueError(
                f"teacher={self.kind}: the checkpoint's teacher state does not match this student "
                f"(missing {missing[:3]}, unexpected {extra[:3]})"
            )
        with torch.no_grad():
            for n, p in mine.items():
                p.copy_(state[f"weights.{n}"].to(p.device, p.dtype))
        self.updates = int(state[UPDATES])

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        return out if self._distance is None else {**out, "self/weight_distance": self._distance}


class EmaTeacher(StudentCopyTeacher):
    kind = "ema"

    def __init__(self, model, vocab_size: int, *, decay: float, **kw):
        super().__init__(model, vocab_size, **kw)
        self.decay = float(decay)

    def _move(self, mine: dict, theirs: dict) -> None:
        # theta_T + (1 - decay) * (theta_S - theta_T): exactly theta_T where the two are equal (the
        # form decay * theta_T + (1 - decay) * theta_S rounds away from it, and AdamW's normalised
        # step turns that rounding into a real update)
        for n, p in mine.items():
            p.lerp_(theirs[n].detach().to(p.dtype), 1.0 - self.decay)


class LaggedTeacher(StudentCopyTeacher):
    kind = "lagged"

    def __init__(self, model, vocab_size: int, *, refresh_every: int, **kw):
        super().__init__(model, vocab_size, **kw)
        self.refresh_every = int(refresh_every)

    def _move(self, mine: dict, theirs: dict) -> None:
        if self.updates % self.refresh_every == 0:
            for n, p in mine.items():
                p.copy_(theirs[n].detach())

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        if self._distance is not None:
            out["self/lag_updates"] = float(self.updates % self.refresh_every)  # updates since the last refresh
        return out


class LiveTeacher(InProcessTeacher):
    """The student module itself: no copy, no state; scored without gradient, dropout off."""

    kind = "live"

    def logits(self, batch, *, view: bool = True) -> torch.Tensor:
        with dropout_off(self.model):
            return super().logits(batch, view=view)

    def hidden(self, batch) -> torch.Tensor:
        with dropout_off(self.model):
            return super().hidden(batch)


@torch.no_grad()
def weight_distance(teacher, student) -> float:
    """||theta_T - theta_S|| / ||theta_S|| over every parameter (``self/weight_distance``)."""
    mine, theirs = _params(teacher), _params(student)
    diff = sq = 0.0
    for n, p in mine.items():
        q = theirs[n].detach().float()
        diff += float((p.float() - q).pow(2).sum())
        sq += float(q.pow(2).sum())
    return math.sqrt(diff) / max(math.sqrt(sq), 1e-30)
