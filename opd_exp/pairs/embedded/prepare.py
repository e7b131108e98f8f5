"""Prepare the embedded pair: tokenizer, a teacher trained to high accuracy, a warmed-up student.

Each artefact is a cache entry keyed by everything that shapes it (see ``cache.py``), so the
first run builds it (with a progress bar) and later runs load it. ``opd-prepare`` builds
them on purpose and prints where they are and how well each model does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd_exp.config.checks import fail
from opd_exp.config.world import (
    EmbeddedModelConfig,
    EmbeddedPairConfig,
    TaskConfig,
    as_pair_config,
    as_task_config,
)
from opd_exp.pairs.embedded import cache
from opd_exp.pairs.embedded.tokenizer import SPECIAL_TOKENS, TOKENIZER_CLASS, load_tokenizer, save_tokenizer
from opd_exp.runtime import files
from opd_exp.tasks.arithmetic import ArithmeticSpec, eval_split, train_split

log = logging.getLogger("opd_exp.pairs")

# Bump when generation, tokenizer or training code changes what an entry contains.
# 2: SFT batches no longer length-bucketed (entries built before were worse teachers).
# task.n_eval stays in the key on purpose: the SFT data excludes exactly the eval set, so another
# n_eval is another teacher; such a rebuild is announced with its reason before it starts, and
# the prepared pairs every measurement in docs/ was taken on keep their keys.
WORLD_VERSION = 2
# Seconds per SFT step of the default teacher (hidden 64, 2 layers, batch 64) on one core of
# a shared 2-core machine (4000 steps took about 6 min): the announced estimate scales it.
SECONDS_PER_STEP = 0.09
# Embedded tasks besides arithmetic, each with its own generator; their cache keys carry a
# "world" entry, so arithmetic keys (and entries) are exactly what they were before.
EMBEDDED_TASKS = ("multimodal", "calc_tool")


@dataclass
class PreparedPair:
    student: Path | None  # HF folder of the warmed-up student (None when ``roles`` left it out)
    teacher: Path | None  # HF folder of the trained teacher (None when ``roles`` left it out)
    tokenizer: Path  # HF folder of the shared tokenizer
    info: dict  # manifest "info" of each model: accuracy, format_rate, seconds, params


def world_task_config(task_cfg: Any = None) -> TaskConfig:
    """The arithmetic task the embedded pair is trained for.

    With an arithmetic task config its difficulty and eval split are used (the models must be
    good at *that* task); any other task (e.g. gsm8k) falls back to the default arithmetic
    world, since these tiny models only ever know arithmetic.
    """
    task = as_task_config(task_cfg)
    if task.name in EMBEDDED_TASKS:
        return task
    if task.name != "arithmetic":
        log.warning("task %r is not arithmetic: the embedded pair is prepared for the default arithmetic task", task.name)
        return TaskConfig()
    return task


def _spec(task: TaskConfig) -> ArithmeticSpec:
    return ArithmeticSpec(task.min_operands, task.max_operands, task.max_digits, task.ops)


def tokenizer_key() -> dict:
    return {"world_version": WORLD_VERSION, "kind": "bytes", "special_tokens": SPECIAL_TOKENS, "class": TOKENIZER_CLASS}


def model_key(role: str, pair: EmbeddedPairConfig, task: TaskConfig) -> dict:
    """What shapes a prepared model: its recipe, the data recipe, the task's difficulty and eval split.

    ``task.seed`` and ``task.n_train`` only choose the trainer's problems, so they are left out:
    a seed sweep reuses one prepared pair.
    """
    model: EmbeddedModelConfig = getattr(pair, role)
    if role == "teacher" and pair.recovery > 0:  # only then: every other key stays what it was
        from opd_exp.pairs.embedded.recovery import RECIPE

        plain = model_key(role, dataclasses.replace(pair, recovery=0.0), task)
        return {**plain, "recovery": {"share": pair.recovery, "recipe": RECIPE}}
    if role == "student" and pair.privileged > 0:  # only then: every other key stays what it was
        from opd_exp.pairs.embedded.privileged import RECIPE

        plain = model_key(role, dataclasses.replace(pair, privileged=0.0), task)
        return {**plain, "privileged": {"share": pair.privileged, "recipe": RECIPE}}
    if pair.sft_ops:  # in the key only when set: every other key stays what it was
        if task.name in EMBEDDED_TASKS:
            fail("model_pair.embedded.sft_ops", pair.sft_ops, f"null with task={task.name} (operators are arithmetic's)")
        return {**model_key(role, dataclasses.replace(pair, sft_ops=None), task), "sft_ops": pair.sft_ops}
    if task.name == "calc_tool":
        from opd_exp.pairs.embedded import tool

        return tool.model_key(role, dataclasses.asdict(model), cache.key_hash(tokenizer_key()), pair, task, WORLD_VERSION)
    if task.name == "multimodal":
        return {
            "world_version": WORLD_VERSION,
            "world": "multimodal",
            "role": role,
            "model": dataclasses.asdict(model),
            "tokenizer": cache.key_hash(tokenizer_key()),
            "data": {"n_sft": pair.n_sft, "seed": pair.seed, "n_check": pair.n_check},
            "task": {
                "min_answers": task.min_answers,
                "max_answers": task.max_answers,
                "n_eval": task.n_eval,
                "eval_seed": task.eval_seed,
            },
        }
    return {
        "world_version": WORLD_VERSION,
        "role": role,
        "model": dataclasses.asdict(model),
        "tokenizer": cache.key_hash(tokenizer_key()),
        "data": {"n_sft": pair.n_sft, "seed": pair.seed, "n_check": pair.n_check},
        "task": {
            "min_operands": task.min_operands,
            "max_operands": task.max_operands,
            "max_digits": task.max_digits,
            "ops": task.ops,
            "n_eval": task.n_eval,
            "eval_seed": task.eval_seed,
        },
    }


def auto_threads() -> int:
    """Torch threads for tiny models: few, and never more than the idle cores.

    Oversubscribed OpenMP threads spin-wait: on a busy 2-core machine one SFT step took
    1186 ms with 2 threads and 56 ms with 1. Tiny models gain little beyond 4 threads.
    """
    cpus = os.cpu_count() or 1
    try:
        idle = int(cpus - os.getloadavg()[0])
    except (OSError, AttributeError):  # no load average on this platform
        idle = cpus
    return max(1, min(4, cpus // 2, idle))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Use ``n`` torch CPU threads inside the block (0 = ``auto_threads()``), then restore."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n if n > 0 else auto_threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _build_tokenizer(folder: Path) -> dict:
    save_tokenizer(folder)
    return {"vocab": len(load_tokenizer(folder))}


def embedded_tokenizer_dir() -> Path:
    """The embedded tokenizer's cache folder, copied from the package (or built) on first use."""
    return cache.get_or_build("embedded-tokenizer", tokenizer_key(), _build_tokenizer, shipped=True)


