"""The learning-rate schedule: a factor of ``trainer.lr`` per optimizer step (torch's ``LambdaLR``).

Linear warm-up over ``trainer.warmup_steps``, then the ``trainer.schedule`` shape (constant,
linear or cosine to 0 at ``trainer.max_steps``). A run extended with other settings
(``checkpoint.extend``) continues from the checkpoint's factor with the same shape to the new end:
each extension is a segment, saved in the checkpoint's loop state (``lr_segments``).
"""

from __future__ import annotations

import math
from typing import Any

from opd_exp.config.schema import Schedule, TrainerConfig


class LrSchedule:
    def __init__(self, tc: TrainerConfig):
        self.tc = tc
        self.segments: list[dict[str, Any]] = []  # continuations made by checkpoint.extend

    def factor(self, step: int) -> float:
        """The factor of trainer.lr at ``step`` (a bound method for LambdaLR: its state_dict saves none of it)."""
        tc = self.tc
        seg = next((g for g in reversed(self.segments) if step >= g["start"]), None)
        if seg is not None:  # an extended run: from the checkpoint's factor, same shape, to the new end
            frac = min((step - seg["start"]) / max(seg["end"] - seg["start"], 1), 1.0)
            return seg["factor"] * self.shape(frac)
        if tc.warmup_steps and step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        frac = min(max(step - tc.warmup_steps, 0) / max(tc.max_steps - tc.warmup_steps, 1), 1.0)
        return self.shape(frac)

    def shape(self, frac: float) -> float:
        """The decay after warm-up, 1 at frac=0 and (linear, cosine) 0 at frac=1."""
        if self.tc.schedule is Schedule.linear:
            return 1.0 - frac
        if self.tc.schedule is Schedule.cosine:
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        return 1.0

    def extend(self, step: int, factor: float) -> None:
        """Continue from ``factor`` at ``step`` to the end of the schedule at ``trainer.max_steps``."""
        self.segments.append({"start": step, "factor": factor, "end": self.tc.max_steps})
