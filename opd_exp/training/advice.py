"""Advice from a run's own numbers, said once; and the start-up guards against a distillation that
would run as a silent no-op (``Advice``: the one object the trainer calls).

Said once, never acted on: ``EvalRise``, ``NoSignal`` (below), a teacher at ~0 eval accuracy before
training (``Advice.teacher_accuracy``) and a ``model_pair=local`` run on the toy world's batch and lr
(``local_defaults``). Refused in one line (exit 2): the checks of ``FirstStepCheck`` at the first
trained micro-batch (the teacher's log-probs equal to the student's; a distillation term that does
not move with the teacher's scores).

``EvalRise``: with ``estimator=sampled`` the one-token gradient is far noisier than the exact
estimator's, and a learning rate that suits the exact estimator can make the student worse (the
old defaults, no baseline at lr 3e-3, did on the embedded pair); the sign is the trained
divergence's eval value (``eval/<divergence>``) staying above its value before training. After
``RISE_EVALS`` such evals in a row the run says so in one line, naming the estimator, its
baseline and the lr, and what to try: the baseline (``estimator.baseline``) where it is off, the
measured lr of ``estimator=sampled`` where the lr is above it (docs/training.md, "Learning rate
and variance per estimator").
"""

from __future__ import annotations

import math

import torch

RISE_EVALS = 3
# estimator=sampled's default lr (conf/estimator/sampled.yaml): measured on the embedded pair with the
# README's Trinity-style line and the exact baseline (docs/training.md)
SAMPLED_LR = 1e-3


class EvalRise:
    """Counts consecutive evaluations whose ``key`` is above its value before training."""

    def __init__(self, key: str, estimator: str, lr: float, baseline: str = "none", evals: int = RISE_EVALS):
        self.key, self.estimator, self.lr, self.evals, self.baseline = key, estimator, lr, evals, baseline
        self.in_a_row, self.said = 0, False

    def update(self, before: dict, now: dict, step: int) -> str | None:
        """The warning line the first time ``evals`` evaluations in a row rise above ``before``; else None."""
        b, v = before.get(self.key), now.get(self.key)
        if b is None or v is None or not (math.isfinite(b) and math.isfinite(v)):
            return None
        self.in_a_row = self.in_a_row + 1 if v > b else 0
        if self.said or self.in_a_row < self.evals:
            return None
        self.said = True
        tries = []
        if self.baseline == "none":
            tries.append("estimator.baseline=exact (topk with a served teacher)")
        if self.lr > SAMPLED_LR:
            tries.append(f"trainer.lr={SAMPLED_LR:g}")
        if tries:
            advice = f"try {' and '.join(tries)} (estimator=sampled's defaults, measured on the embedded pair; docs/training.md)"
        else:
            advice = "try a lower trainer.lr, or estimator=full|topk_student (docs/training.md)"
        return (
            f"opd-train: warning: {self.key} has been above its value before training ({b:.4g}) for {self.in_a_row} evals in a "
            f"row (now {v:.4g} at step {step}) with estimator={self.estimator} estimator.baseline={self.baseline} at "
            f"trainer.lr={self.lr:g}: the sampled estimator's one-token gradient is noisy and this lr makes the student worse; {advice}"
        )


# The divergence to the teacher stays at ~0 for the first steps: nothing to distil. A teacher made
# from the student without privileged context starts AS the student; a teacher whose fields were
# dropped, or a teacher equal to the student, give the same picture.
NO_SIGNAL_STEPS, NO_SIGNAL_LEVEL = 3, 1e-6


class NoSignal:
    """Said once: ``jsd/mean`` at most ``NO_SIGNAL_LEVEL`` in absolute value on each of the first
    ``NO_SIGNAL_STEPS`` trained steps."""

    def __init__(self, teacher: str, privileged: str):
        self.teacher, self.privileged, self.seen, self.done = teacher, privileged, 0, False

    def update(self, metrics: dict[str, float], step: int) -> str | None:
        if self.done or metrics.get("grad/skipped") or "jsd/mean" not in metrics:
            return None
        if abs(metrics["jsd/mean"]) > NO_SIGNAL_LEVEL:
            self.done = True
            return None
        self.seen += 1
        if self.seen < NO_SIGNAL_STEPS:
            return None
        self.done = True
        why = (
            f" (teacher={self.teacher} starts as the student; with teacher.privileged=none it has nothing the student lacks)"
            if self.teacher in ("ema", "lagged") and self.privileged == "none"
            else " (is the teacher the student, or are its scores the student's?)"
        )
        return (
            f"opd-train: warning: the divergence to the teacher has stayed at ~0 (|jsd/mean| <= {NO_SIGNAL_LEVEL:g}) for the first "
            f"{NO_SIGNAL_STEPS} steps up to step {step}: there is little or nothing to distil{why}"
        )


