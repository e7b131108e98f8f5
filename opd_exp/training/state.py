"""The loop's state, typed: what a checkpoint must carry for a resumed run to continue exactly.

``state_dict`` is the JSON object stored as ``state.json`` in every checkpoint (the step is
added by the checkpoint itself); ``load_state_dict`` reads it back, including checkpoints
written before this class existed (same keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from opd_exp.runtime.guards import StepGuard


class DataCursor:
    """Prompt order: a fresh seeded permutation per epoch; state is (epoch, position)."""

    def __init__(self, n: int, seed: int, epoch: int = 0, pos: int = 0):
        if n <= 0:
            raise ValueError("the task has no training problems")
        self.n, self.seed, self.epoch, self.pos = n, seed, epoch, pos
        self._perm_epoch, self._perm = -1, []

    def _permutation(self) -> list[int]:
        if self._perm_epoch != self.epoch:
            # 64-bit safe for any seed: the generator takes the value modulo 2**63
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % (2**63))
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g).tolist(), self.epoch
        return self._perm

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            take = min(k - len(out), self.n - self.pos)
            out += self._permutation()[self.pos : self.pos + take]
            self.pos += take
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


@dataclass
class TrainState:
    """Step, data position, eval records, the teacher's accuracy, time spent, guard counters."""

    cursor: DataCursor
    guard: StepGuard
    step: int = 0
    eval_before: dict[str, float] = field(default_factory=dict)
    eval_last: dict[str, float] = field(default_factory=dict)
    teacher_accuracy: float | None = None
    elapsed_s: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"data": self.cursor.state_dict(), "guard": self.guard.state_dict(), "elapsed_s": self.elapsed_s}
        if self.eval_before:
            out["eval_before"] = self.eval_before
        if self.eval_last:
            out["eval_last"] = self.eval_last
        if self.teacher_accuracy is not None:
            out["teacher_accuracy"] = self.teacher_accuracy
        return out

    def load_state_dict(self, step: int, state: dict[str, Any]) -> None:
        self.step = int(step)
        self.cursor.load_state_dict(state["data"])
        self.guard.load_state_dict(state.get("guard", {}))
        self.eval_before = dict(state.get("eval_before", {}))
        self.eval_last = dict(state.get("eval_last", {}))
        self.teacher_accuracy = state.get("teacher_accuracy")
        self.elapsed_s = float(state.get("elapsed_s", 0.0))
