"""The tool world's SFT data (``model_pair=embedded_tool``, ``task=calc_tool``).

The teacher learns every draw with the calculator: copy the product into ``<calc>...</calc>``, stop,
read the environment's ``<result>n</result>`` and copy n into ``#### n``. The result is in its
context, never a target (``ToolProblem.env_spans``: SFT trains on the student's part, as OPD does).
The student's warm-up answers a share of its draws without the tool, ``#### n`` straight after the
prompt (a product a tiny model cannot compute: a guess), so it calls the tool on some prompts and
guesses on others: a student that uses the tool badly, which the teacher's calls can correct.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from opd_exp.config.world import EmbeddedPairConfig, TaskConfig
from opd_exp.tasks.base import Problem

# bump when what a draw looks like changes (it is in both models' cache keys)
RECIPE = 1
# the student's share of draws answered without the tool
DIRECT_SHARE = 0.5


def sft_data(task: TaskConfig, pair: EmbeddedPairConfig) -> tuple[list, list]:
    """(eval problems, SFT problems): drawn from the pair's own seed, never touching the eval set."""
    from opd_exp.tasks.calc_tool import CalcToolTask

    world = CalcToolTask(task)
    evals = world.eval_problems()
    return evals, world.train_split(pair.n_sft, 10_000 + pair.seed, {p.prompt for p in evals})


def direct(problem: Problem) -> Problem:
    """``problem`` answered without the tool."""
    return Problem(prompt=problem.prompt, answer=problem.answer, solution=f"#### {problem.answer}")


def with_direct_answers(problems: Sequence[Problem], share: float, seed: int) -> list[Problem]:
    """``problems`` with a ``share`` of them (a fixed random subset) answered without the tool."""
    rng = random.Random(f"tool-direct-{seed}")
    return [direct(p) if rng.random() < share else p for p in problems]


def model_key(role: str, model: dict, tokenizer_hash: str, pair: EmbeddedPairConfig, task: TaskConfig, version: int) -> dict:
    """What shapes a prepared model of the tool world."""
    return {
        "world_version": version,
        "world": "calc_tool",
        "recipe": {"version": RECIPE, **({"direct_share": DIRECT_SHARE} if role == "student" else {})},
        "role": role,
        "model": model,
        "tokenizer": tokenizer_hash,
        "data": {"n_sft": pair.n_sft, "seed": pair.seed, "n_check": pair.n_check},
        "task": {
            "min_operands": task.min_operands,
            "max_operands": task.max_operands,
            "max_digits": task.max_digits,
            "n_eval": task.n_eval,
            "eval_seed": task.eval_seed,
        },
    }
