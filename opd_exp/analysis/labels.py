"""Names for the reader: metric labels, variant labels in a paper's words, titles from the sweep.

``paper_labels`` names each variant from its run's config (``JSD β=0.5``, ``reverse KL``,
``forward KL``), not from the option or folder that picked it (``jsd_0.5``); ``sweep_title``
names a figure or table from the sweep (``divergence``, on the ``embedded`` pair), not the
folder path. The run *name* (what W&B and opd-compare call a run) is ``naming.run_name``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opd_exp.analysis.runs import OWN, Run

# Short names for tables and legends, in the words of a paper (the metric keys stay exact in
# the code and in --metric).
LABELS = {
    "eval/accuracy": "eval accuracy",
    "eval/teacher_accuracy": "teacher accuracy",
    "eval/jsd": "eval JSD",
    "eval/kl_reverse": "eval KL(S‖T)",
    "eval/kl_forward": "eval KL(T‖S)",
    "jsd/mean": "train JSD",
    "kl/reverse": "train KL(S‖T)",
    "kl/forward": "train KL(T‖S)",
    "loss": "loss",
    OWN: "eval: own divergence",
}


def y_label(metric: str) -> str:
    """A panel's y-axis label: what is measured and in which unit (divergences in nats)."""
    name = metric_label(metric).removeprefix("eval: ").removeprefix("eval ").removeprefix("train ")
    if metric.endswith(("accuracy", "precision", "coverage", "pass@k")):
        return f"{name} (share of problems)"
    if metric.endswith("_rate"):  # tools/valid_rate, align/one_to_one_rate: shares, not nats
        return f"{name} (share)"
    if metric.startswith(("eval/tools/", "eval/episode/")):  # counts per episode
        return name
    if metric == OWN or metric.startswith(("eval/", "jsd/", "kl/", "exact/")) or metric.endswith("entropy"):
        return f"{name} (nats)"
    return name


def metric_label(metric: str) -> str:
    """The reader's name of a metric (``eval/kl_reverse`` -> ``eval KL(S‖T)``)."""
    if metric in LABELS:
        return LABELS[metric]
    if metric.startswith("eval/"):
        return "eval " + metric[5:]
    return metric


_SHORT_KEYS = {"divergence.beta": "β", "divergence.alpha": "α", "rollout.on_policy_fraction": "on-policy", "loss.kl_coef": "kl_coef"}
_BARE_KEYS = ("divergence", "variant", "estimator", "loss", "sweep", "divergence.name", "estimator.name", "loss.name")


def short_label(variant: str) -> str:
    """A legend label: ``divergence=jsd,divergence.beta=0.5`` -> ``jsd, β=0.5``; a dotted key
    keeps its last part (``trainer.lr=1e-3`` -> ``lr=1e-3``); a folder label is kept."""
    head, sep, rest = variant.rpartition(": ")
    parts = []
    for item in (rest if sep else variant).split(","):
        key, eq, value = item.partition("=")
        if not eq:
            parts.append(item)
        elif key in _BARE_KEYS:
            parts.append(value)
        else:
            parts.append(f"{_SHORT_KEYS.get(key, key.rsplit('.', 1)[-1])}={value}")
    label = ", ".join(parts)
    return f"{head}: {label}" if sep else label


# -- a variant in a paper's words -------------------------------------------------

DIVERGENCE_NAMES = {
    "rkl": "reverse KL",
    "fkl": "forward KL",
    "jsd": "JSD",
    "jsd_legacy": "JSD (pre-fix cost)",
    "skl": "skew KL",
    "srkl": "skew reverse KL",
    "tvd": "total variation",
}
# the parameters each built-in divergence takes (a registered one: asked of opd_exp.divergences)
DIVERGENCE_PARAMS = {
    "rkl": (),
    "fkl": ("clip",),
    "jsd": ("beta",),
    "jsd_legacy": ("beta",),
    "skl": ("alpha",),
    "srkl": ("alpha",),
    "tvd": (),
}
SYMBOLS = {"beta": "β", "alpha": "α", "temperature": "τ"}


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _divergence_params(name: str) -> tuple[str, ...]:
    if name in DIVERGENCE_PARAMS:
        return DIVERGENCE_PARAMS[name]
    try:  # a plugin divergence: the registry knows its parameters (imports torch, so only here)
        from opd_exp.divergences import parameter_names

        return tuple(parameter_names(name))
    except Exception:
        return ()


def divergence_label(divergence: Mapping[str, Any] | None) -> str | None:
    """``{"name": "jsd", "beta": 0.5, "alpha": 0.1}`` -> ``JSD β=0.5`` (only the parameters the
    divergence takes; a teacher temperature other than 1 as ``τ=2``); None without a name."""
    if not isinstance(divergence, Mapping) or not divergence.get("name"):
        return None
    name = str(divergence["name"])
    parts = [DIVERGENCE_NAMES.get(name, name)]
    for key in _divergence_params(name):
        if divergence.get(key) is not None:
            parts.append(f"{SYMBOLS.get(key, key)}={_number(divergence[key])}")
    temperature = divergence.get("temperature")
    if isinstance(temperature, (int, float)) and temperature != 1:
        parts.append(f"τ={_number(temperature)}")
    return " ".join(parts)


