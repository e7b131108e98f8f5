"""Tables for the reader: the per-variant summary, a common step, steps to a threshold, paired
differences. Every table's title names its statistic (``stats.stat_name``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from opd_exp.analysis.aggregate import (
    TABLE_METRICS,
    base_variants,
    group_by_variant,
    paired,
    reach,
    reached,
    value_at,
)
from opd_exp.analysis.labels import metric_label, paper_labels
from opd_exp.analysis.runs import OWN, AnalysisError, Run
from opd_exp.analysis.stats import format_interval, stat_name

CSV_PARTS = {"std": ("mean", "std"), "ci95": ("mean", "ci95"), "minmax": ("mean", "min", "max")}


def format_stat(stat: tuple[float, Any, int], digits: int = 4, signed: bool = False) -> str:
    """A ``seed_stat`` cell: ``0.51 ± 0.025`` (std or ci95 half-width), ``0.51 (0.5..0.52)``
    (minmax), the value alone for one seed, ``n/a`` for none."""
    mean, spread, n = stat
    if n == 0:
        return "n/a"
    if not math.isfinite(mean):  # a run that ended diverged (see seed_stat)
        return str(mean)
    value = f"{mean:+.{digits}g}" if signed else f"{mean:.{digits}g}"
    if n == 1:
        return value
    if isinstance(spread, tuple):
        lo, hi = spread
        return f"{value} ({lo:+.{digits}g}..{hi:+.{digits}g})" if signed else f"{value} ({lo:.{digits}g}..{hi:.{digits}g})"
    return f"{value} ± {spread:.2g}"


def _csv_stat(cell: tuple[float, Any, int]) -> list[str]:
    mean, spread, _ = cell
    return [f"{mean:.6g}"] + ([f"{x:.6g}" for x in spread] if isinstance(spread, tuple) else [f"{spread:.6g}"])


def table_columns(rows: Sequence[dict[str, Any]], metrics: Sequence[str] = TABLE_METRICS, before: bool = True) -> list[tuple[str, str]]:
    """(header, row key) of each value column: per metric before / after / Δ (or the final
    value alone), then the own divergence's, then steps/s."""
    cols: list[tuple[str, str]] = []
    names = list(metrics) + ([OWN] if rows and OWN in rows[0] else [])
    for m in names:
        label = metric_label(m)
        if before:
            cols += [(f"{label} before", f"{m} before"), (f"{label} after", m), (f"Δ {label}", f"{m} delta")]
        else:
            cols.append((label, m))
    return cols + [("steps/s", "steps/s")]


def format_table(rows: Sequence[dict[str, Any]], metrics: Sequence[str] = TABLE_METRICS, fmt: str = "text", *, before: bool = True) -> str:
    """The rows of ``summary_table`` as aligned text, a Markdown table, or CSV (mean and
    spread columns named by the rows' statistic: ``_std``, ``_ci95``, ``_min``/``_max``; exact
    metric keys). ``before``: before / after / Δ columns per metric."""
    cols = table_columns(rows, metrics, before)
    own = bool(rows) and OWN in rows[0]
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        keys = [k for _, k in cols]
        parts = CSV_PARTS[rows[0].get("stat", "std") if rows else "std"]
        w.writerow(["variant", "seeds", "n"] + (["divergence"] if own else []) + [f"{k}_{x}" for k in keys for x in parts])
        for row in rows:
            seeds = " ".join("?" if s is None else str(s) for s in row["seeds"])
            lead = [row["variant"], seeds, row["n"]] + ([row["divergence"]] if own else [])
            w.writerow(lead + [x for k in keys for x in _csv_stat(row[k])])
        return buf.getvalue()
    header = ["variant", "seeds"] + (["divergence"] if own else []) + [h for h, _ in cols]
    body = [
        [row["variant"], ",".join("?" if s is None else str(s) for s in row["seeds"])]
        + ([row["divergence"]] if own else [])
        + [format_stat(row[k], digits=3 if k == "steps/s" else 4, signed=k.endswith(" delta")) for _, k in cols]
        for row in rows
    ]
    return render(header, body, fmt)


def render(header: Sequence[str], body: Sequence[Sequence[Any]], fmt: str = "text") -> str:
    """Rows of cells as aligned text, a Markdown table, or CSV."""
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(header)
        w.writerows(body)
        return buf.getvalue()
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(map(str, r)) + " |" for r in body]
        return "\n".join(lines) + "\n"
    if fmt != "text":
        raise AnalysisError(f"table format {fmt!r} is unknown; allowed: text, markdown, csv")
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line("-" * w for w in widths), *map(line, body)]) + "\n"


def _digits(values: Sequence[float | None], default: int = 3) -> int:
    """Decimals for a column: 3 for values below 10, 1 below 1000, else none (tokens)."""
    xs = [abs(v) for v in values if v is not None and math.isfinite(v)]
    top = max(xs, default=0.0)
    return default if top < 10 else 1 if top < 1000 else 0


def _seeds(rs: Sequence[Run]) -> str:
    return ",".join("?" if r.seed is None else str(r.seed) for r in rs)


def _cell(values: Sequence[float | None], stat: str, *, signed: bool = False, digits: int | None = None) -> str:
    return format_interval(values, stat, _digits(values) if digits is None else digits, signed=signed)


def _label_for(groups: Mapping[str, Sequence[Run]], labels: Mapping[str, str] | None) -> dict[str, str]:
    return dict(labels) if labels is not None else paper_labels(groups)