# -- the start-up guards (said or refused once, from the run's own first numbers) -------------------

# A teacher that answers (almost) nothing on the step-0 eval has nothing to teach about the answers.
TEACHER_ACCURACY_FLOOR = 0.01
# The check at the first trained micro-batch: the teacher's log-probs shifted by this many nats at
# the sampled tokens, and a change of the distillation term smaller than CHANGE_LEVEL x kl_coef is none.
SHIFT_NATS, CHANGE_LEVEL = 1.0, 1e-9


class Advice:
    """The run's advice and start-up guards, one object the trainer calls from its existing hooks:
    ``watch`` (the objective, checked at its first trained micro-batch: ``FirstStepCheck``),
    ``update`` (each step: ``NoSignal``), ``teacher_accuracy`` (the step-0 eval). Built with the
    run's console, it says at once when a ``model_pair=local`` run trains on the toy world's batch
    and lr (``local_defaults``)."""

    def __init__(self, cfg, console):
        self.cfg, self.console = cfg, console
        self.no_signal = NoSignal(cfg.teacher.name.value, cfg.teacher.privileged.value)
        if console.main and (line := local_defaults(cfg)):
            console.warn(line)

    def watch(self, objective):
        return FirstStepCheck(objective, self.cfg)

    def update(self, metrics: dict[str, float], step: int) -> str | None:
        return self.no_signal.update(metrics, step)

    def teacher_accuracy(self, accuracy: float) -> float:
        """The step-0 eval's ``eval/teacher_accuracy``, returned as given; at most
        ``TEACHER_ACCURACY_FLOOR``: one warning line (the task's verifier marks its answers wrong)."""
        if self.console.main and isinstance(accuracy, (int, float)) and math.isfinite(accuracy) and accuracy <= TEACHER_ACCURACY_FLOOR:
            self.console.warn(
                f"opd-train: warning: the teacher's eval accuracy is {accuracy:.3f} (<= {TEACHER_ACCURACY_FLOOR:g}) before training: "
                "the teacher solves (almost) none of the eval problems, so distilling it cannot raise the student's accuracy; "
                "check model_pair.teacher (an untrained or wrong model?), the task's prompt format and rollout.max_new_tokens"
            )
        return accuracy


def local_defaults(cfg) -> str | None:
    """The warning for a ``model_pair=local`` run on the schema's batch and lr (the embedded toy
    world's: a pretrained model is wrecked at lr 3e-3), or None."""
    from opd_exp.config.loop import TrainerConfig

    tc, toy = cfg.trainer, TrainerConfig()
    if cfg.model_pair.name != "local" or tc.batch_size != toy.batch_size or tc.lr != toy.lr:
        return None
    return (
        f"opd-train: warning: model_pair=local trains with trainer.batch_size={tc.batch_size} and trainer.lr={tc.lr:g}, the "
        "embedded toy world's defaults (at that lr a pretrained student is wrecked in a few steps); set values for real "
        "models, e.g. trainer.batch_size=32 trainer.lr=1e-6 (conf/model_pair/qwen3.yaml) or trainer.batch_size=8 trainer.lr=1e-4 "
        "(conf/model_pair/smollm2.yaml)"
    )


