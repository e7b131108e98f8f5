"""Read opd-train run folders back as tidy records, and summarise them over seeds.

A run folder (one Hydra job) holds ``metrics.jsonl`` (one JSON object per logged step, always
with ``step``) and ``.hydra/overrides.yaml`` (the command-line overrides that made the job). A
multirun folder holds one run folder per job (``multirun/<date>/<time>/<job_num>/``)::

    from opd_exp.analysis import load_runs, summary_table
    runs = load_runs("multirun/2025-01-01/12-00-00")
    for row in summary_table(runs):
        print(row["variant"], row["seeds"], row["eval/accuracy"])

A *variant* is what was compared: a job's overrides minus the seed, and minus the overrides
that every job of the folder shares (``trainer.max_steps=50`` given once on the command line
says nothing about which variant a job is). Seeds of one variant are averaged.

Needs only the standard library and PyYAML (which Hydra brings); matplotlib is imported inside
``plot_curves`` only, wandb inside ``load_wandb`` only.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SEED_KEYS = ("seed",)
TABLE_METRICS = ("eval/accuracy", "eval/jsd", "eval/kl_reverse")
CURVE_METRICS = ("jsd/mean", "kl/reverse", "eval/accuracy")
METRICS_FILE = "metrics.jsonl"


class AnalysisError(Exception):
    """A folder or metric that cannot be read; the message is one line for the user."""


@dataclass
class Run:
    """One job: where it lives, what made it, and every logged metric as a series."""

    path: Path
    overrides: dict[str, str]
    seed: int | None
    series: dict[str, list[tuple[int, float]]]  # metric -> [(step, value)] in logged order
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json, when the run finished
    variant: str = ""
    bad_lines: int = 0  # unreadable metrics.jsonl lines (e.g. the last line of a killed job)

    def metrics(self) -> list[str]:
        return sorted(self.series)

    def steps(self, metric: str) -> list[int]:
        return [s for s, _ in self.series.get(metric, [])]

    def values(self, metric: str) -> list[float]:
        return [v for _, v in self.series.get(metric, [])]

    def final(self, metric: str) -> float | None:
        """The last finite value logged for ``metric`` (the final eval for eval metrics)."""
        for _, v in reversed(self.series.get(metric, [])):
            if v is not None and math.isfinite(v):
                return v
        return None

    def steps_per_s(self) -> float | None:
        """Training steps per second: logged step times if present, else the summary's wall time."""
        times = [v for v in self.values("perf/step_s") if v is not None and math.isfinite(v) and v > 0]
        if times:
            return len(times) / sum(times)
        steps, secs = self.summary.get("steps"), self.summary.get("elapsed_s")
        if isinstance(steps, (int, float)) and isinstance(secs, (int, float)) and secs > 0:
            return steps / secs
        return None


# -- reading folders ----------------------------------------------------------


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


def _read_yaml(path: Path) -> Any:
    import yaml  # PyYAML, a dependency of omegaconf/Hydra

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def read_metrics(path: Path) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """metrics.jsonl -> ({metric: [(step, value)]}, number of unreadable lines).

    Non-numeric values are skipped; null (a NaN the trainer logged) becomes nan.
    """
    series: dict[str, list[tuple[int, float]]] = {}
    bad = 0
    for raw in Path(path).read_bytes().splitlines():
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))  # a line that is not UTF-8 counts as unreadable
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            bad += 1  # a job killed mid-write leaves a truncated last line
            continue
        for key, value in row.items():
            if key == "step" or isinstance(value, bool):
                continue
            if value is None:
                value = math.nan
            if isinstance(value, (int, float)):
                series.setdefault(key, []).append((step, float(value)))
    return series, bad


def read_run(run_dir: str | Path) -> Run:
    """One run folder (must hold metrics.jsonl) -> Run (variant filled in by ``load_runs``)."""
    run_dir = Path(run_dir)
    series, bad = read_metrics(run_dir / METRICS_FILE)
    overrides = parse_overrides(_read_yaml(run_dir / ".hydra" / "overrides.yaml") or [])
    seed: Any = next((overrides[k] for k in SEED_KEYS if k in overrides), None)
    if seed is None:  # not overridden: the composed config still says which seed ran
        config = _read_yaml(run_dir / ".hydra" / "config.yaml")
        seed = config.get("seed") if isinstance(config, dict) else None
    try:
        seed = int(seed) if seed is not None else None
    except (TypeError, ValueError):
        seed = None
    summary = {}
    if (run_dir / "summary.json").is_file():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except ValueError:
            summary = {}
    return Run(path=run_dir, overrides=overrides, seed=seed, series=series, summary=summary, bad_lines=bad)


