"""Prepare the embedded pair: tokenizer, a teacher trained to high accuracy, a warmed-up student.

Each artefact is a cache entry keyed by everything that shapes it (see ``cache.py``), so the
first run builds it (with a progress bar) and later runs load it. ``opd-prepare`` builds
them on purpose and prints where they are and how well each model does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from opd_exp.config.world import (
    EmbeddedModelConfig, EmbeddedPairConfig, ModelPairConfig, TaskConfig, as_pair_config, as_task_config,
)
from opd_exp.errors import ConfigError
from opd_exp.world import cache
from opd_exp.world.arithmetic import ArithmeticSpec, eval_split, train_split
from opd_exp.world.tokenizer import SPECIAL_TOKENS, TOKENIZER_CLASS, load_tokenizer, save_tokenizer

log = logging.getLogger("opd_exp.world")

# Bump when generation, tokenizer or training code changes what an entry contains.
WORLD_VERSION = 2  # 2: SFT batches no longer length-bucketed (entries built before were worse teachers)


@dataclass
class PreparedPair:
    student: Path  # HF folder of the warmed-up student (weights, config, tokenizer)
    teacher: Path  # HF folder of the trained teacher
    tokenizer: Path  # HF folder of the shared tokenizer
    info: dict  # manifest "info" of each model: accuracy, format_rate, seconds, params


def world_task_config(task_cfg: Any = None) -> TaskConfig:
    """The arithmetic task the embedded pair is trained for.

    With an arithmetic task config its difficulty and eval split are used (the models must be
    good at *that* task); any other task (e.g. gsm8k) falls back to the default arithmetic
    world, since these tiny models only ever know arithmetic.
    """
    task = as_task_config(task_cfg)
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


def _build_model(folder: Path, role: str, pair: EmbeddedPairConfig, task: TaskConfig, tok_dir: Path, progress: bool) -> dict:
    from opd_exp.tasks.arithmetic import ArithmeticTask
    from opd_exp.world.models import build_model, count_parameters, save_model
    from opd_exp.world.sft import evaluate_accuracy, sft_train

    recipe: EmbeddedModelConfig = getattr(pair, role)
    tokenizer = load_tokenizer(tok_dir)
    spec = _spec(task)
    evals = eval_split(spec, task.n_eval, task.eval_seed)
    # SFT data: drawn from the pair's own seed, never touching the task's eval set.
    problems = train_split(spec, pair.n_sft, seed=10_000 + pair.seed, exclude={p.prompt for p in evals})
    seed = pair.seed * 2 + (0 if role == "teacher" else 1)
    model = build_model(recipe, tokenizer, seed=seed)
    fit = sft_train(
        model, tokenizer, problems, steps=recipe.sft_steps, batch_size=recipe.batch_size, lr=recipe.lr,
        seed=seed, progress=f"{role} SFT" if progress else False,
    )
    checks = evals[: pair.n_check]
    started = time.perf_counter()
    score = {"accuracy": float("nan"), "format_rate": float("nan"), "n": 0}
    if checks:
        max_new = max(len(p.solution) for p in checks) + 8
        score = evaluate_accuracy(model, tokenizer, ArithmeticTask(task), checks, batch_size=256, max_new_tokens=max_new)
    save_model(model, tokenizer, folder)
    return {
        "role": role,
        "accuracy": score["accuracy"],
        "format_rate": score["format_rate"],
        "n_check": score["n"],
        "params": count_parameters(model),
        "sft_seconds": round(fit["seconds"], 2),
        "check_seconds": round(time.perf_counter() - started, 2),
        "final_loss": fit["loss"],
    }


def prepare_embedded(pair_cfg: Any = None, task_cfg: Any = None, *, progress: bool = True, force: bool = False) -> PreparedPair:
    """Build (or load from the cache) the embedded tokenizer, teacher and student.

    ``pair_cfg`` is an ``EmbeddedPairConfig`` or a ``ModelPairConfig`` (its ``embedded``);
    ``force`` discards existing entries first.
    """
    if pair_cfg is None:
        pair = EmbeddedPairConfig()
    elif isinstance(pair_cfg, EmbeddedPairConfig):
        pair = pair_cfg
    else:
        pair = as_pair_config(pair_cfg).embedded
    task = world_task_config(task_cfg)
    keys = {"tokenizer": tokenizer_key(), "teacher": model_key("teacher", pair, task), "student": model_key("student", pair, task)}
    if force:
        for kind, key in keys.items():
            cache._discard(cache.entry_path(f"embedded-{kind}", key))
    with torch_threads(pair.threads):
        tok_dir = cache.get_or_build("embedded-tokenizer", keys["tokenizer"], _build_tokenizer)
        folders = {}
        for role in ("teacher", "student"):
            folders[role] = cache.get_or_build(
                f"embedded-{role}", keys[role],
                lambda tmp, role=role: _build_model(tmp, role, pair, task, tok_dir, progress),
            )
    info = {role: cache.read_manifest(folders[role]).get("info", {}) for role in folders}
    return PreparedPair(student=folders["student"], teacher=folders["teacher"], tokenizer=tok_dir, info=info)


def _parse_overrides(overrides: Sequence[str]) -> tuple[ModelPairConfig, TaskConfig]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured({"model_pair": ModelPairConfig(), "task": TaskConfig()})
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].startswith(("model_pair.", "task.")):
            raise ConfigError(f"override: got {item!r}; allowed: key=value with a key under model_pair. or task. (e.g. model_pair.embedded.teacher.sft_steps=100)")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"override: {str(exc).splitlines()[0]}") from None
    return obj["model_pair"], obj["task"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``opd-prepare [--force] [--quiet] [model_pair.embedded.x=... task.x=...]``"""
    parser = argparse.ArgumentParser(prog="opd-prepare", description="Build (or check) the cached embedded teacher/student pair.")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model_pair.embedded.teacher.sft_steps=100 task.max_digits=2")
    parser.add_argument("--force", action="store_true", help="discard the cached entries and rebuild them")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        pair_cfg, task_cfg = _parse_overrides(args.overrides)
        started = time.perf_counter()
        prepared = prepare_embedded(pair_cfg.embedded, task_cfg, progress=not args.quiet, force=args.force)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"cache: {cache.cache_root()}  ({time.perf_counter() - started:.1f} s)")
    print(f"tokenizer: {prepared.tokenizer}")
    for role in ("teacher", "student"):
        i = prepared.info[role]
        print(
            f"{role}: {getattr(prepared, role)}\n"
            f"  params={i.get('params')} greedy accuracy={i.get('accuracy'):.3f} "
            f"format_rate={i.get('format_rate'):.3f} (n={i.get('n_check')}) sft_seconds={i.get('sft_seconds')}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