def _sft_data(task: TaskConfig, pair: EmbeddedPairConfig) -> tuple[list, list]:
    """(eval problems, SFT problems): SFT data drawn from the pair's own seed, never touching
    the task's eval set. Multimodal draws carry one random valid answer each, so the teacher
    learns to spread its mass over all of them."""
    if task.name == "calc_tool":
        from opd_exp.pairs.embedded.tool import sft_data

        return sft_data(task, pair)
    if task.name == "multimodal":
        from opd_exp.tasks import multimodal

        spec = multimodal.spec_of(task)
        evals = multimodal.eval_split(spec, task.n_eval, task.eval_seed)
        return evals, multimodal.train_split(spec, pair.n_sft, seed=10_000 + pair.seed, exclude={p.prompt for p in evals})
    spec = _spec(task)
    evals = eval_split(spec, task.n_eval, task.eval_seed)
    exclude = {p.prompt for p in evals}
    if pair.sft_ops:  # an expert: drawn from its operators, checked on the eval problems of its domain
        spec = dataclasses.replace(spec, ops=pair.sft_ops)
        evals = [p for p in evals if set(pair.sft_ops) >= {c for c in p.prompt if c in "+-*"}]
    return evals, train_split(spec, pair.n_sft, seed=10_000 + pair.seed, exclude=exclude)


def _build_model(folder: Path, role: str, pair: EmbeddedPairConfig, task: TaskConfig, tok_dir: Path, progress: bool) -> dict:
    from opd_exp.pairs.embedded.models import build_model, count_parameters, save_model
    from opd_exp.pairs.embedded.sft import sft_train
    from opd_exp.tasks import build_task
    from opd_exp.training.evaluate import evaluate_accuracy

    recipe: EmbeddedModelConfig = getattr(pair, role)
    tokenizer = load_tokenizer(tok_dir)
    evals, problems = _sft_data(task, pair)
    if role == "teacher" and pair.recovery > 0:
        from opd_exp.pairs.embedded.recovery import with_recovery

        problems = with_recovery(problems, pair.recovery, pair.seed)
    context = role == "student" and pair.privileged > 0
    if context:
        from opd_exp.pairs.embedded.privileged import with_privileged

        problems = with_privileged(problems, pair.privileged, pair.seed)
    if role == "student" and task.name == "calc_tool":  # a student that answers some prompts without the tool
        from opd_exp.pairs.embedded.tool import DIRECT_SHARE, with_direct_answers

        problems = with_direct_answers(problems, DIRECT_SHARE, pair.seed)
    seed = pair.seed * 2 + (0 if role == "teacher" else 1)
    model = build_model(recipe, tokenizer, seed=seed)
    fit = sft_train(
        model,
        tokenizer,
        problems,
        steps=recipe.sft_steps,
        batch_size=recipe.batch_size,
        lr=recipe.lr,
        seed=seed,
        progress=f"{role} SFT" if progress else False,
    )
    checks = evals[: pair.n_check]
    started = time.perf_counter()
    score = {"accuracy": float("nan"), "format_rate": float("nan"), "n": 0}
    extra: dict[str, float] = {}
    if checks:
        max_new = max(len(p.solution) for p in checks) + 8
        score = evaluate_accuracy(model, tokenizer, build_task(task), checks, batch_size=256, max_new_tokens=max_new)
        if context:  # the same problems asked as teacher.privileged asks them: how much the context helps
            from opd_exp.pairs.embedded.privileged import KINDS
            from opd_exp.training.teacher_prompt import with_context

            for kind in KINDS:
                asked = [with_context(p, kind) for p in checks]
                got = evaluate_accuracy(model, tokenizer, build_task(task), asked, batch_size=256, max_new_tokens=max_new)
                extra[f"accuracy_{kind}"] = got["accuracy"]
    save_model(model, tokenizer, folder)
    return {
        "role": role,
        "accuracy": score["accuracy"],
        **extra,
        "format_rate": score["format_rate"],
        "n_check": score["n"],
        "params": count_parameters(model),
        "sft_seconds": round(fit["seconds"], 2),
        "check_seconds": round(time.perf_counter() - started, 2),
        "final_loss": fit["loss"],
    }


