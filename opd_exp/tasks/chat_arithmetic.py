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
from typing import Any

from opd_exp.config.world import TaskConfig
from opd_exp.tasks.arithmetic import ArithmeticTask
from opd_exp.tasks.base import Problem, normalize_number, render_prompt

# the completion's leading integer, not the integer part of a decimal ("12.5" has no answer)
_LEADING = re.compile(r"\s*(-?\d+)(?!\d|\.\d)")


def expression(problem: Problem) -> str:
    """``9-5+2`` from the arithmetic prompt ``9-5+2=?\\n``, with spaces: ``9 - 5 + 2``."""
    expr = problem.prompt.removesuffix("=?\n")
    return re.sub(r"(?<=[\d)])([-+*])", r" \1 ", expr)


def to_chat(problem: Problem) -> Problem:
    expr = expression(problem)
    return Problem(prompt=f"What is {expr}?", answer=problem.answer, solution=f"{expr} = {problem.answer}")


class ChatArithmeticTask(ArithmeticTask):
    """``What is a + b?`` in a chat turn; the answer is the number the reply starts with. The
    problems are the arithmetic task's (same splits), asked in words."""

    name = "chat_arithmetic"

    def __init__(self, cfg: TaskConfig | None = None):
        super().__init__(cfg or TaskConfig(name="chat_arithmetic"))

    def train_problems(self) -> list[Problem]:
        return [to_chat(p) for p in super().train_problems()]

    def eval_problems(self) -> list[Problem]:
        return [to_chat(p) for p in super().eval_problems()]

    def check_tokenizer(self, tokenizer: Any) -> None:
        """The task is the chat turn: a tokenizer without a chat template would silently make it
        plain arithmetic text."""
        if not getattr(tokenizer, "chat_template", None):
            from opd_exp.runtime.errors import ConfigError

            raise ConfigError(
                "task=chat_arithmetic: the model pair's tokenizer has no chat template; allowed: a pair whose tokenizer has one "
                "(model_pair=smollm2, a Qwen pair), or task=arithmetic for plain text"
            )

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
