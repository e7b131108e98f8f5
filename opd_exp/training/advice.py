"""Advice from a run's own numbers: said once, never acted on.

``EvalRise``: with ``estimator=sampled`` a learning rate that suits the exact estimator can make
the student worse (the one-sample gradient is far noisier); the sign is the trained divergence's
eval value (``eval/<divergence>``) staying above its value before training. After
``RISE_EVALS`` such evals in a row the run says so in one line, naming the estimator, the lr and
the best lr of the measured grid on the embedded pair (docs/training.md).
"""

from __future__ import annotations

import math

RISE_EVALS = 3
# the best of 1e-4, 3e-4, 1e-3, 3e-3 for `estimator=sampled loss=ppo divergence=rkl` on the embedded pair (docs/training.md)
SAMPLED_LR = 3e-4


class EvalRise:
    """Counts consecutive evaluations whose ``key`` is above its value before training."""

    def __init__(self, key: str, estimator: str, lr: float, evals: int = RISE_EVALS):
        self.key, self.estimator, self.lr, self.evals = key, estimator, lr, evals
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
        lower = f"try trainer.lr={SAMPLED_LR:g} (the least harmful lr measured on the embedded pair; docs/training.md)"
        if self.lr <= SAMPLED_LR:
            lower = "try a lower trainer.lr, or estimator=full|topk (docs/training.md)"
        return (
            f"opd-train: warning: {self.key} has been above its value before training ({b:.4g}) for {self.in_a_row} evals in a "
            f"row (now {v:.4g} at step {step}) with estimator={self.estimator} at trainer.lr={self.lr:g}: the sampled estimator's "
            f"one-token gradient is noisy and this lr makes the student worse; {lower}"
        )
