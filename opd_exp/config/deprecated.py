"""Old config keys, accepted for one release with a one-line notice.

The ``trainer`` group used to hold evaluation, checkpointing and hardware settings as well as
the loop; they now live in their own groups (``eval``, ``checkpoint``, ``scale``). An old
dotted key on the command line (``trainer.eval_every=100``) is rewritten to its new key before
Hydra composes, with one line on stderr; the settings fingerprint a checkpoint of an older run
stored is read through ``upgrade_flat``, so its resume compares today's keys.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

# old dotted key -> new dotted key
RENAMED: dict[str, str] = {
    "trainer.eval_every": "eval.every",
    "trainer.eval_size": "eval.size",
    "trainer.eval_batch_size": "eval.batch_size",
    "trainer.eval_samples": "eval.samples",
    "trainer.save_every": "checkpoint.every",
    "trainer.keep_checkpoints": "checkpoint.keep",
    "trainer.extend": "checkpoint.extend",
    **{
        f"trainer.{k}": f"scale.{k}"
        for k in (
            "device",
            "precision",
            "num_threads",
            "parallel",
            "param_dtype",
            "teacher_dtype",
            "grad_checkpointing",
            "fused_lm_head",
            "teacher_device",
            "lora_rank",
            "lora_alpha",
            "lora_dropout",
            "lora_target_modules",
        )
    },
    # the positions group (opd_exp/config/positions.py): loss.positions=first sets positions.name,
    # the same as choosing positions=first (its group files set only the name)
    "loss.positions": "positions.name",
    "loss.position_fraction": "positions.fraction",
}

REMOVED_IN = "0.2"  # the release after this one (pyproject: 0.1.0)

# an override: optional +/++/~ prefix, the dotted key, then =value (or nothing for ~key)
_OVERRIDE = re.compile(r"^(?P<prefix>\+\+|\+|~)?(?P<key>[A-Za-z_][\w.]*)(?P<rest>(=.*)?)$", re.S)


def notice(old: str, new: str) -> str:
    return f"opd-train: {old} is deprecated and will be removed in opd-exp {REMOVED_IN}; use {new}"


def _same_setting(new: str) -> set[str]:
    """The keys an override may set ``new`` by: itself, and for a group's name (``positions.name``)
    the group's choice (``positions=first_n``)."""
    return {new, new.removesuffix(".name")} if new.endswith(".name") else {new}


def check_conflicts(overrides: Iterable[str]) -> None:
    """An old key and its new one on the same command line with different values: Hydra would
    keep whichever came last, without a word. Refused in one line naming both."""
    from opd_exp.runtime.errors import ConfigError

    given: dict[str, str] = {}  # key as given -> its last override (without the prefix)
    for item in overrides:
        m = _OVERRIDE.match(item)
        if m:
            given[m.group("key")] = item
    for old, new in RENAMED.items():
        if old not in given:
            continue
        value = given[old].partition("=")[2] if "=" in given[old] else None  # None: `~key`
        for key in sorted(_same_setting(new) & set(given)):
            if (given[key].partition("=")[2] if "=" in given[key] else None) != value:
                raise ConfigError(
                    f"{given[old]} and {given[key]}: the same setting given twice ({old} is the old name of {new}), and only "
                    f"one would be kept; allowed: {key}=<value> alone"
                )


def upgrade_overrides(overrides: Iterable[str], warn: Callable[[str], None] | None = None) -> list[str]:
    """Command-line overrides with every old key rewritten to its new one; ``warn`` gets one
    line per old key used (stderr by default). An old key beside its new one with another value
    is refused (``check_conflicts``)."""
    warn = warn or (lambda line: print(line, file=sys.stderr))
    overrides = list(overrides)
    check_conflicts(overrides)
    out, seen = [], set()
    for item in overrides:
        m = _OVERRIDE.match(item)
        new = RENAMED.get(m.group("key")) if m else None
        if new is None:
            out.append(item)
            continue
        old = m.group("key")
        if old not in seen:
            seen.add(old)
            warn(notice(old, new))
        out.append(f"{m.group('prefix') or ''}{new}{m.group('rest')}")
    return out


def upgrade_flat(values: dict[str, Any]) -> dict[str, Any]:
    """A flat ``{dotted key: value}`` map (a fingerprint) with the old keys renamed."""
    return {RENAMED.get(k, k): v for k, v in values.items()}
