"""Figures: one panel per metric, one line per variant over seeds, the statistic named in the
legend. matplotlib is imported inside ``plot_curves`` only (a pyplot-free Figure, safe headless)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from opd_exp.analysis.aggregate import X_LABELS, check_x, curve, group_by_variant
from opd_exp.analysis.labels import metric_label, paper_labels, short_label, y_label
from opd_exp.analysis.runs import OWN, AnalysisError, Run
from opd_exp.analysis.stats import BANDS, check_stat, mean_std

# per-step training metrics (EMA-smoothed when plotted), then the eval panels
CURVE_METRICS = ("jsd/mean", "kl/reverse", "eval/accuracy", "eval/jsd", "eval/kl_reverse", "own")

_LINESTYLES = ("-", "--", ":", "-.")
_ESTIMATOR_KEYS = ("estimator", "estimator.name")


def _without_estimator(variant: str) -> str:
    head, sep, rest = variant.rpartition(": ")
    kept = ",".join(item for item in (rest if sep else variant).split(",") if item.partition("=")[0] not in _ESTIMATOR_KEYS)
    return f"{head}{sep}{kept}" if sep else kept


def line_styles(groups: dict[str, list[Run]]) -> dict[str, tuple[str, str]]:
    """{variant: (colour, line style)}. When the variants differ in the estimator, colour is
    everything else (the divergence and its parameters) and line style the estimator, so a
    divergence x estimator grid reads at a glance; otherwise each variant has its own colour
    (and a style of its own too, so overlapping lines stay apart in print)."""
    estimator = {v: ",".join(sorted({r.estimator or "?" for r in rs})) for v, rs in groups.items()}
    rest = {v: _without_estimator(v) for v in groups}
    estimators = list(dict.fromkeys(estimator.values()))
    others = list(dict.fromkeys(rest.values()))
    grid = 1 < len(estimators) <= len(_LINESTYLES) and len({(rest[v], estimator[v]) for v in groups}) == len(groups)
    if grid:
        return {v: (f"C{others.index(rest[v]) % 10}", _LINESTYLES[estimators.index(estimator[v])]) for v in groups}
    return {v: (f"C{i % 10}", _LINESTYLES[i % len(_LINESTYLES)]) for i, v in enumerate(groups)}


def _spans_decades(ax) -> bool:
    """The panel's lines are all positive and span more than a factor of 10 (one linear axis
    would flatten the smaller ones: rkl, fkl and jsd on one panel)."""
    ys = [y for line in ax.lines for y in line.get_ydata() if math.isfinite(y)]
    return bool(ys) and min(ys) > 0 and max(ys) / min(ys) > 10


def ema(values: Sequence[float], span: float) -> list[float]:
    """Exponential moving average with weight 2/(span+1), bias-corrected at the start (the
    first points are not pulled toward 0)."""
    if span <= 1 or not values:
        return list(values)
    a = 2.0 / (span + 1.0)
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        acc = (1 - a) * acc + a * v
        norm = (1 - a) * norm + a
        out.append(acc / norm)
    return out


def auto_span(n_points: int) -> float:
    """Smoothing span for a per-step curve: about 1/25 of its points, at most 100 (short
    runs are barely smoothed)."""
    return min(max(1.0, n_points / 25.0), 100.0)


def plot_curves(
    runs: Sequence[Run],
    metrics: Sequence[str] = CURVE_METRICS,
    *,
    axes=None,
    band: str = "range",
    smooth: bool | float = True,
    logy: bool | Sequence[str] = False,
    title: str | None = None,
    teacher: bool = True,
    ncols: int = 3,
    stat: str | None = None,
    x: str = "steps",
    labels: str | Mapping[str, str] | None = None,
):
    """One panel per metric, one line per variant (mean over seeds) with the spread over seeds as a
    band: ``stat`` ``ci95`` (the 95% interval of the mean, Student's t), ``std`` (mean ± std) or
    ``minmax`` (min..max); without ``stat``, ``band`` (``range``: min..max, ``std``). The
    legend's title names the band. Returns the Figure.

    ``x``: the x axis, ``steps``, ``tokens`` (sampled tokens) or ``seconds`` (training time),
    the last two as the mean over seeds at each step. ``labels``: ``"paper"`` for labels from
    the runs' config (``JSD β=0.5``: ``labels.paper_labels``), a {variant: label}, or None for
    the short label of the overrides (``jsd, β=0.5``).

    ``smooth``: per-step training metrics (not ``eval/*``) are EMA-smoothed (True: a span of
    about 1/25 of the points; a number: that span; False: raw), the raw mean drawn faintly
    behind. ``logy``: log scale for every panel (True) or the named metrics. ``own``
    as a metric is each variant's own eval divergence. ``teacher``: the teacher's eval
    accuracy as a dashed reference line on ``eval/accuracy``. ``title``: the figure's title.
    ``axes``: a sequence of matplotlib Axes to draw on (a notebook passes
    ``plt.subplots(...)[1]``); without it a pyplot-free Figure is made, safe headless.
    """
    if band not in ("range", "std"):
        raise AnalysisError(f"band {band!r} is unknown; allowed: range, std")
    stat = check_stat(stat) if stat is not None else ("minmax" if band == "range" else "std")
    check_x(x)
    groups = group_by_variant(runs)
    if labels == "paper":
        names = paper_labels(groups)
    elif isinstance(labels, Mapping):
        names = {v: labels.get(v, short_label(v)) for v in groups}
    else:
        names = {v: short_label(v) for v in groups}
    spare = None  # an empty grid cell: the legend goes there
    if axes is None:
        from matplotlib.figure import Figure

        # a panel no job logged would be an empty frame: left out
        metrics = [m for m in metrics if any(curve(rs, m)["step"] for rs in groups.values())] or list(metrics)[:1]
        cols = min(ncols, len(metrics))
        rows = math.ceil(len(metrics) / cols)
        fig = Figure(figsize=(4.6 * cols, 3.4 * rows + 0.9), layout="constrained")
        axes = list(fig.subplots(rows, cols, squeeze=False).flat)
        for ax in axes[len(metrics) :]:
            ax.set_visible(False)
        spare = axes[len(metrics)] if len(axes) > len(metrics) else None
    else:
        axes = list(getattr(axes, "flat", axes))
        fig = axes[0].figure
    log_metrics = {m for m in metrics if not m.endswith("accuracy")} if logy is True else set(logy or ())
    styles = line_styles(groups)
    for ax, metric in zip(axes, metrics):
        spans: list[float] = []
        for variant, rs in groups.items():
            c = curve(rs, metric, x)
            if not c["step"]:
                continue
            color, style = styles[variant]
            mean, lo, hi = c["mean"], c["min"], c["max"]
            if stat in ("std", "ci95"):
                # one seed at a step has no interval: its band is the line itself
                half = [h if math.isfinite(h) else 0.0 for h in c["std" if stat == "std" else "ci95"]]
                lo = [m - h for m, h in zip(c["mean"], half)]
                hi = [m + h for m, h in zip(c["mean"], half)]
            xs = c["x"]
            span = 1.0
            if smooth and not metric.startswith("eval/") and metric != OWN:
                span = auto_span(len(c["step"])) if smooth is True else float(smooth)
                spans.append(span)
            if span > 1:
                ax.plot(xs, mean, color=color, alpha=0.2, linewidth=0.8)
                mean, lo, hi = ema(mean, span), ema(lo, span), ema(hi, span)
            seeds = f"{len(rs)} seeds" if len(rs) > 1 else "1 seed"
            ax.plot(
                xs,
                mean,
                color=color,
                linestyle=style,
                label=f"{names[variant]} ({seeds})",
                marker="." if len(c["step"]) < 20 else None,
            )
            if len(rs) > 1:
                ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
        if metric == "eval/accuracy" and teacher:
            t = mean_std(r.final("eval/teacher_accuracy") for r in runs)
            if t[2]:
                lo, hi = ax.get_ylim()
                # a teacher far above the students would squash their curves into a band: keep
                # the students' range and say where the teacher is
                far = bool(ax.lines) and t[0] > hi + (hi - lo)
                where = ", above the panel" if far else ""
                ax.axhline(t[0], color="0.3", linestyle="--", linewidth=1, label=f"teacher ({t[0]:.2f}{where})")
                if far:
                    ax.set_ylim(lo, hi)
        span = max(spans, default=1.0)
        ax.set_title(metric_label(metric) + (f" (EMA, span {span:.0f} steps)" if span >= 1.5 else ""))
        ax.set_xlabel(X_LABELS[x] + (" (mean over seeds)" if x != "steps" and len(runs) > 1 else ""))
        if x == "tokens":  # 250k, 1M: not 250000 and 1000000 crowding the axis
            from matplotlib.ticker import EngFormatter

            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.set_ylabel(y_label(metric))
        if metric == OWN and metric not in log_metrics and _spans_decades(ax):
            ax.set_yscale("log")  # each variant's own divergence has its own scale
            ax.set_title(ax.get_title() + " (log scale)")
        elif metric in log_metrics:
            ys = [y for line in ax.lines for y in line.get_ydata()]
            if metric.endswith("accuracy") or not ys or min(ys) <= 0:  # e.g. an unbiased KL estimate below 0
                ax.set_title(
                    ax.get_title() + " (linear: values ≤ 0)" if ys and min(ys) <= 0 and not metric.endswith("accuracy") else ax.get_title()
                )
            else:
                ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles: dict[str, Any] = {}
    for ax in axes:  # one legend for the figure: every variant once, and the teacher line
        for h, lbl in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lbl, h)
    band_title = f"mean over seeds; band: {BANDS[stat]}"
    if handles:
        from matplotlib.layout_engine import ConstrainedLayoutEngine

        if spare is not None:  # the grid's empty cell holds the legend
            spare.set_visible(True)
            spare.axis("off")
            spare.legend(
                list(handles.values()),
                list(handles),
                loc="center",
                fontsize="small",
                frameon=False,
                title=band_title,
                title_fontsize="small",
            )
        elif isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):
            fig.legend(
                list(handles.values()),
                list(handles),
                loc="outside lower center",
                ncols=min(4, len(handles)),
                fontsize="small",
                frameon=False,
                title=band_title,
                title_fontsize="small",
            )
        else:  # the caller's figure: a legend on the first panel
            axes[0].legend(list(handles.values()), list(handles), fontsize="small", title=band_title, title_fontsize="small")
    if title:
        fig.suptitle(title)
    return fig