class FirstStepCheck:
    """The objective, checked once at its first call with trained tokens (step 1 of the session),
    then passed through. Two refusals (``ConfigError``: one line, exit 2), each a distillation that
    would run as a silent no-op:

    * the teacher's log-prob equals the student's at every trained token (``|log S(y) - log T(y)|``
      at most ``NO_SIGNAL_LEVEL``): a teacher that is the student, or scores that are the student's
      own. Not refused for a teacher made from the student (``teacher=ema|lagged|live``), which
      starts as the student (``NoSignal`` says so after a few steps);
    * the distillation term (the estimator's per-token loss terms and advantages, the objective's
      ``_on_policy``; a teacher-sampled micro-batch's exact divergence) does not move when the
      teacher's log-prob of each sampled token is shifted by ``SHIFT_NATS`` either way, nor (a
      dense teacher) when its logits are negated: the loss does not read the teacher's scores
      (atropos #456: the teacher's fields dropped on the way).

    The check recomputes the term (up to four times) on that one micro-batch without gradient; it never calls
    the objective itself, so the step's losses and whatever watches the objective are unchanged.
    ``loss.kl_coef=0`` (reward-only RL) has no distillation term and is not checked."""

    def __init__(self, objective, cfg):
        self.objective, self.cfg = objective, cfg
        # a signal that ignores the teacher on purpose (a lab divergence, reads_teacher=False) has nothing to check
        self.pending = cfg.loss.kl_coef > 0 and getattr(objective.div, "reads_teacher", True)

    def __getattr__(self, name):  # everything else is the objective's
        return getattr(self.objective, name)

    def __call__(self, student_z, teacher, response_ids, mask, *, on_policy: bool, **kw):
        out = self.objective(student_z, teacher, response_ids, mask, on_policy=on_policy, **kw)
        if self.pending:
            self._check(student_z.detach(), teacher, response_ids, mask, on_policy)
        return out

    @torch.no_grad()
    def _check(self, z, teacher, y, mask, on_policy: bool) -> None:
        from opd_exp.runtime.errors import ConfigError
        from opd_exp.training.scoring import TeacherScores, token_logprobs

        # the scores as the objective reads them (completed beside the student's logits where they say so)
        scores = (teacher if isinstance(teacher, TeacherScores) else TeacherScores(logits=teacher)).against(z)
        s = token_logprobs(z, y)
        m = mask.bool() & (s.exp() > 0)  # the trained tokens the objective keeps
        if not m.any():
            return  # nothing trained here: the next call is checked
        self.pending = False
        te = self.cfg.teacher
        gap = float((s - scores.token_logprobs(y).to(s.dtype)).abs()[m].max())
        if gap <= NO_SIGNAL_LEVEL and not te.from_student:
            raise ConfigError(
                f"teacher.name={te.name.value!r} is not allowed here: at step 1 the teacher's log-prob equals the student's at every "
                f"trained token (largest |log S(y) - log T(y)| {gap:.3g} <= {NO_SIGNAL_LEVEL:g}), so the distillation term is zero "
                "(a teacher that is the student, or scores that are the student's own); allowed: a teacher that differs from the "
                "student, or teacher.privileged=solution|answer, or teacher=ema|lagged (self-distillation, named)"
            )
        base = self._term(z, scores, y, m, s, on_policy)
        change = max(self._moved(base, self._term(z, other, y, m, s, on_policy), m) for other in perturbed(scores, y))
        if not change > CHANGE_LEVEL * self.cfg.loss.kl_coef:
            raise ConfigError(
                f"estimator.name={self.cfg.estimator.name.value!r} is not allowed here: at step 1 the distillation term does not change "
                f"when the teacher's log-probs change (each sampled token's shifted by {SHIFT_NATS:g} nats either way, or a dense "
                f"teacher's logits negated: largest change {change:.3g}), so the loss does not read the teacher's scores and "
                "distillation would be a silent no-op (the teacher's fields dropped on the way?); allowed: an estimator and teacher "
                "scorer whose loss uses the teacher's scores"
            )

    def _term(self, z, scores, y, m, s, on_policy: bool) -> list:
        obj = self.objective
        if not on_policy:  # a teacher-sampled micro-batch: the exact divergence
            return [obj.div.full(z, scores.logits, mask=m, chunk_size=self.cfg.estimator.chunk_size)]
        per_token, advantages, *_ = obj._on_policy(z, scores, y, m, s, scores.token_logprobs(y).detach())
        return [per_token, advantages]

    @staticmethod
    def _moved(base: list, moved: list, m) -> float:
        return max(float(torch.nan_to_num((a - b).abs()[m], nan=0.0).max()) for a, b in zip(base, moved))


def perturbed(scores, y) -> list:
    """What the check compares the distillation term under: the sampled tokens' teacher log-probs
    shifted either way (``shifted``) and, for a dense teacher, its logits negated (a teacher far from
    the student: an estimator whose loss a clamp holds at 0 near the student still moves)."""
    out = [shifted(scores, y, sign) for sign in (-1.0, 1.0)]
    if scores.dense:
        from opd_exp.training.scoring import TeacherScores

        out.append(TeacherScores(logits=-scores.logits))
    return out


def shifted(scores, y, sign: float):
    """``scores`` with the teacher's log-prob of each sampled token ``y`` moved by ``sign`` x
    ``SHIFT_NATS``: dense logits at ``y`` moved (the rest renormalises); a sparse payload keeps
    log-probs <= 0 and a mass <= 1 (down: ``y``'s own entries; up: every other top-k entry down)."""
    from opd_exp.training.scoring import TeacherScores

    if scores.dense:
        bump = torch.full_like(y, 0, dtype=scores.logits.dtype).unsqueeze(-1) + sign * SHIFT_NATS
        return TeacherScores(logits=scores.logits.scatter_add(-1, y.unsqueeze(-1), bump))
    at_y = scores.topk_ids == y.unsqueeze(-1) if scores.topk_ids is not None else None
    if sign < 0 or at_y is None:
        lp = None if at_y is None else scores.topk_logprobs - SHIFT_NATS * at_y
        return TeacherScores(topk_ids=scores.topk_ids, topk_logprobs=lp, sampled_logprobs=scores.sampled_logprobs - SHIFT_NATS)
    return TeacherScores(
        topk_ids=scores.topk_ids, topk_logprobs=scores.topk_logprobs - SHIFT_NATS * ~at_y, sampled_logprobs=scores.sampled_logprobs
    )
