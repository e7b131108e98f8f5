"""The embedded task: multi-step arithmetic in GSM8K's answer format (see world/arithmetic.py)."""

from __future__ import annotations

from functools import cached_property
from typing import Optional

from opd_exp.config.world import TaskConfig
from opd_exp.tasks.base import Problem, Task
from opd_exp.world.arithmetic import ArithmeticSpec, eval_split, train_split


class ArithmeticTask(Task):
    """Synthetic arithmetic: eval set fixed by ``eval_seed``, train drawn by ``seed``, disjoint."""

    name = "arithmetic"

    def __init__(self, cfg: Optional[TaskConfig] = None):
        self.cfg = cfg or TaskConfig()
        self.spec = ArithmeticSpec(self.cfg.min_operands, self.cfg.max_operands, self.cfg.max_digits, self.cfg.ops)

    @cached_property
    def _eval(self) -> list[Problem]:
        return eval_split(self.spec, self.cfg.n_eval, self.cfg.eval_seed)

    @cached_property
    def _train(self) -> list[Problem]:
        return train_split(self.spec, self.cfg.n_train, self.cfg.seed, {p.prompt for p in self._eval})

    def train_problems(self) -> list[Problem]:
        return list(self._train)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)