def prepare_embedded(
    pair_cfg: Any = None,
    task_cfg: Any = None,
    *,
    progress: bool = True,
    force: bool = False,
    roles: tuple[str, ...] = ("teacher", "student"),
) -> PreparedPair:
    """Build (or load from the cache) the embedded tokenizer, teacher and student.

    ``pair_cfg`` is an ``EmbeddedPairConfig`` or a ``ModelPairConfig`` (its ``embedded``);
    ``force`` discards existing entries first; ``roles`` narrows what is prepared (a pair option
    used as one teacher of a map needs no student of its own).
    """
    if pair_cfg is None:
        pair = EmbeddedPairConfig()
    elif isinstance(pair_cfg, EmbeddedPairConfig):
        pair = pair_cfg
    else:
        pair = as_pair_config(pair_cfg).embedded
    task = world_task_config(task_cfg)
    keys = {"tokenizer": tokenizer_key(), **{role: model_key(role, pair, task) for role in roles}}
    if force:
        for kind, key in keys.items():
            files.discard(cache.entry_path(f"embedded-{kind}", key))
    with torch_threads(pair.threads):
        # --force builds from scratch; otherwise a recipe the package ships is copied, not built
        tok_dir = cache.get_or_build("embedded-tokenizer", keys["tokenizer"], _build_tokenizer, shipped=not force)
        folders = {}
        for role in roles:
            entry = cache.entry_path(f"embedded-{role}", keys[role])
            if cache.check_entry(entry) is not None and (force or cache.shipped_entry(entry.name) is None):
                announce(build_announcement(role, getattr(pair, role), keys[role]))
            folders[role] = cache.get_or_build(
                f"embedded-{role}",
                keys[role],
                lambda tmp, role=role: _build_model(tmp, role, pair, task, tok_dir, progress),
                shipped=not force,
            )
    info = {
        role: {**cache.read_manifest(folders[role]).get("info", {}), "hash": cache.read_manifest(folders[role]).get("hash")}
        for role in folders
    }
    return PreparedPair(student=folders.get("student"), teacher=folders.get("teacher"), tokenizer=tok_dir, info=info)


def announce(line: str) -> None:
    """One line on stderr before a build starts (the build itself shows a progress bar)."""
    print(line, file=sys.stderr, flush=True)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def build_announcement(role: str, recipe: EmbeddedModelConfig, key: dict) -> str:
    """What is built, why (first build, its own entry damaged, or which recipe keys differ from
    the newest cached entry), where, and about how long."""
    kind = f"embedded-{role}"
    path = cache.entry_path(kind, key)
    cached = cache.cached_keys(kind)
    damage = cache.check_entry(path)  # this recipe's own entry: damaged is not "another recipe"
    if damage not in (None, "missing"):
        why = f"its cached entry is damaged ({damage}): it is discarded and rebuilt from the same recipe"
    elif cached:
        old = _flat(cached[0][1].get("key", {}))
        new = _flat(json.loads(json.dumps(key, default=str)))
        diff = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        why = f"its recipe differs from the cached one ({', '.join(diff[:4]) or 'same recipe, entry damaged'})"
    else:
        why = "not in the cache yet (first run on this machine)"
    default = _teacher_defaults()
    scale = (
        (recipe.hidden_size / default.hidden_size) ** 2
        * (recipe.num_layers / default.num_layers)
        * (recipe.batch_size / default.batch_size)
    )
    minutes = recipe.sft_steps * SECONDS_PER_STEP * scale / 60
    took = f"about {minutes:.0f} min" if minutes >= 1 else "under a minute"
    return f"opd-exp: building the embedded {role} once ({recipe.sft_steps} SFT steps, {took} on a laptop CPU): {why}; cached in {path}"


def _teacher_defaults() -> EmbeddedModelConfig:
    return EmbeddedPairConfig().teacher
