"""Advice from a run's own numbers: said once, never acted on.

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
