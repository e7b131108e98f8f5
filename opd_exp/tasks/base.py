"""The task interface every task (embedded arithmetic, GSM8K, ...) provides to the trainer.

Answers use GSM8K's format: worked steps, then ``#### <number>``. The verifier here is shared
by all tasks in that format.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

# "####" (or more hashes), optional "$", then a number with optional thousands separators
# and decimals; the number must not run into a letter ("#### 6abc" is malformed).
_MARKER = re.compile(r"#{4,}")
_NUMBER = re.compile(r"\s*\$?\s*([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?![\w])")


@dataclass(frozen=True)
class Problem:
    """One task instance."""

    prompt: str  # what the model sees (before any chat template)
    answer: str  # the final number, canonical (see normalize_number)
    solution: str  # worked steps ending in "#### <answer>" (the SFT target)


def normalize_number(text: str) -> str | None:
    """Canonical string of a number ('1,234' -> '1234', '6.0' -> '6', '+3' -> '3'), or None."""
    text = text.strip().lstrip("$").replace(",", "").strip()
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(completion: str) -> str | None:
    """The final answer after ``####``, canonical, or None when malformed.

    Every ``####`` must be followed by a number and all of them must agree: a completion
    that hedges (``#### 5 #### 6``) or leaves a marker empty gets no answer, so a model
    cannot collect reward by listing candidates.
    """
    markers = list(_MARKER.finditer(completion))
    if not markers:
        return None
    found = set()
    for marker in markers:
        match = _NUMBER.match(completion, marker.end())
        if match is None:
            return None
        value = normalize_number(match.group(1))
        if value is None:
            return None
        found.add(value)
    return found.pop() if len(found) == 1 else None


def verify(completion: str, answer: str) -> bool:
    """True when the completion's final answer equals ``answer`` numerically."""
    got = extract_answer(completion)
    want = normalize_number(answer)
    return got is not None and want is not None and got == want


class Task(ABC):
    """Base class: a source of train/eval problems plus their verifier.

    Subclasses implement ``train_problems`` and ``eval_problems``; the GSM8K-format verifier
    and the prompt rendering are shared.
    """

    name: str = "task"

    @abstractmethod
    def train_problems(self) -> list[Problem]:
        """Training prompts (never overlapping the eval set)."""

    @abstractmethod
    def eval_problems(self) -> list[Problem]:
        """The fixed evaluation set."""

    def extract_answer(self, completion: str) -> str | None:
        return extract_answer(completion)

    def verify(self, completion: str, answer: str) -> bool:
        return verify(completion, answer)

    def render_prompt(self, problem: Problem, tokenizer: Any) -> str:
        """The text fed to the model: the chat template when the tokenizer has one."""
        return render_prompt(problem.prompt, tokenizer)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Refuse (``ConfigError``) a tokenizer this task cannot be asked through; any by default."""
        return None


def render_prompt(prompt: str, tokenizer: Any) -> str:
    """Apply the tokenizer's chat template (user turn + generation prompt) when it has one."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return prompt
