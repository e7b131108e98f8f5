"""A task with several correct answers per prompt: where mode-seeking and mode-covering separate.

Two families of prompts, each asking for *one* number out of a small set, in GSM8K's answer
format (``#### <n>``):

* ``mul 7 in 10-40?``     a multiple of 7 in [10, 40]           -> 14, 21, 28 or 35
* ``digsum 9 in 30-60?``  a number in [30, 60] with digit sum 9 -> 36, 45 or 54

Every problem lists all its valid answers (``MultiProblem.answers``); the verifier accepts any
of them. The SFT solution of each training draw is one valid answer chosen at random, so a
teacher fitted by maximum likelihood spreads its mass evenly over the answers. Generation is
deterministic from a seed; the eval split is drawn from its own seed and removed from every
training draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

from opd_exp.config.world import TaskConfig
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks.base import Problem, Task, extract_answer, normalize_number

FAMILIES = ("mul", "digsum")
LOW, HIGH = 10, 99  # answers are two-digit numbers


@dataclass(frozen=True)
class MultiProblem(Problem):
    """A problem with several valid answers.

    ``answer`` joins them with ``|`` (``"14|21|28|35"``), so every caller that checks
    ``task.verify(completion, problem.answer)`` accepts any valid answer.
    """

    answers: tuple[str, ...] = ()  # every valid answer, canonical, ascending


@dataclass(frozen=True)
class MultimodalSpec:
    """How many valid answers a prompt may have."""

    min_answers: int = 2  # fewest valid answers per prompt
    max_answers: int = 6  # most valid answers per prompt


def _digit_sum(x: int) -> int:
    return sum(int(c) for c in str(x))


def valid_answers(family: str, k: int, lo: int, hi: int) -> list[int]:
    """All valid answers of a prompt: multiples of k (``mul``) or digit sum k (``digsum``) in [lo, hi]."""
    if family == "mul":
        return [x for x in range(lo, hi + 1) if x % k == 0]
    return [x for x in range(lo, hi + 1) if _digit_sum(x) == k]


def prompt_text(family: str, k: int, lo: int, hi: int) -> str:
    return f"{family} {k} in {lo}-{hi}?\n"


def make_problem(family: str, k: int, lo: int, hi: int, rng: random.Random | None = None) -> MultiProblem:
    """The problem; its SFT solution is one valid answer (random with ``rng``, else the first)."""
    answers = valid_answers(family, k, lo, hi)
    if not answers:
        raise ValueError(f"{prompt_text(family, k, lo, hi)!r} has no valid answer")
    pick = answers[0] if rng is None else rng.choice(answers)
    return MultiProblem(
        prompt=prompt_text(family, k, lo, hi),
        answer="|".join(str(a) for a in answers),
        solution=f"#### {pick}",
        answers=tuple(str(a) for a in answers),
    )


def sample_problem(rng: random.Random, spec: MultimodalSpec) -> MultiProblem:
    """A random prompt whose number of valid answers is within the spec (rejection sampling)."""
    while True:
        family = rng.choice(FAMILIES)
        k = rng.randint(2, 9) if family == "mul" else rng.randint(3, 15)
        lo = rng.randint(LOW, HIGH - 10)
        hi = rng.randint(lo + 5, min(HIGH, lo + 50))
        n = len(valid_answers(family, k, lo, hi))
        if spec.min_answers <= n <= spec.max_answers:
            return make_problem(family, k, lo, hi, rng)


def eval_split(spec: MultimodalSpec, n: int, seed: int) -> list[MultiProblem]:
    """``n`` distinct prompts drawn from ``seed`` (the fixed eval set)."""
    rng = random.Random(f"multimodal-eval-{seed}")
    seen: dict[str, MultiProblem] = {}
    attempts = 0
    while len(seen) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ConfigError(f"task.n_eval: {n} distinct prompts requested but this task has too few; allowed: a smaller n_eval")
        p = sample_problem(rng, spec)
        seen.setdefault(p.prompt, p)
    return list(seen.values())


def train_split(spec: MultimodalSpec, n: int, seed: int, exclude: set[str]) -> list[MultiProblem]:
    """``n`` draws from ``seed`` (prompts repeat, each draw with its own random answer), none in ``exclude``."""
    rng = random.Random(f"multimodal-train-{seed}")
    out: list[MultiProblem] = []
    while len(out) < n:
        p = sample_problem(rng, spec)
        if p.prompt not in exclude:
            out.append(p)
    return out


def spec_of(cfg: TaskConfig) -> MultimodalSpec:
    return MultimodalSpec(cfg.min_answers, cfg.max_answers)


class MultimodalTask(Task):
    """Prompts with several valid answers: the verifier accepts any of them."""

    name = "multimodal"

    def __init__(self, cfg: TaskConfig | None = None):
        self.cfg = cfg or TaskConfig(name="multimodal")
        self.spec = spec_of(self.cfg)

    @cached_property
    def _eval(self) -> list[MultiProblem]:
        return eval_split(self.spec, self.cfg.n_eval, self.cfg.eval_seed)

    @cached_property
    def _train(self) -> list[MultiProblem]:
        return train_split(self.spec, self.cfg.n_train, self.cfg.seed, {p.prompt for p in self._eval})

    def train_problems(self) -> list[MultiProblem]:
        return list(self._train)

    def eval_problems(self) -> list[MultiProblem]:
        return list(self._eval)

    def verify(self, completion: str, answer: str) -> bool:
        """True when the completion's answer is one of ``answer``'s ``|``-joined valid answers."""
        got = extract_answer(completion)
        return got is not None and got in {normalize_number(a) for a in answer.split("|")}