def run_divergence(run: Run) -> dict[str, Any] | None:
    """The run's divergence settings: its config's ``divergence`` group, else its overrides
    (``divergence=jsd``, ``divergence.beta=0.5``)."""
    div = run.config.get("divergence") if isinstance(run.config, Mapping) else None
    if isinstance(div, Mapping) and div.get("name"):
        return dict(div)
    name = run.overrides.get("divergence.name", run.overrides.get("divergence"))
    if not name:
        return None
    out: dict[str, Any] = {"name": name}
    for key, value in run.overrides.items():
        if key.startswith("divergence.") and key != "divergence.name":
            try:
                out[key.split(".", 1)[1]] = float(value)
            except ValueError:
                out[key.split(".", 1)[1]] = value
    return out


def _split_variant(variant: str) -> tuple[str, list[str]]:
    """``src: k=v,k2=v2`` -> (``src: ``, [k=v, k2=v2]); a bare folder label has no items."""
    head, sep, rest = variant.rpartition(": ")
    body = rest if sep else variant
    items = [i for i in body.split(",") if "=" in i]
    return (f"{head}: " if sep else ""), items


def trains_divergence(run: Run) -> bool:
    """False for reward-only RL (``loss.kl_coef=0``): its divergence group only names what eval
    measures, not what it trains, so it must not name the run."""
    loss = run.config.get("loss") if isinstance(run.config, Mapping) else None
    coef = loss.get("kl_coef") if isinstance(loss, Mapping) else run.overrides.get("loss.kl_coef")
    try:
        return coef is None or float(coef) != 0.0
    except (TypeError, ValueError):
        return True


def paper_labels(groups: Mapping[str, Sequence[Run]]) -> dict[str, str]:
    """{variant: its label in a paper's words}: the divergence from the config (``JSD β=0.5``;
    ``reward-only RL`` where the loss has no distillation term),
    then what else the variant overrides (``reverse KL, on-policy=0.5``); the option that
    picked the divergence (``variant=jsd_0.5``) is left out unless it is all that tells two
    variants apart. A variant named by a folder label alone keeps it (``base``); one whose
    runs carry no divergence keeps its short label."""

    def candidate(variant: str, rs: Sequence[Run], keep_variant_key: bool) -> str:
        head, items = _split_variant(variant)
        if not items and head == "" and variant != "default":
            return variant  # a folder's own label
        div = divergence_label(run_divergence(rs[0])) if rs else None
        if div is not None and not trains_divergence(rs[0]):
            div = "reward-only RL"
        if div is None:
            return short_label(variant)
        rest = [i for i in items if not i.startswith("divergence") and (keep_variant_key or not i.startswith("variant="))]
        return head + ", ".join([div] + ([short_label(",".join(rest))] if rest else []))

    for keep in (False, True):
        labels = {v: candidate(v, rs, keep) for v, rs in groups.items()}
        if len(set(labels.values())) == len(labels):
            return labels
    return {v: short_label(v) for v in groups}


# -- titles -------------------------------------------------------------------------


def _common(values: Sequence[Any]) -> Any:
    vs = set(values)
    return vs.pop() if len(vs) == 1 else None


def sweep_name(runs: Sequence[Run]) -> str | None:
    """The sweep the runs come from: Hydra's ``sweep=`` choice, else the W&B group the
    sweep file sets (``logger.group``); None when the runs do not share one."""
    chosen = _common([r.choices.get("sweep") for r in runs])
    if chosen and chosen != "None":
        return str(chosen)
    groups = [(r.config.get("logger") or {}).get("group") if isinstance(r.config.get("logger"), Mapping) else None for r in runs]
    group = _common(groups)
    return str(group) if group else None


def pair_name(runs: Sequence[Run]) -> str | None:
    """The model pair the runs share (Hydra's ``model_pair`` choice, else its config name)."""
    names = []
    for r in runs:
        pair = r.choices.get("model_pair")
        if not pair and isinstance(r.config.get("model_pair"), Mapping):
            pair = r.config["model_pair"].get("name")
        names.append(pair)
    name = _common(names)
    return str(name) if name else None


def sweep_title(sources: Sequence[tuple[str, Path]], runs: Sequence[Run]) -> str:
    """What the runs are, for a title: ``divergence sweep, embedded pair`` from their configs;
    the folder labels for several folders; the folder itself when the runs name no sweep."""
    if len(sources) > 1:
        return ", ".join(label for label, _ in sources)
    sweep, pair = sweep_name(runs), pair_name(runs)
    if sweep:
        return f"{sweep} sweep" + (f", {pair} pair" if pair else "")
    return str(sources[0][1]) if sources else "runs"


def figure_title(sources: Sequence[tuple[str, Path]], runs: Sequence[Run]) -> str:
    """``<sweep or folder(s)>: N jobs, M steps`` for a figure's title."""
    steps = sorted({max(r.steps(m)[-1] for m in r.series if r.series[m]) for r in runs if r.series})
    span = f"{steps[0]} steps" if len(steps) == 1 else f"{steps[0]}–{steps[-1]} steps" if steps else "no steps"
    return f"{sweep_title(sources, runs)}: {len(runs)} jobs, {span}"