def at_step_table(
    runs: Sequence[Run],
    step: int,
    metrics: Sequence[str] = TABLE_METRICS,
    *,
    stat: str = "ci95",
    fmt: str = "text",
    labels: Mapping[str, str] | None = None,
    own: bool = True,
) -> tuple[str, str, list[Run]]:
    """Every run read at ``step`` (``value_at``: the last value logged at or before it), one row
    per variant (paper labels unless ``labels``), ``stat`` over seeds. Returns (title, table,
    the runs that never reached ``step``, left out)."""
    if step < 0:
        raise AnalysisError(f"--at-step {step}: a step is >= 0; allowed: a logged step such as 100")
    present, missing = reached(runs, step)
    if not present:
        last = max((r.last_step() or 0 for r in runs), default=0)
        raise AnalysisError(f"--at-step {step}: no run reached step {step}; allowed: a step <= {last} (the furthest run's last step)")
    groups = group_by_variant(present)
    names = _label_for(group_by_variant(runs), labels)
    cols = [*metrics, *([OWN] if own else [])]
    header = ["variant", "seeds", *(metric_label(m) for m in cols)]
    body = [[names.get(v, v), _seeds(rs), *(_cell([value_at(r, m, step) for r in rs], stat) for m in cols)] for v, rs in groups.items()]
    title = f"at step {step}: {len(present)} jobs, {len(groups)} variants; {stat_name(stat)}"
    return title, render(header, body, fmt), missing


def missing_line(step: int, missing: Sequence[Run], labels: Mapping[str, str] | None = None) -> str:
    """One line naming the runs that never reached ``step``."""
    names = labels or {}
    each = [f"{r.path} ({names.get(r.variant, r.variant)}, seed {r.seed}, last step {r.last_step()})" for r in missing]
    return f"not at step {step}, left out: {len(missing)}: " + "; ".join(each)


def reach_table(
    runs: Sequence[Run],
    metric: str,
    op: str,
    value: float,
    *,
    stat: str = "ci95",
    fmt: str = "text",
    labels: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """Steps, sampled tokens and training seconds to the first step where ``metric op value``
    holds, per variant: the seeds that reached it (``k/n``), ``stat`` over those seeds, and
    each seed's step (``—``: not reached by its last step). Returns (title, table)."""
    groups = group_by_variant(runs)
    names = _label_for(groups, labels)
    header = ["variant", "seeds", "reached", "steps", "sampled tokens", "training s", "step per seed"]
    body = []
    for v, rs in groups.items():
        got = [reach(r, metric, op, value) for r in rs]
        hit = [g for g in got if g["step"] is not None]
        per_seed = ", ".join(f"{int(g['step'])}" if g["step"] is not None else f"— (by {r.last_step()})" for r, g in zip(rs, got))
        body.append(
            [
                names.get(v, v),
                _seeds(rs),
                f"{len(hit)}/{len(rs)}",
                _cell([g["step"] for g in hit], stat, digits=0),
                _cell([g["tokens"] for g in hit], stat, digits=0),
                _cell([g["seconds"] for g in hit], stat, digits=1),
                per_seed,
            ]
        )
    title = f"to {metric_label(metric)} {op} {value:g}: the first logged step per seed; {stat_name(stat)} that reached it"
    return title, render(header, body, fmt)


def paired_table(
    runs: Sequence[Run],
    base: str,
    metrics: Sequence[str] = TABLE_METRICS,
    *,
    step: int | None = None,
    stat: str = "ci95",
    fmt: str = "text",
    labels: Mapping[str, str] | None = None,
    reach_spec: tuple[str, str, float] | None = None,
) -> tuple[str, str, list[str]]:
    """Each variant minus its base (``base_variants``), seed by seed: per metric the
    differences at the final step (or at ``step``), ``stat`` over the seeds, then each seed's
    difference; with ``reach_spec`` also the steps to it (seeds where both reached it).
    Returns (title, table, notes on seeds with no base run)."""
    groups = group_by_variant(runs)
    names = _label_for(groups, labels)
    pairs = base_variants(groups, base)
    at = (lambda m: lambda r: r.final(m)) if step is None else (lambda m: lambda r: value_at(r, m, step))
    getters = [(f"Δ {metric_label(m)}", at(m)) for m in metrics]
    if reach_spec is not None:
        metric, op, value = reach_spec
        getters.append((f"Δ steps to {metric_label(metric)} {op} {value:g}", lambda r: reach(r, metric, op, value)["step"]))
    header = ["variant", "base", "seeds", *(h for h, _ in getters)]
    body, notes = [], []
    for v, b in pairs.items():
        row = [names.get(v, v), names.get(b, b)]
        seeds_used: set = set()
        cells = []
        for head, get in getters:
            d, seeds, unpaired = paired(groups[v], groups[b], get)
            seeds_used |= set(seeds)
            digits = 0 if head.startswith("Δ steps") else _digits(d)
            each = ", ".join(f"{x:+.{digits}f}" for x in d)
            cells.append(f"{_cell(d, stat, signed=True, digits=digits)} ({each})" if d else "—")
        if unpaired:
            notes.append(f"{names.get(v, v)}: seed(s) {', '.join(map(str, unpaired))} have no run of {names.get(b, b)}, left out")
        body.append([*row, ",".join(map(str, sorted(seeds_used, key=lambda s: (s is None, s or 0)))), *cells])
    where = "at the final step" if step is None else f"at step {step}"
    title = f"difference from the base ({base}), paired by seed, {where}; {stat_name(stat).replace('mean', 'mean difference', 1)}, then per seed"
    return title, render(header, body, fmt), notes
