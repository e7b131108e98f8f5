"""Tasks: where prompts and answers come from, and how a completion is verified.

A new task is a ``Task`` subclass (or any callable ``TaskConfig -> Task``) registered under a
name with ``register_task``; ``task.name=<name>`` then selects it (docs/extending.md). A task whose
episodes have more than one turn also registers an ``Environment`` under its name
(``register_environment``, ``tasks/environment.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from opd_exp.tasks.base import Problem, Task, extract_answer, render_prompt, verify
from opd_exp.tasks.environment import Environment, Episode, EpisodeView, Reply, build_environment, register_environment

__all__ = [
    "Environment",
    "Episode",
    "EpisodeView",
    "Problem",
    "Reply",
    "Task",
    "build_environment",
    "build_task",
    "extract_answer",
    "register_environment",
    "register_task",
    "render_prompt",
    "task_names",
    "verify",
]

TaskBuilder = Callable[[Any], Task]  # a TaskConfig -> the Task
_BUILDERS: dict[str, TaskBuilder] = {}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def register_task(name: str, builder: TaskBuilder | None = None, *, replace: bool = False):
    """Register ``builder`` (a Task subclass taking the TaskConfig, or a function of it) as
    task ``name``; without ``builder``, a class decorator. A taken name fails unless ``replace``."""
    from opd_exp.config.world import add_task_name

    def add(b: TaskBuilder) -> TaskBuilder:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"register_task: name={name!r}; allowed: a lower-case identifier like 'my_jsonl'")
        if not callable(b):
            raise TypeError(f"register_task: {b!r} is not callable; allowed: a Task subclass or a function TaskConfig -> Task")
        if name in _BUILDERS and _BUILDERS[name] is not b and not replace:
            raise ValueError(f"register_task: {name!r} is already registered; allowed: a new name, or replace=True")
        _BUILDERS[name] = b
        add_task_name(name)
        return b

    return add if builder is None else add(builder)


def task_names() -> tuple[str, ...]:
    return tuple(_BUILDERS)


def _arithmetic(cfg):
    from opd_exp.tasks.arithmetic import ArithmeticTask

    return ArithmeticTask(cfg)


def _gsm8k(cfg):
    from opd_exp.tasks.gsm8k import GSM8KTask

    return GSM8KTask(cfg)


def _multimodal(cfg):
    from opd_exp.tasks.multimodal import MultimodalTask

    return MultimodalTask(cfg)


def _chat_arithmetic(cfg):
    from opd_exp.tasks.chat_arithmetic import ChatArithmeticTask

    return ChatArithmeticTask(cfg)


def _calc_tool(cfg):
    from opd_exp.tasks.calc_tool import CalcToolTask

    return CalcToolTask(cfg)


def _calculator(cfg):
    from opd_exp.tasks.calc_tool import CalcEnvironment

    return CalcEnvironment(cfg)


register_task("arithmetic", _arithmetic)
register_task("gsm8k", _gsm8k)
register_task("chat_arithmetic", _chat_arithmetic)
register_task("multimodal", _multimodal)
register_task("calc_tool", _calc_tool)
register_environment("calc_tool", _calculator)


def build_task(task_cfg: Any = None) -> Task:
    """The Task named by ``task_cfg.name`` (a TaskConfig, DictConfig or dict; None = default)."""
    from opd_exp.config.world import as_task_config

    cfg = as_task_config(task_cfg)  # rejects names that are not registered, with the list
    task = _BUILDERS[cfg.name](cfg)
    if not isinstance(task, Task):
        raise TypeError(f"task {cfg.name!r}: its builder returned {type(task).__name__}; allowed: a opd_exp.tasks.Task")
    return task
