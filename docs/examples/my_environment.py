"""A task with an environment, in one file: arithmetic whose worked steps a checker reads as they are
written. Each step ``a+b=c;`` ends a student turn (the stop string ``;``); the checker appends
``ok `` after a right step, and ends the episode at a wrong one, so the student is never trained
past its first slip (the teacher scores the checker's tokens, the student is never trained on them).

    OPD_PLUGINS=docs/examples/my_environment.py opd-train task.name=checked_arithmetic rollout.max_turns=8
"""

from __future__ import annotations

import re

from opd_exp.tasks import Environment, EpisodeView, Reply, register_environment, register_task
from opd_exp.tasks.arithmetic import ArithmeticTask

STEP = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?\d+);$")


@register_task("checked_arithmetic")
class CheckedArithmetic(ArithmeticTask):
    """The embedded arithmetic task under its own name (so an environment can be registered for it)."""

    name = "checked_arithmetic"


@register_environment("checked_arithmetic")
class StepChecker(Environment):
    stop = (";",)  # a turn ends after each worked step (or at EOS)
    max_turns = 8

    def __init__(self, cfg=None):
        self.cfg = cfg

    def step(self, view: EpisodeView) -> Reply:
        if view.eos:  # the answer is written: the task's verifier scores the whole episode
            return Reply.end()
        step = STEP.search(view.last_turn)
        if step is None:
            return Reply.end(reward=0.0)  # a turn that is not a step
        a, op, b, c = int(step[1]), step[2], int(step[3]), int(step[4])
        right = a + b if op == "+" else a - b if op == "-" else a * b
        return Reply("ok ") if c == right else Reply.end(reward=0.0)
