"""Run names: the one owner of what a run (a variant) is called, for W&B and opd-compare alike.

A run's name is the ``k=v`` overrides that define its variant, joined by commas
(``divergence=jsd,divergence.beta=0.3``), or ``default``:

- in a multirun, the swept overrides (what tells its jobs apart), never the seed;
- in a single run, the overrides that pick the OPD variant (``VARIANT_KEYS``: divergence,
  estimator, loss, ...), not its bookkeeping (``eval.every=25``) or budgets
  (``trainer.max_steps=100``), which are the setting, not the variant.

``opd_exp.sinks.tracking`` names the W&B run's ``variant`` with ``run_name``; ``load_runs``
names a folder's runs with it, so both say the same for the same run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from opd_exp.runtime.fingerprint import IGNORED

if TYPE_CHECKING:
    from opd_exp.analysis.runs import Run

SEED_KEYS = ("seed",)
# overrides that never tell a variant: where and how a run reports, not what it trains
NOT_VARIANT = ("hydra.", "hydra/", "logger.", "logger=", "model_pair", "task.path", "scale.device", "scale.num_threads")
# in a single run, the overrides that pick the OPD variant (the rest, budgets and sizes, is
# the setting: it is in the config, not in the name)
VARIANT_KEYS = ("variant", "experiment", "divergence", "estimator", "loss", "rollout.on_policy_fraction")


def override_key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def parse_overrides(items: Iterable[str]) -> dict[str, str]:
    """Hydra override strings -> {key: value}, in order (``+k=v``/``++k=v`` as ``k``; ``~k`` skipped)."""
    out: dict[str, str] = {}
    for item in items:
        item = str(item).strip()
        if not item or item.startswith("~") or "=" not in item:
            continue
        key, value = item.split("=", 1)
        out[key.lstrip("+")] = value
    return out


def variant_overrides(overrides: Iterable[str], swept: Iterable[str] | None = None) -> list[str]:
    """The overrides that define a run's variant: with ``swept`` (a multirun's swept keys) the
    swept ones (not the seed); without, those that pick the variant (``VARIANT_KEYS``)."""
    swept = None if swept is None else set(swept)
    out = []
    for o in overrides:
        o = str(o).lstrip("+~")
        k = override_key(o)
        if "=" not in o or k in SEED_KEYS or o.startswith(NOT_VARIANT):
            continue
        if swept:
            if k in swept:
                out.append(o)
        elif k not in IGNORED and (k in VARIANT_KEYS or k.startswith(tuple(f"{v}." for v in VARIANT_KEYS))):
            out.append(o)
    return out


def variant_name(variant: Iterable[str]) -> str:
    """``k=v`` joined by commas, or ``default``."""
    return ",".join(variant) or "default"


def run_name(overrides: Iterable[str] | Mapping[str, str], swept: Iterable[str] | None = None) -> str:
    """The name of a run's variant (``variant_name(variant_overrides(...))``); ``overrides`` as
    Hydra strings or as a parsed {key: value}."""
    if isinstance(overrides, Mapping):
        overrides = [f"{k}={v}" for k, v in overrides.items()]
    return variant_name(variant_overrides(overrides, swept))


def variant_label(overrides: Mapping[str, str], drop: Iterable[str] = ()) -> str:
    """``k=v`` pairs joined by commas, without the seed and the keys in ``drop``."""
    skip = set(SEED_KEYS) | set(drop)
    return ",".join(f"{k}={v}" for k, v in overrides.items() if k not in skip)


def assign_variants(runs: Sequence[Run]) -> None:
    """Name each run: one run by ``run_name`` (as W&B names it); the jobs of a multirun by
    the overrides that tell them apart (the swept ones), the seed excluded. Where the W&B rule
    would give two different override sets one name (both differ only in ``model_pair``),
    the full set of differing overrides is kept."""
    if len(runs) == 1:
        runs[0].variant = run_name(runs[0].overrides)
        return
    common: set[str] = set()
    if runs:
        first = runs[0].overrides
        common = {k for k, v in first.items() if all(r.overrides.get(k) == v for r in runs[1:])}
    swept = {k for r in runs for k in r.overrides if k not in common} - set(SEED_KEYS)
    named = {}
    for r in runs:
        full = variant_label(r.overrides, drop=common) or variant_label(r.overrides) or "default"
        # seeds alone swept: one variant, named as a single run is
        named[id(r)] = (run_name(r.overrides, swept) if swept else run_name(r.overrides), full)
    by_name: dict[str, set[str]] = {}
    for name, full in named.values():
        by_name.setdefault(name, set()).add(full)
    for r in runs:
        name, full = named[id(r)]
        r.variant = name if len(by_name[name]) == 1 else full
