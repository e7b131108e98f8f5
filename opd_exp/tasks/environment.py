"""Environments: what answers the student between the turns of an episode.

An episode starts from a task's prompt. The student writes a turn until one of the environment's
``stop`` strings or EOS; the environment reads the episode so far (``EpisodeView``) and answers
with text, appended to the episode as environment tokens (the teacher scores them, the student is
never trained on them), or ends the episode (``Reply.end()``, optionally with a reward). The
rollout ends an episode itself at ``rollout.max_turns`` student turns or at its token budget
(``rollout.max_episode_tokens``), never waiting on an environment that would go on forever.

A task has an environment when one is registered under the task's name
(``register_environment("my_task", MyEnvironment)``); a task without one is one turn, exactly as
it always was. Environments are plain text functions: no model, no tokenizer, no torch; the
rollout engine (``training/episodes.py``) turns their text into tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Environment",
    "Episode",
    "EpisodeView",
    "Reply",
    "build_environment",
    "environment_names",
    "register_environment",
]


@dataclass(frozen=True)
class EpisodeView:
    """What the environment is shown after a student turn."""

    prompt: str  # the rendered prompt the episode started from
    text: str  # the episode after the prompt so far (student and environment text, special tokens left out)
    turn: int  # student turns written so far (1 after the first)
    eos: bool  # the last student turn ended with EOS (not at a stop string)
    last_turn: str = ""  # the text of the last student turn alone


@dataclass(frozen=True)
class Reply:
    """The environment's answer: ``text`` appended as environment tokens, or (``text`` None) the
    episode's end, with an optional ``reward``."""

    text: str | None = None
    reward: float | None = None

    @classmethod
    def end(cls, reward: float | None = None) -> Reply:
        return cls(None, reward)

    @property
    def done(self) -> bool:
        return self.text is None


@dataclass
class Episode:
    """One finished episode as the rollout saw it (what environment metrics are computed from)."""

    prompt: str
    turns: list[str] = field(default_factory=list)  # each student turn's text
    replies: list[str] = field(default_factory=list)  # each environment answer appended (len(turns) - 1 or len(turns))
    end: str = "env"  # env (the environment ended it) | eos (EOS with no environment left to ask) | turns | budget
    reward: float | None = None
    student_tokens: int = 0
    env_tokens: int = 0

    @property
    def text(self) -> str:
        """The whole episode after the prompt, turns and replies interleaved."""
        parts = []
        for i, turn in enumerate(self.turns):
            parts.append(turn)
            if i < len(self.replies):
                parts.append(self.replies[i])
        return "".join(parts)


class Environment:
    """Subclass and register under a task's name. ``stop``: strings that end a student turn (besides
    EOS); ``step``: the answer to the episode so far. ``metrics``: per-step numbers over the step's
    episodes (their names declared in ``opd_exp/metric_names.py``); none by default.
    ``max_turns``: the turns a bare-model check (``opd-prepare``'s accuracy) allows, where no
    ``rollout`` config says."""

    stop: tuple[str, ...] = ()
    max_turns: int = 4

    def step(self, view: EpisodeView) -> Reply:
        raise NotImplementedError

    def metrics(self, episodes: Sequence[Episode]) -> dict[str, float]:
        return {}


EnvironmentBuilder = Callable[[Any], Environment]  # a TaskConfig -> the Environment
_BUILDERS: dict[str, EnvironmentBuilder] = {}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def register_environment(task_name: str, builder: EnvironmentBuilder | None = None, *, replace: bool = False):
    """Register ``builder`` (an Environment subclass taking the TaskConfig, or a function of it) as
    the environment of task ``task_name``; without ``builder``, a class decorator."""

    def add(b: EnvironmentBuilder) -> EnvironmentBuilder:
        if not isinstance(task_name, str) or not _NAME_RE.match(task_name):
            raise ValueError(f"register_environment: task_name={task_name!r}; allowed: a task's name, a lower-case identifier")
        if not callable(b):
            raise TypeError(
                f"register_environment: {b!r} is not callable; allowed: an Environment subclass or a function TaskConfig -> Environment"
            )
        if task_name in _BUILDERS and _BUILDERS[task_name] is not b and not replace:
            raise ValueError(f"register_environment: {task_name!r} already has an environment; allowed: replace=True")
        _BUILDERS[task_name] = b
        return b

    return add if builder is None else add(builder)


def environment_names() -> tuple[str, ...]:
    return tuple(_BUILDERS)


def build_environment(task_cfg: Any) -> Environment | None:
    """The environment of the task ``task_cfg`` names (a TaskConfig, a Task, or a name), or None: a
    one-turn task. The builder gets the TaskConfig (a Task's ``cfg``; None from a bare name)."""
    name = task_cfg if isinstance(task_cfg, str) else getattr(task_cfg, "name", None)
    if name not in _BUILDERS:  # the built-ins registered when opd_exp.tasks (this module's package) was imported
        return None
    env = _BUILDERS[name](None if isinstance(task_cfg, str) else getattr(task_cfg, "cfg", task_cfg))
    if not isinstance(env, Environment):
        raise TypeError(f"environment of task {name!r}: its builder returned {type(env).__name__}; allowed: an opd_exp.tasks.Environment")
    return env
