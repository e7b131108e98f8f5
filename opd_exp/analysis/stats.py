"""Statistics over seeds: mean ± std, Student's t 95% intervals, min..max, paired differences.

``stat`` names one of ``STATS``; every table and figure says which one it shows
(``stat_name``). Standard library only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from opd_exp.analysis.runs import AnalysisError

# what each --stat shows, as a table header and a figure legend say it
STATS = {
    "ci95": "mean ± 95% CI over seeds (Student's t)",
    "std": "mean ± std over seeds",
    "minmax": "mean (min..max) over seeds",
}
BANDS = {"ci95": "95% CI (Student's t)", "std": "mean ± std", "minmax": "min..max"}


def check_stat(stat: str) -> str:
    if stat not in STATS:
        raise AnalysisError(f"--stat {stat!r} is unknown; allowed: {', '.join(STATS)}")
    return stat


def stat_name(stat: str) -> str:
    """``mean ± 95% CI over seeds (Student's t)`` for a header."""
    return STATS[check_stat(stat)]


def mean_std(values: Iterable[float | None]) -> tuple[float, float, int]:
    """(mean, sample std, n) over the finite values; std is 0 for one value, nan for none."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return math.nan, math.nan, 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0), len(xs)


# two-sided 95% Student's t quantiles by degrees of freedom (the normal 1.960 past 30)
T95 = (
    (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
    + (2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
    + (2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
)


def mean_ci95(values: Iterable[float | None]) -> tuple[float, float, int]:
    """(mean, half-width of the 95% confidence interval of the mean, n) over the finite values:
    Student's t with n - 1 degrees of freedom, as the lab reports seeds; nan half-width for
    one value, all nan for none."""
    m, sd, n = mean_std(values)
    if n < 2:
        return m, math.nan, n
    return m, (T95[n - 2] if n - 1 <= len(T95) else 1.960) * sd / math.sqrt(n), n


def format_ci95(values: Iterable[float | None], digits: int = 3) -> str:
    """``mean ± half-width`` (``mean`` for one value, ``—`` for none)."""
    m, h, n = mean_ci95(values)
    if n == 0:
        return "—"
    return f"{m:.{digits}f}" if n == 1 else f"{m:.{digits}f} ± {h:.{digits}f}"


def _nonfinite(xs: Sequence[float]) -> float | None:
    """The value a cell shows when some seed ended non-finite (nan, or inf/-inf when every such
    seed agrees), else None: a diverged seed is never averaged away."""
    odd = {v for v in xs if not math.isfinite(v)}
    if not odd:
        return None
    return odd.pop() if len(odd) == 1 else math.nan


def seed_stat(values: Iterable[float | None], stat: str = "std") -> tuple[float, Any, int]:
    """(mean, spread, n) over seeds; the spread is the sample std (``std``), the half-width of
    the 95% interval (``ci95``) or (min, max) (``minmax``). A seed that ended non-finite makes
    the whole cell non-finite (``_nonfinite``)."""
    check_stat(stat)
    xs = [v for v in values if v is not None]
    odd = _nonfinite(xs)
    if odd is not None:
        return odd, math.nan, len(xs)
    if stat == "minmax":
        m, _, n = mean_std(xs)
        return m, ((min(xs), max(xs)) if xs else (math.nan, math.nan)), n
    return mean_ci95(xs) if stat == "ci95" else mean_std(xs)


def format_interval(values: Iterable[float | None], stat: str = "ci95", digits: int = 3, *, signed: bool = False) -> str:
    """One cell over seeds at fixed decimals: ``0.510 ± 0.025`` (ci95, std), ``0.510
    (0.500..0.520)`` (minmax); the value alone for one seed, ``—`` for none, ``nan``/``inf``
    when a seed ended so."""
    check_stat(stat)
    xs = [v for v in values if v is not None]
    odd = _nonfinite(xs)
    if odd is not None:
        return str(odd)
    if stat == "ci95" and not signed:
        return format_ci95(xs, digits)
    m, spread, n = seed_stat(xs, stat)
    if n == 0:
        return "—"
    value = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    if n == 1:
        return value
    if stat == "minmax":
        lo, hi = spread
        return f"{value} ({lo:.{digits}f}..{hi:.{digits}f})"
    return f"{value} ± {spread:.{digits}f}"


def paired_differences(pairs: Iterable[tuple[float | None, float | None]]) -> list[float]:
    """``a - b`` for each pair where both are known (a seed of a variant minus the same seed of
    its base)."""
    return [a - b for a, b in pairs if a is not None and b is not None]
