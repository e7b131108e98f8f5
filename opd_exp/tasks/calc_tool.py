"""The embedded tool world: products a tiny model cannot do in its head, and a calculator it can call.

A problem is a product of 2-3 digit numbers, ``17*234=?``; the worked solution calls the tool and
copies its result into the answer::

    prompt    17*234=?\\n
    student   <calc>17*234</calc>             (the turn ends at the stop string </calc>)
    tool      <result>3978</result>           (environment tokens: scored, never trained)
    student   #### 3978

The calculator (``CalcEnvironment``) evaluates the call with a small parser of integers, ``+ - *``
and parentheses (never ``eval``); a malformed call is answered ``<result>error</result>``, never a
crash. Use with ``model_pair=embedded_tool`` and ``rollout.max_turns`` >= 2
(``experiment=calc_tool``; docs/world.md).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from opd_exp.config.world import TaskConfig
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks.base import Problem, Task, extract_answer, normalize_number
from opd_exp.tasks.environment import Environment, Episode, EpisodeView, Reply

CALL, END = "<calc>", "</calc>"
RESULT, RESULT_END = "<result>", "</result>"
ERROR = f"{RESULT}error{RESULT_END}"
MAX_EXPRESSION = 64  # characters of one call
MAX_DEPTH = 16  # nested parentheses
MAX_VALUE = 10**15  # |value| of any intermediate result


@dataclass(frozen=True)
class ToolProblem(Problem):
    """A problem whose worked solution holds text the environment writes: ``env_spans`` are its
    character spans in ``solution`` (SFT trains on the rest only, as OPD does)."""

    env_spans: tuple[tuple[int, int], ...] = ()


class ParseError(ValueError):
    """A calculator call the safe parser refuses (the environment answers it with an error text)."""


def calculate(expression: str) -> int:
    """The value of an integer expression of ``+ - *``, unary minus and parentheses (spaces
    allowed); ``ParseError`` for anything else, too long, too deep or too large."""
    if len(expression) > MAX_EXPRESSION:
        raise ParseError("too long")
    tokens = re.findall(r"\d+|[-+*()]|\S", expression)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def bounded(v: int) -> int:
        if abs(v) > MAX_VALUE:
            raise ParseError("too large")
        return v

    def expr(depth: int) -> int:
        v = term(depth)
        while peek() in ("+", "-"):
            v = bounded(v + term(depth) if take() == "+" else v - term(depth))
        return v

    def term(depth: int) -> int:
        v = factor(depth)
        while peek() == "*":
            take()
            v = bounded(v * factor(depth))
        return v

    def factor(depth: int) -> int:
        if depth > MAX_DEPTH:
            raise ParseError("too deep")
        t = peek()
        if t == "-":
            take()
            return -factor(depth + 1)
        if t == "(":
            take()
            v = expr(depth + 1)
            if peek() != ")":
                raise ParseError("unbalanced")
            take()
            return v
        if t is not None and t.isdigit():
            return bounded(int(take()))
        raise ParseError(f"unexpected {t!r}")

    if not tokens:
        raise ParseError("empty")
    value = expr(0)
    if pos != len(tokens):
        raise ParseError(f"unexpected {tokens[pos]!r}")
    return value


def answer_call(call: str) -> str:
    """The calculator's reply to one call's expression: ``<result>v</result>`` or the error text."""
    try:
        return f"{RESULT}{calculate(call)}{RESULT_END}"
    except (ParseError, RecursionError):
        return ERROR


def _result_value(reply: str) -> str | None:
    if reply.startswith(RESULT) and reply.endswith(RESULT_END) and reply != ERROR:
        return reply[len(RESULT) : -len(RESULT_END)]
    return None


class CalcEnvironment(Environment):
    """The calculator: a turn ending at ``</calc>`` is answered with the value of what follows the
    turn's last ``<calc>``; a turn ending at EOS ends the episode."""

    stop = (END,)
    max_turns = 4

    def __init__(self, cfg: TaskConfig | None = None):
        self.cfg = cfg

    def step(self, view: EpisodeView) -> Reply:
        if view.eos or not view.text.endswith(END):
            return Reply.end()
        turn = view.last_turn
        start = turn.rfind(CALL)
        if start < 0:
            return Reply(ERROR)
        return Reply(answer_call(turn[start + len(CALL) : -len(END)]))

    def metrics(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """``tools/*``: calls per episode (turns ending at ``</calc>``), the share of answered calls
        with a number, of the episodes with a number the share whose final answer is the last one, and
        the share of episodes whose student turns write ``<result>`` themselves (the tool's text,
        which only the environment should write: what training on environment tokens teaches)."""
        calls = sum(sum(t.endswith(END) for t in e.turns) for e in episodes)
        answered = [r for e in episodes for r in e.replies]
        valid = [v for v in map(_result_value, answered) if v is not None]
        with_result = used = 0
        for e in episodes:
            results = [v for v in map(_result_value, e.replies) if v is not None]
            if results:
                with_result += 1
                used += extract_answer(e.text) == normalize_number(results[-1])
        return {
            "tools/calls_mean": calls / max(len(episodes), 1),
            "tools/valid_rate": len(valid) / max(len(answered), 1),
            "tools/result_used_rate": used / max(with_result, 1),
            "tools/self_result_rate": sum(any(RESULT in t for t in e.turns) for e in episodes) / max(len(episodes), 1),
        }


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(2, max_digits)  # the digit count first: 2- and 3-digit numbers equally common
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def make_problem(operands: Sequence[int]) -> ToolProblem:
    """The product of ``operands``, its tool-using solution and where the tool's text lies in it."""
    expr = "*".join(str(x) for x in operands)
    value = 1
    for x in operands:
        value *= x
    call, result = f"{CALL}{expr}{END}", f"{RESULT}{value}{RESULT_END}"
    solution = f"{call}{result}#### {value}"
    return ToolProblem(prompt=f"{expr}=?\n", answer=str(value), solution=solution, env_spans=((len(call), len(call) + len(result)),))


class CalcToolTask(Task):
    """Products of ``min_operands``..``max_operands`` numbers of 2..``max_digits`` digits; the eval set
    fixed by ``eval_seed``, training problems drawn by ``seed`` and disjoint from it."""

    name = "calc_tool"

    def __init__(self, cfg: TaskConfig | None = None):
        self.cfg = cfg or TaskConfig(name="calc_tool", max_operands=2, max_digits=3)
        c = self.cfg
        if not (isinstance(c.max_digits, int) and 2 <= c.max_digits <= 6):
            raise ConfigError(f"task.max_digits={c.max_digits!r} is not allowed; allowed: an integer in [2, 6] for calc_tool")
        if not (2 <= c.min_operands <= c.max_operands <= 4):
            raise ConfigError(
                f"task.max_operands={c.max_operands!r} is not allowed; allowed: an integer in [min_operands, 4] for calc_tool"
            )
        for key in ("n_train", "n_eval"):
            if getattr(c, key) < 1:
                raise ConfigError(f"task.{key}={getattr(c, key)!r} is not allowed; allowed: an integer >= 1 for calc_tool")

    def sample(self, rng: random.Random) -> ToolProblem:
        n = rng.randint(self.cfg.min_operands, self.cfg.max_operands)
        return make_problem([_operand(rng, self.cfg.max_digits) for _ in range(n)])

    def eval_split(self, n: int, seed: int) -> list[ToolProblem]:
        rng, seen = random.Random(f"calc-eval-{seed}"), {}
        while len(seen) < n:
            p = self.sample(rng)
            seen.setdefault(p.prompt, p)
        return list(seen.values())

    def train_split(self, n: int, seed: int, exclude: set[str]) -> list[ToolProblem]:
        rng, out = random.Random(f"calc-train-{seed}"), []
        while len(out) < n:
            p = self.sample(rng)
            if p.prompt not in exclude:
                out.append(p)
        return out

    @cached_property
    def _eval(self) -> list[ToolProblem]:
        return self.eval_split(self.cfg.n_eval, self.cfg.eval_seed)

    @cached_property
    def _train(self) -> list[ToolProblem]:
        return self.train_split(self.cfg.n_train, self.cfg.seed, {p.prompt for p in self._eval})

    def train_problems(self) -> list[Problem]:
        return list(self._train)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)
