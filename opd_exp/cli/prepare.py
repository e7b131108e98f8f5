"""``opd-prepare``: build (or check) the cached embedded teacher/student pair and report it."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from opd_exp.config.world import ModelPairConfig, TaskConfig
from opd_exp.pairs.embedded import cache
from opd_exp.pairs.embedded.prepare import prepare_embedded
from opd_exp.runtime.errors import ConfigError, first_line


def _parse_overrides(overrides: Sequence[str]) -> tuple[ModelPairConfig, TaskConfig]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured({"model_pair": ModelPairConfig(), "task": TaskConfig()})
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].startswith(("model_pair.", "task.")):
            raise ConfigError(
                f"override: got {item!r}; allowed: key=value with a key under model_pair. or task. (e.g. model_pair.embedded.teacher.sft_steps=100)"
            )
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"override: {first_line(exc)}") from None
    return obj["model_pair"], obj["task"]


def main(argv: Sequence[str] | None = None) -> int:
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
