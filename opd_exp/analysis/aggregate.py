"""Aggregation over seeds: per-variant tables, curves, a common step, steps to a threshold,
paired differences against a base variant.

Values are gathered per seed here; ``stats`` turns them into a mean and an interval and
``tables`` into text.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from opd_exp.analysis.runs import OWN, AnalysisError, Run
from opd_exp.analysis.stats import mean_ci95, mean_std, paired_differences, seed_stat

TABLE_METRICS = ("eval/accuracy", "eval/jsd", "eval/kl_reverse")
X_AXES = ("steps", "tokens", "seconds")
X_LABELS = {"steps": "training step", "tokens": "sampled tokens", "seconds": "training time (s)"}


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


def summary_table(
    runs: Sequence[Run], metrics: Sequence[str] = TABLE_METRICS, *, own: bool = True, stat: str = "std"
) -> list[dict[str, Any]]:
    """One row per variant: ``variant``, ``seeds``, ``n``; per metric its final value
    (``row[m]``), its first value (``row[m + " before"]``: for eval metrics the evaluation
    before training) and the change (``row[m + " delta"]``, per seed, then over seeds), each
    as (mean, spread, n) over seeds (``stats.seed_stat``: the std by default; ``stat="ci95"``
    the half-width of the 95% interval, ``"minmax"`` (min, max)); ``row["stat"]`` says which; with ``own`` the same for the variant's own eval divergence
    (``own``, named in ``row["divergence"]``); and ``steps/s``."""
    rows = []
    for variant, rs in group_by_variant(runs).items():
        row: dict[str, Any] = {"variant": variant, "seeds": [r.seed for r in rs], "n": len(rs), "stat": stat}
        cols = list(metrics)
        if own:
            cols.append(OWN)
            row["divergence"] = ",".join(dict.fromkeys(r.divergence or "?" for r in rs))
        for key in cols:
            after = [r.final(key) for r in rs]
            before = [r.first(key) for r in rs]
            row[key] = seed_stat(after, stat)
            row[f"{key} before"] = seed_stat(before, stat)
            row[f"{key} delta"] = seed_stat((a - b if a is not None and b is not None else None for a, b in zip(after, before)), stat)
        row["steps/s"] = seed_stat((r.steps_per_s() for r in rs), stat)
        rows.append(row)
    return rows


def curve(runs: Sequence[Run], metric: str, x: str = "steps") -> dict[str, list[float]]:
    """Seeds of one variant on a common step axis: ``step``, ``mean``, ``std``, ``min``,
    ``max``, ``ci95`` (half-width), ``n`` per step (a step some seeds did not log averages those
    that did), and ``x``: the step, or with ``x="tokens"``/``"seconds"`` the sampled tokens or
    training seconds up to it, mean over the seeds (a step no seed can place is left out)."""
    check_x(x)
    by_step: dict[int, list[float]] = {}
    xs_at: dict[int, list[float]] = {}
    for r in runs:
        cum = cumulative(r, x)
        for step, v in r.get(metric):
            if not math.isfinite(v):
                continue
            at = float(step) if cum is None else x_at(cum, step)
            if at is None:
                continue
            by_step.setdefault(step, []).append(v)  # a resumed run may repeat a step: keep both
            xs_at.setdefault(step, []).append(at)
    out: dict[str, list[float]] = {k: [] for k in ("step", "mean", "std", "min", "max", "n", "ci95", "x")}
    for step in sorted(by_step):
        vs = by_step[step]
        m, s, n = mean_std(vs)
        h = mean_ci95(vs)[1]
        for k, v in zip(out, (step, m, s, min(vs), max(vs), n, h, statistics.fmean(xs_at[step]))):
            out[k].append(v)
    return out


# -- the x axis: steps, sampled tokens, training seconds ------------------------------


def check_x(x: str) -> str:
    if x not in X_AXES:
        raise AnalysisError(f"--x {x!r} is unknown; allowed: {', '.join(X_AXES)}")
    return x


def cumulative(run: Run, x: str) -> dict[int, float] | None:
    """{step: sampled tokens (``tokens``) or training seconds (``seconds``) up to and including
    it}; step 0 (the eval before training) is 0. Tokens per step are ``perf/tokens_per_s`` x
    ``perf/step_s`` (the step's response tokens, all ranks); seconds are ``perf/step_s`` summed
    (rollout, scoring and update; evaluation excluded). None for ``steps``; {0: 0} for a run
    that logged no step times."""
    if check_x(x) == "steps":
        return None
    step_s = dict(run.get("perf/step_s"))  # a step repeated after a resume: its last value
    if x == "tokens":
        rate = dict(run.get("perf/tokens_per_s"))
        per = {s: rate[s] * dt for s, dt in step_s.items() if s in rate}
    else:
        per = step_s
    out, total = {0: 0.0}, 0.0
    for s in sorted(per):
        if math.isfinite(per[s]) and per[s] > 0:
            total += per[s]
        out[s] = total
    return out


def x_at(cum: Mapping[int, float], step: int) -> float | None:
    """The cumulative value at ``step``: of the last step at or before it that logged one."""
    if step > 0 and len(cum) <= 1:
        return None  # the run logged no step times
    steps = sorted(cum)
    i = bisect.bisect_right(steps, step)
    return cum[steps[i - 1]] if i else None


# -- one step for every run --------------------------------------------------------


def value_at(run: Run, metric: str, step: int) -> float | None:
    """``metric`` as it stood at ``step``: its last value logged at or before it (the last eval
    for eval metrics); None when the run never reached ``step`` or had not logged it yet."""
    last = run.last_step()
    if last is None or last < step:
        return None
    found = None
    for s, v in run.get(metric):
        if s <= step:
            found = v
    return found


def reached(runs: Iterable[Run], step: int) -> tuple[list[Run], list[Run]]:
    """(runs that logged ``step`` or later, runs that stopped before it)."""
    yes, no = [], []
    for r in runs:
        (yes if (r.last_step() is not None and r.last_step() >= step) else no).append(r)
    return yes, no


# -- steps to a threshold -------------------------------------------------------------

_HIGHER_IS_BETTER = ("accuracy", "reward", "pass@", "precision", "coverage", "format_rate")
_REACH = re.compile(r"^\s*([^<>=\s]+)\s*(>=|<=|=)\s*([^\s]+)\s*$")


def parse_reach(spec: str) -> tuple[str, str, float]:
    """``eval/accuracy=0.5`` -> (metric, ">=", 0.5): ``=`` means ``>=`` for a metric where higher
    is better (accuracy, reward, pass@k, ...) and ``<=`` for the others (divergences, loss);
    ``>=`` and ``<=`` say it outright."""
    m = _REACH.match(str(spec))
    value = None
    if m:
        try:
            value = float(m.group(3))
        except ValueError:
            value = None
    if m is None or value is None or not math.isfinite(value):
        raise AnalysisError(
            f"--reach {spec!r} is not METRIC=VALUE; allowed: e.g. eval/accuracy=0.5, eval/kl_reverse<=0.1 (a finite number)"
        )
    metric, op = m.group(1), m.group(2)
    if op == "=":
        op = ">=" if any(w in metric for w in _HIGHER_IS_BETTER) else "<="
    return metric, op, value


def first_reach(run: Run, metric: str, op: str, value: float) -> int | None:
    """The first logged step where ``metric op value`` holds (step 0 counts), or None."""
    for s, v in run.get(metric):
        if math.isfinite(v) and (v >= value - 1e-12 if op == ">=" else v <= value + 1e-12):
            return s
    return None


def reach(run: Run, metric: str, op: str, value: float) -> dict[str, float | None]:
    """``step``, ``tokens`` (sampled up to it) and ``seconds`` (training, up to it) at the
    first step where the threshold holds; all None when the run never reached it."""
    step = first_reach(run, metric, op, value)
    if step is None:
        return {"step": None, "tokens": None, "seconds": None}
    out: dict[str, float | None] = {"step": float(step)}
    for x in ("tokens", "seconds"):
        cum = cumulative(run, x)
        out[x] = x_at(cum, step) if cum is not None else None
    return out


# -- paired differences against a base variant ------------------------------------------


def _items(variant: str) -> tuple[str, set[str]]:
    head, sep, rest = variant.rpartition(": ")
    return (head if sep else ""), {i for i in (rest if sep else variant).split(",") if "=" in i}


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _same(a: Any, b: str) -> bool:
    if str(a) == b:
        return True
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def has_setting(variant: str, runs: Sequence[Run], key: str, value: str) -> bool:
    """The variant sets ``key=value``: as one of its overrides, or in its runs' config
    (``divergence=rkl`` also matches a run whose ``divergence.name`` is rkl)."""
    if f"{key}={value}" in _items(variant)[1]:
        return True
    for r in runs[:1]:
        flat = _flat(r.config) if isinstance(r.config, Mapping) else {}
        for k in (key, f"{key}.name"):
            if k in flat and _same(flat[k], value):
                return True
    return False


def base_variants(groups: Mapping[str, Sequence[Run]], base: str) -> dict[str, str]:
    """{variant: the variant it is compared with}. ``base`` is a variant's name, or
    ``KEY=VALUE``: each variant is paired with the variant that sets KEY to VALUE and shares
    the most of its other overrides (``--base rollout.on_policy_fraction=0.0`` pairs each
    divergence with its own off-policy arm). The base variants themselves get no row."""
    names = list(groups)
    if base in groups:
        return {v: base for v in names if v != base}
    key, sep, value = base.partition("=")
    if not sep or not key or not value:
        raise AnalysisError(
            f"--base {base!r} is not KEY=VALUE nor a variant; allowed: KEY=VALUE (e.g. divergence=rkl) or one of {', '.join(names)}"
        )
    bases = [v for v in names if has_setting(v, groups[v], key, value)]
    if not bases:
        raise AnalysisError(f"--base {base}: no variant sets {key}={value}; allowed: KEY=VALUE of a variant, or one of {', '.join(names)}")
    out = {}
    for v in names:
        if v in bases:
            continue
        head, items = _items(v)
        score = {b: len(items & _items(b)[1]) + (_items(b)[0] == head) for b in bases}
        best = max(score.values())
        top = [b for b in bases if score[b] == best]
        if len(top) > 1:
            raise AnalysisError(
                f"--base {base}: {v} could be paired with any of {', '.join(top)}; allowed: a KEY=VALUE that names one base per variant"
            )
        out[v] = top[0]
    return out


def paired(
    runs: Sequence[Run], base_runs: Sequence[Run], get: Callable[[Run], float | None]
) -> tuple[list[float], list[int], list[int | None]]:
    """(per-seed differences ``get(run) - get(base run of the same seed)``, the seeds paired,
    the seeds of ``runs`` with no base run of their seed)."""
    by_seed = {r.seed: r for r in base_runs}
    pairs, seeds, unpaired = [], [], []
    for r in runs:
        b = by_seed.get(r.seed)
        if b is None:
            unpaired.append(r.seed)
            continue
        a, c = get(r), get(b)
        if a is not None and c is not None:
            pairs.append((a, c))
            seeds.append(r.seed)
    return paired_differences(pairs), seeds, unpaired


# -- where a step's time goes: the perf/<phase>_s accounting ------------------------------

PHASES = ("generate", "teacher", "train", "sync", "wait")  # training/phases.py's, in its order
TOKEN_PHASES = ("generate", "teacher", "train")  # the phases that log perf/<phase>_tokens_per_s
# teachers made from the student: the teacher's forward costs what the student's does
STUDENT_TEACHERS = ("ema", "lagged", "live")


def _last_per_step(run: Run, metric: str) -> dict[int, float]:
    """{step: value}, the last value of a step a resumed run logged twice."""
    return {s: v for s, v in run.get(metric) if math.isfinite(v)}


def phase_steps(run: Run) -> list[int]:
    """The training steps a phase table reads: those that logged ``perf/step_s``, less the first
    (its kernels, allocator and caches warm up); a run of one step keeps it."""
    steps = sorted(_last_per_step(run, "perf/step_s"))
    return steps[1:] if len(steps) > 1 else steps


def phase_stats(run: Run) -> dict[str, float | None]:
    """One run's phases over ``phase_steps``: ``step_s`` and ``<phase>_s`` (the mean seconds per
    step), ``<phase>_share`` (that mean over the mean step, in %), ``other_share`` (what no phase
    holds: metrics, logging), ``<phase>_tokens_per_s`` (the phase's tokens over its seconds, summed
    over the steps: a step's tokens are its logged rate x its seconds), ``teacher_over_train``
    (teacher seconds / train seconds). None where the run did not log the phase (runs before
    per-phase accounting)."""
    steps = phase_steps(run)
    out: dict[str, float | None] = {"steps": float(len(steps))}
    step_s = _last_per_step(run, "perf/step_s")
    mean_step = statistics.fmean(step_s[s] for s in steps) if steps else None
    out["step_s"] = mean_step
    shares = 0.0
    for p in PHASES:
        got = _last_per_step(run, f"perf/{p}_s")
        xs = [got[s] for s in steps if s in got]
        mean = statistics.fmean(xs) if xs and len(xs) == len(steps) else None
        out[f"{p}_s"] = mean
        out[f"{p}_share"] = 100.0 * mean / mean_step if mean is not None and mean_step else None
        shares += out[f"{p}_share"] or 0.0
    logged = any(out[f"{p}_s"] is not None for p in PHASES)
    out["other_share"] = 100.0 - shares if logged and mean_step else None
    for p in TOKEN_PHASES:
        rate, secs = _last_per_step(run, f"perf/{p}_tokens_per_s"), _last_per_step(run, f"perf/{p}_s")
        both = [s for s in steps if s in rate and s in secs]
        total_s = sum(secs[s] for s in both)
        out[f"{p}_tokens_per_s"] = sum(rate[s] * secs[s] for s in both) / total_s if both and total_s > 0 else None
    teacher, train = out["teacher_s"], out["train_s"]
    out["teacher_over_train"] = teacher / train if teacher is not None and train else None
    return out


def parameter_counts(run: Run) -> tuple[int | None, int | None]:
    """(N_S, N_T): the student's and the teacher's parameter counts from the run record
    (summary.json's ``pair``, written by opd-train at start), the teacher's equal to the
    student's for a teacher made from it (ema, lagged, live). None where the record does not say
    (runs before the counts were recorded, a served or routed teacher set)."""
    pair = run.summary.get("pair") if isinstance(run.summary, Mapping) else None
    pair = pair if isinstance(pair, Mapping) else {}

    def count(role):
        n = (pair.get(role) or {}).get("params") if isinstance(pair.get(role), Mapping) else None
        return int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0 else None

    n_s, n_t = count("student"), count("teacher")
    teacher = run.config.get("teacher") if isinstance(run.config, Mapping) else None
    name = teacher.get("name") if isinstance(teacher, Mapping) else None
    if name in STUDENT_TEACHERS:
        n_t = n_s
    elif "teachers" in pair:  # teachers.map: several teachers, one FLOP ratio would mislead
        n_t = None
    return n_s, n_t


def flop_ratio(run: Run) -> float | None:
    """N_T / (3 N_S): the teacher's forward (2 N_T FLOPs per token) over the student's forward and
    backward (6 N_S), what ``teacher_s / train_s`` would be if both ran at the same FLOP rate."""
    n_s, n_t = parameter_counts(run)
    return n_t / (3 * n_s) if n_s and n_t else None