def _natural_key(path: Path) -> list:
    # job folders 0, 1, ..., 10 in numeric order, not 0, 1, 10, 2
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(path))]


def find_run_dirs(folder: str | Path) -> list[Path]:
    """Every folder at or below ``folder`` holding metrics.jsonl (W&B's own folders skipped)."""
    folder = Path(folder)
    if not folder.exists():
        raise AnalysisError(f"no such folder: {folder}")
    if not folder.is_dir():
        raise AnalysisError(f"not a folder: {folder} (give a Hydra run or multirun folder)")
    found = [p.parent for p in folder.rglob(METRICS_FILE) if "wandb" not in p.relative_to(folder).parts[:-1]]
    if not found:
        raise AnalysisError(f"no {METRICS_FILE} under {folder}: not an opd-train run or multirun folder (or no job has logged yet)")
    return sorted(found, key=_natural_key)


def find_failed_jobs(folder: str | Path) -> list[Path]:
    """Job folders (with ``.hydra/``) that never wrote metrics.jsonl: jobs that failed at start."""
    folder = Path(folder)
    return sorted(
        (p.parent for p in folder.rglob(".hydra") if p.is_dir() and not (p.parent / METRICS_FILE).exists()),
        key=_natural_key,
    )


def variant_label(overrides: dict[str, str], drop: Iterable[str] = ()) -> str:
    """``k=v`` pairs joined by commas, without the seed and the keys in ``drop``."""
    skip = set(SEED_KEYS) | set(drop)
    return ",".join(f"{k}={v}" for k, v in overrides.items() if k not in skip)


def assign_variants(runs: Sequence[Run]) -> None:
    """Label each run by the overrides that tell the jobs apart (seed excluded)."""
    common: set[str] = set()
    if len(runs) > 1:
        first = runs[0].overrides
        common = {k for k, v in first.items() if all(r.overrides.get(k) == v for r in runs[1:])}
    for r in runs:
        r.variant = variant_label(r.overrides, drop=common) or variant_label(r.overrides) or "default"


def load_runs(folder: str | Path) -> list[Run]:
    """A multirun folder (or one run folder) -> one Run per job that logged metrics."""
    runs = [read_run(d) for d in find_run_dirs(folder)]
    assign_variants(runs)
    return runs


def latest_multirun(roots: Sequence[str | Path] = ("multirun", "../multirun")) -> Path | None:
    """The newest ``multirun/<date>/<time>`` folder that holds metrics, or None."""
    candidates = []
    for root in map(Path, roots):
        if root.is_dir():
            candidates += [p for p in root.glob("*/*") if p.is_dir() and any(p.rglob(METRICS_FILE))]
    return max(candidates, key=lambda p: (p.parent.name, p.name), default=None)


# -- W&B ----------------------------------------------------------------------


def load_wandb(project: str, entity: str | None = None, group: str | None = None, *, api=None) -> list[Run]:
    """The finished and running runs of a W&B project as Runs (needs network and a login).

    Overrides come from the run tags of the form ``key=value`` (opd-train tags each run
    with its Hydra overrides), the seed from the run config. ``api`` is a ``wandb.Api()``
    (or a stand-in with the same ``runs`` method).
    """
    if api is None:
        import wandb

        api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    filters = {"group": group} if group else None
    runs = []
    for wr in api.runs(path, filters=filters):
        overrides = parse_overrides(t for t in (wr.tags or []) if "=" in t)
        seed = overrides.get("seed", (wr.config or {}).get("seed"))
        series: dict[str, list[tuple[int, float]]] = {}
        for row in wr.scan_history():
            step = row.get("step", row.get("_step"))  # our step axis; _step is W&B's own counter
            if step is None:
                continue
            for key, value in row.items():
                if key.startswith("_") or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                series.setdefault(key, []).append((int(step), float(value)))
        runs.append(
            Run(
                path=Path(path) / wr.id,
                overrides=overrides,
                seed=int(seed) if seed is not None else None,
                series=series,
                summary=dict(wr.summary or {}),
            )
        )
    assign_variants(runs)
    return runs


# -- summaries over seeds -----------------------------------------------------


def mean_std(values: Iterable[float | None]) -> tuple[float, float, int]:
    """(mean, sample std, n) over the finite values; std is 0 for one value, nan for none."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return math.nan, math.nan, 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0), len(xs)


def group_by_variant(runs: Iterable[Run]) -> dict[str, list[Run]]:
    """{variant: runs sorted by seed}, variants in the order their first job ran."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.variant, []).append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: (r.seed is None, r.seed or 0))
    return groups


def available_metrics(runs: Iterable[Run]) -> list[str]:
    return sorted({m for r in runs for m in r.series})


