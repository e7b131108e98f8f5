"""Recovery data for a teacher that corrects slips its own samples never make.

The lab's state-mismatch world (``model_pair=embedded_chain_recovery``, docs/world.md) trains
its teacher on the chain task's worked solutions plus a share of *slipped* draws: the prompt
is followed by a solution prefix whose last step is wrong (a wrong result, a misread operand
or operator, or a wrongly carried running value), and the SFT target is the correction marker
``!``, the right running value, and the rest of the right solution::

    prompt   7-3+5-9+2=?\\n7-3=4;4+6=10        (the wrong step stays in the context: no loss on it)
    target   !9;9-9=0;0+2=2;#### 2

The next step copies the number before ``;`` as always, so a correction needs no new way of
reading the chain: only to notice the slip and to write the value the step should have had.

The teacher's own samples follow the clean solutions, so they never visit a slipped prefix
nor write ``!``; a student that slips visits such prefixes often, and from them the teacher
leads back to the right answer. The verifier reads only what follows ``####``, so a corrected
chain counts as right.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from opd_exp.tasks.base import Problem

# bump when what a recovery draw looks like changes (it is in the teacher's cache key)
RECIPE = 1
MARK = "!"  # written right after a wrong step, before the step is written again correctly
# wrong c in a op b = c; wrong b, op or a (c follows it, locally right)
SLIPS = ("result", "operand", "operator", "carry")
# how often each is drawn: near-miss results are the student's commonest slip
SLIP_WEIGHTS = (2, 1, 1, 1)
_STEP = re.compile(r"^(-?\d+)([+\-*])(\d+)=(-?\d+)$")


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _off(rng: random.Random, x: int, low: int | None = None, high: int | None = None) -> int:
    """A value near ``x`` but not ``x`` (slips are near misses), inside [low, high] when given."""
    while True:
        y = x + rng.choice((-3, -2, -1, 1, 2, 3))
        if (low is None or y >= low) and (high is None or y <= high):
            return y


def solution_steps(solution: str) -> tuple[list[str], str]:
    """(worked steps ``a op b = c``, the closing ``#### n``) of an arithmetic solution."""
    parts = solution.split(";")
    return parts[:-1], parts[-1]


def slip_step(step: str, kind: str, rng: random.Random) -> str:
    """``step`` (``a op b = c``) with one slip of ``kind``: a near-miss result, or a near-miss
    operand / running value whose result then follows it (locally consistent)."""
    m = _STEP.match(step)
    if m is None:
        raise ValueError(f"not a worked step: {step!r}")
    a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
    if kind == "result":
        return f"{a}{op}{b}={_off(rng, c)}"
    if kind == "operand":
        b2 = _off(rng, b, 0, 9)  # one-digit operands stay one-digit
        return f"{a}{op}{b2}={_apply(a, op, b2)}"
    if kind == "operator":
        op2 = {"+": "-", "-": "+", "*": "+"}[op]
        return f"{a}{op2}{b}={_apply(a, op2, b)}"
    if kind == "carry":
        a2 = _off(rng, a)
        return f"{a2}{op}{b}={_apply(a2, op, b)}"
    raise ValueError(f"slip kind {kind!r}; allowed: {', '.join(SLIPS)}")


def slipped(problem: Problem, rng: random.Random) -> Problem:
    """A recovery draw of ``problem``: its solution up to a random step written with a slip in
    the prompt, the correction (``!``, the step's right value, the rest of the solution) as target."""
    steps, closing = solution_steps(problem.solution)
    i = rng.randrange(len(steps))
    wrong = slip_step(steps[i], rng.choices(SLIPS, SLIP_WEIGHTS)[0], rng)
    context = ";".join([*steps[:i], wrong])
    right = steps[i].split("=")[1]
    return Problem(prompt=problem.prompt + context, answer=problem.answer, solution=MARK + ";".join([right, *steps[i + 1 :], closing]))


def with_recovery(problems: Sequence[Problem], share: float, seed: int) -> list[Problem]:
    """``problems`` with a ``share`` of them (a fixed random subset) replaced by recovery draws."""
    rng = random.Random(f"recovery-{seed}")
    return [slipped(p, rng) if rng.random() < share else p for p in problems]
