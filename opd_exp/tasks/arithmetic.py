"""Synthetic multi-step arithmetic in GSM8K's answer format.

A problem is an expression such as ``9-5+2=?``; its solution works left to right, one step
per operator, then states the answer: ``9-5=4;4+2=6;#### 6``. The difficulty knobs are the
number of operands, their digits and the operators. Generation is deterministic from a
seed; the eval split is drawn from its own seed and removed from every training draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

from opd_exp.config.world import TaskConfig
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks.base import Problem, Task

ALLOWED_OPS = "+-*"


@dataclass(frozen=True)
class ArithmeticSpec:
    """Difficulty of the generated problems."""

    min_operands: int = 2  # fewest numbers in an expression (>= 2)
    max_operands: int = 3  # most numbers in an expression
    max_digits: int = 2  # operands have 1..max_digits digits
    ops: str = "+-"  # operators to draw from, a subset of "+-*"


def _operand(rng: random.Random, max_digits: int) -> int:
    # Draw the digit count first so short numbers are as common as long ones.
    digits = rng.randint(1, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def make_problem(operands: list[int], ops: list[str]) -> Problem:
    """The problem for ``operands[0] ops[0] operands[1] ...`` evaluated left to right."""
    expr = str(operands[0])
    value = operands[0]
    steps = []
    additive = False  # does expr have a "+"/"-" outside parentheses?
    for op, b in zip(ops, operands[1:]):
        # Left-to-right order is the task; parentheses make "*" after "+"/"-" unambiguous.
        if op == "*" and additive:
            expr = f"({expr})"
        additive = op in "+-"
        new = _apply(value, op, b)
        steps.append(f"{value}{op}{b}={new}")
        expr = f"{expr}{op}{b}"
        value = new
    solution = ";".join(steps) + f";#### {value}"
    return Problem(prompt=f"{expr}=?\n", answer=str(value), solution=solution)


def sample_problem(rng: random.Random, spec: ArithmeticSpec) -> Problem:
    n = rng.randint(spec.min_operands, spec.max_operands)
    operands = [_operand(rng, spec.max_digits) for _ in range(n)]
    ops = [rng.choice(spec.ops) for _ in range(n - 1)]
    return make_problem(operands, ops)


def eval_split(spec: ArithmeticSpec, n: int, seed: int) -> list[Problem]:
    """``n`` distinct problems drawn from ``seed`` (the fixed eval set)."""
    rng = random.Random(f"arithmetic-eval-{seed}")
    seen: dict[str, Problem] = {}
    attempts = 0
    while len(seen) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ConfigError(
                f"task.n_eval: {n} distinct problems requested but this difficulty has too "
                f"few (max_operands={spec.max_operands}, max_digits={spec.max_digits}, "
                f"ops={spec.ops!r}); allowed: a smaller n_eval or a harder task"
            )
        p = sample_problem(rng, spec)
        seen.setdefault(p.prompt, p)
    return list(seen.values())


def train_split(spec: ArithmeticSpec, n: int, seed: int, exclude: set[str]) -> list[Problem]:
    """``n`` problems drawn from ``seed`` (repeats allowed), none whose prompt is in ``exclude``."""
    rng = random.Random(f"arithmetic-train-{seed}")
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ConfigError(
                f"task.n_eval: the eval set covers nearly every problem of this difficulty "
                f"(max_operands={spec.max_operands}, max_digits={spec.max_digits}); "
                f"allowed: a smaller n_eval or a harder task"
            )
        p = sample_problem(rng, spec)
        if p.prompt not in exclude:
            out.append(p)
    return out


def splits(spec: ArithmeticSpec, n_train: int, n_eval: int, seed: int, eval_seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): eval fixed by ``eval_seed``, train drawn by ``seed`` and disjoint from eval."""
    ev = eval_split(spec, n_eval, eval_seed)
    tr = train_split(spec, n_train, seed, {p.prompt for p in ev})
    return tr, ev


class ArithmeticTask(Task):
    """Synthetic arithmetic: eval set fixed by ``eval_seed``, train drawn by ``seed``, disjoint."""

    name = "arithmetic"

    def __init__(self, cfg: TaskConfig | None = None):
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
