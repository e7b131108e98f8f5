"""Short arithmetic asked through the chat template, sized for a small instruct model.

A problem is the user turn ``What is 7 + 5?``; the rendered prompt is the tokenizer's chat
template with the assistant turn already opened by the restated expression, ``7 + 5 = ``, so
the answer is the first thing the model writes. Asked plainly, SmolLM2-135M-Instruct talks
around the answer ("To add 8 and 7, you simply...") and is right on ~0.35 of one-digit sums
within 16 tokens; with the expression restated it is right on ~0.95 (measured on this
project's machine). The verifier takes the number the completion starts with; anything after
it ("12, which is the sum of ...") is ignored, and a completion that does not start with a
number has no answer.

Problems are the arithmetic task's (``opd_exp/tasks/arithmetic.py``: same knobs, seeds and
disjoint eval split), written with spaces: ``(3 - 7) * 5``.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any

from opd_exp.config.world import TaskConfig
from opd_exp.tasks.arithmetic import ArithmeticSpec, eval_split, train_split
from opd_exp.tasks.base import Problem, Task, normalize_number, render_prompt

# the completion's leading integer, not the integer part of a decimal ("12.5" has no answer)
_LEADING = re.compile(r"\s*(-?\d+)(?!\d|\.\d)")


def expression(problem: Problem) -> str:
    """``9-5+2`` from the arithmetic prompt ``9-5+2=?\\n``, with spaces: ``9 - 5 + 2``."""
    expr = problem.prompt.removesuffix("=?\n")
    return re.sub(r"(?<=[\d)])([-+*])", r" \1 ", expr)


def to_chat(problem: Problem) -> Problem:
    expr = expression(problem)
    return Problem(prompt=f"What is {expr}?", answer=problem.answer, solution=f"{expr} = {problem.answer}")


class ChatArithmeticTask(Task):
    """``What is a + b?`` in a chat turn; the answer is the number the reply starts with."""

    name = "chat_arithmetic"

    def __init__(self, cfg: TaskConfig | None = None):
        self.cfg = cfg or TaskConfig(name="chat_arithmetic")
        self.spec = ArithmeticSpec(self.cfg.min_operands, self.cfg.max_operands, self.cfg.max_digits, self.cfg.ops)

    @cached_property
    def _eval(self) -> list[Problem]:
        return eval_split(self.spec, self.cfg.n_eval, self.cfg.eval_seed)

    @cached_property
    def _train(self) -> list[Problem]:
        return train_split(self.spec, self.cfg.n_train, self.cfg.seed, {p.prompt for p in self._eval})

    def train_problems(self) -> list[Problem]:
        return [to_chat(p) for p in self._train]

    def eval_problems(self) -> list[Problem]:
        return [to_chat(p) for p in self._eval]

    def render_prompt(self, problem: Problem, tokenizer: Any) -> str:
        """The chat template's user turn, then the assistant turn opened with ``<expr> = ``."""
        expr = problem.prompt.removeprefix("What is ").removesuffix("?")
        opened = render_prompt(problem.prompt, tokenizer)
        if opened == problem.prompt:  # no chat template: question and answer on two lines
            opened += "\n"
        return f"{opened}{expr} = "

    def extract_answer(self, completion: str) -> str | None:
        match = _LEADING.match(completion)
        return normalize_number(match.group(1)) if match else None

    def verify(self, completion: str, answer: str) -> bool:
        got = self.extract_answer(completion)
        return got is not None and got == normalize_number(answer)