def summary_table(runs: Sequence[Run], metrics: Sequence[str] = TABLE_METRICS) -> list[dict[str, Any]]:
    """One row per variant: ``variant``, ``seeds``, ``n``, each metric's final value and
    ``steps/s`` as (mean, std, n) over seeds."""
    rows = []
    for variant, rs in group_by_variant(runs).items():
        row: dict[str, Any] = {"variant": variant, "seeds": [r.seed for r in rs], "n": len(rs)}
        for m in metrics:
            row[m] = mean_std(r.final(m) for r in rs)
        row["steps/s"] = mean_std(r.steps_per_s() for r in rs)
        rows.append(row)
    return rows


def curve(runs: Sequence[Run], metric: str) -> dict[str, list[float]]:
    """Seeds of one variant on a common step axis: ``step``, ``mean``, ``std``, ``min``,
    ``max``, ``n`` per step (a step some seeds did not log averages those that did)."""
    by_step: dict[int, list[float]] = {}
    for r in runs:
        for step, v in r.series.get(metric, []):
            if math.isfinite(v):
                by_step.setdefault(step, []).append(v)  # a resumed run may repeat a step: keep both
    out: dict[str, list[float]] = {k: [] for k in ("step", "mean", "std", "min", "max", "n")}
    for step in sorted(by_step):
        vs = by_step[step]
        m, s, n = mean_std(vs)
        for k, v in zip(out, (step, m, s, min(vs), max(vs), n)):
            out[k].append(v)
    return out


# -- presentation -------------------------------------------------------------


def format_stat(stat: tuple[float, float, int], digits: int = 4) -> str:
    mean, std, n = stat
    if n == 0:
        return "n/a"
    if n == 1:
        return f"{mean:.{digits}g}"
    return f"{mean:.{digits}g} ± {std:.2g}"


def format_table(rows: Sequence[dict[str, Any]], metrics: Sequence[str] = TABLE_METRICS, fmt: str = "text") -> str:
    """The rows of ``summary_table`` as aligned text, a Markdown table, or CSV (mean,std columns)."""
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        cols = [*metrics, "steps/s"]
        w.writerow(["variant", "seeds", "n"] + [f"{c}_{x}" for c in cols for x in ("mean", "std")])
        for row in rows:
            seeds = " ".join("?" if s is None else str(s) for s in row["seeds"])
            w.writerow([row["variant"], seeds, row["n"]] + [f"{row[c][x]:.6g}" for c in cols for x in (0, 1)])
        return buf.getvalue()
    header = ["variant", "seeds", *metrics, "steps/s"]
    body = [
        [row["variant"], ",".join("?" if s is None else str(s) for s in row["seeds"])]
        + [format_stat(row[m]) for m in metrics]
        + [format_stat(row["steps/s"], digits=3)]
        for row in rows
    ]
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines) + "\n"
    if fmt != "text":
        raise AnalysisError(f"table format {fmt!r} is unknown; allowed: text, markdown, csv")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line("-" * w for w in widths), *map(line, body)]) + "\n"


def plot_curves(
    runs: Sequence[Run],
    metrics: Sequence[str] = CURVE_METRICS,
    *,
    axes=None,
    band: str = "range",
):
    """One panel per metric, one line per variant (mean over seeds) with the seeds as a
    band (``range``: min..max over seeds; ``std``: mean ± std). Returns the Figure.

    ``axes``: a sequence of matplotlib Axes to draw on (a notebook passes
    ``plt.subplots(...)[1]``); without it a pyplot-free Figure is made, safe headless.
    """
    if band not in ("range", "std"):
        raise AnalysisError(f"band {band!r} is unknown; allowed: range, std")
    if axes is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(5 * len(metrics), 3.8), layout="constrained")
        axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    else:
        axes = list(getattr(axes, "flat", axes))
        fig = axes[0].figure
    groups = group_by_variant(runs)
    for ax, metric in zip(axes, metrics):
        for i, (variant, rs) in enumerate(groups.items()):
            c = curve(rs, metric)
            if not c["step"]:
                continue
            color = f"C{i % 10}"
            ax.plot(c["step"], c["mean"], color=color, label=f"{variant} (n={len(rs)})", marker="." if len(c["step"]) < 20 else None)
            if len(rs) > 1:
                if band == "range":
                    lo, hi = c["min"], c["max"]
                else:
                    lo = [m - s for m, s in zip(c["mean"], c["std"])]
                    hi = [m + s for m, s in zip(c["mean"], c["std"])]
                ax.fill_between(c["step"], lo, hi, color=color, alpha=0.2, linewidth=0)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes:  # one legend, on the first panel that has lines
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
            break
    return fig
