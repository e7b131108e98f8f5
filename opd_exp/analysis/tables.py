"""Tables for the reader: the per-variant summary, a common step, steps to a threshold, paired
differences. Every table's title names its statistic (``stats.stat_name``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from opd_exp.analysis.aggregate import (
    PHASES,
    TABLE_METRICS,
    TOKEN_PHASES,
    base_variants,
    flop_ratio,
    group_by_variant,
    paired,
    parameter_counts,
    phase_stats,
    reach,
    reached,
    value_at,
)
from opd_exp.analysis.labels import metric_label, paper_labels
from opd_exp.analysis.runs import OWN, AnalysisError, Run
from opd_exp.analysis.stats import format_interval, seed_stat, stat_name

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


# -- where a step's time goes ------------------------------------------------------------

PHASE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("step s", "step_s"),
    *((f"{p} s", f"{p}_s") for p in PHASES),
    *((f"{p} %", f"{p}_share") for p in (*PHASES, "other")),
    *((f"{p} tok/s", f"{p}_tokens_per_s") for p in TOKEN_PHASES),
)


def _sig_decimals(values: Sequence[float | None], sig: int = 3) -> int:
    """Decimals that show the column's largest value to ``sig`` significant digits (0.0937 -> 4)."""
    xs = [abs(v) for v in values if v is not None and math.isfinite(v) and v != 0]
    if not xs:
        return 3
    return max(0, sig - 1 - math.floor(math.log10(max(xs))))


def format_count(n: int | None) -> str:
    """A parameter count to three digits: 81984 -> ``82.0k``, 140032 -> ``140k``, 134515008 ->
    ``135M``, 1543714304 -> ``1.54B``; ``—`` for none."""
    if n is None:
        return "—"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            x = n / div
            return f"{x:.{2 if x < 10 else 1 if x < 100 else 0}f}{unit}"
    return str(n)


def phase_table(
    runs: Sequence[Run], *, stat: str = "ci95", fmt: str = "text", labels: Mapping[str, str] | None = None
) -> tuple[str, str, list[str]]:
    """Where each variant's step goes (``aggregate.phase_stats`` per run, then ``stat`` over
    seeds): seconds per step of the whole step and of each phase (``perf/<phase>_s``, the mean
    over the steps after the first), each phase's share of the step (``other``: what no phase
    holds), tokens/s of the phases that handle tokens; then the parameter counts from the run
    record, the FLOP ratio N_T/(3 N_S) and beside it the measured teacher s / train s. Returns
    (title, table, notes)."""
    groups = group_by_variant(runs)
    names = dict(labels) if labels is not None else {v: v for v in groups}
    stats = {v: [phase_stats(r) for r in rs] for v, rs in groups.items()}
    counts = {v: [parameter_counts(r) for r in rs] for v, rs in groups.items()}
    ratios = {v: [flop_ratio(r) for r in rs] for v, rs in groups.items()}
    flops = any(x is not None for xs in ratios.values() for x in xs)
    seconds = ("step_s", *(f"{p}_s" for p in PHASES))
    decimals = {key: _sig_decimals([s[key] for ss in stats.values() for s in ss]) for key in seconds}
    header = ["variant", "seeds", *(h for h, _ in PHASE_COLUMNS)]
    if flops:
        header += ["params S/T", "N_T/(3 N_S)", "teacher s/train s"]
    body = []
    for v, rs in groups.items():
        row: list[Any] = [names.get(v, v), _seeds(rs).replace(",", " ") if fmt == "csv" else _seeds(rs)]
        for _, key in PHASE_COLUMNS:
            values = [s[key] for s in stats[v]]
            digits = decimals.get(key, 1 if key.endswith("_share") else None)
            row += _phase_cells(values, stat, fmt, digits)
        if flops:
            known = sorted({c for c in counts[v] if c != (None, None)}, key=str)
            if fmt == "csv":
                row += [" ".join(str(c[i]) for c in known if c[i] is not None) for i in (0, 1)]
            else:
                row.append(", ".join(f"{format_count(s)}/{format_count(t)}" for s, t in known) or "—")
            row += _phase_cells(ratios[v], stat, fmt, 3, same=True)
            row += _phase_cells([s["teacher_over_train"] for s in stats[v]], stat, fmt, 3)
        body.append(row)
    if fmt == "csv":
        parts = CSV_PARTS[stat]
        cols = [k for _, k in PHASE_COLUMNS]
        header = ["variant", "seeds", *(f"{k}_{x}" for k in cols for x in parts)]
        if flops:
            header += ["params_student", "params_teacher", *(f"{k}_{x}" for k in ("flop_ratio", "teacher_over_train") for x in parts)]
    notes = []
    silent = [s for ss in stats.values() for s in ss if all(s[f"{p}_s"] is None for p in PHASES)]
    if silent:
        notes.append(f"{len(silent)} job(s) logged no perf/<phase>_s (runs from before per-phase accounting): shown —")
    one = [r for rs in groups.values() for r in rs if len(r.get("perf/step_s")) == 1]
    if one:
        notes.append(f"{len(one)} job(s) logged one step only: their numbers include its warm-up")
    if not flops:
        notes.append("no run record says the parameter counts (summary.json's pair.student.params / pair.teacher.params): no FLOP ratio")
    title = (
        "where the step goes: seconds per step (the mean over the steps after the first), each phase's share of the step, "
        f"tokens/s per phase; {stat_name(stat)}"
    )
    return title, render(header, body, fmt), notes


def _phase_cells(values: Sequence[float | None], stat: str, fmt: str, digits: int | None, *, same: bool = False) -> list[str]:
    """One column's cell (text, markdown) or its mean and spread cells (csv); ``same``: values
    every seed shares (a pair's FLOP ratio) are shown once, with no spread."""
    xs = [x for x in values if x is not None]
    if fmt == "csv":
        if not xs:
            return [""] * len(CSV_PARTS[stat])
        if same and len(set(xs)) == 1:
            return [f"{xs[0]:.6g}"] + [""] * (len(CSV_PARTS[stat]) - 1)
        return _csv_stat(seed_stat(xs, stat))
    if not xs:
        return ["—"]
    if same and len(set(xs)) == 1:
        return [f"{xs[0]:.3g}"]
    return [_cell(xs, stat, digits=digits)]
