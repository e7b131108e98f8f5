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
import os
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SEED_KEYS = ("seed",)
TABLE_METRICS = ("eval/accuracy", "eval/jsd", "eval/kl_reverse")
# per-step training metrics (EMA-smoothed when plotted), then the eval panels
CURVE_METRICS = ("jsd/mean", "kl/reverse", "eval/accuracy", "eval/jsd", "eval/kl_reverse", "own")
METRICS_FILE = "metrics.jsonl"
# metrics.jsonl is streamed, never read whole: a line longer than this is unreadable, and
# reading stops after this many bytes (a link to a huge file must not fill the memory)
MAX_LINE_BYTES = 1 << 20
MAX_METRICS_BYTES = 1 << 30
LOCK_FILE = ".opd-train.lock"  # held by the training process while it runs (runtime/checkpoint.py)
PID_FILE = ".opd-train.pid"
OWN = "own"  # the pseudo-metric "the variant's own eval divergence" (eval/<its divergence>)
# eval metrics that equal eval/<name> for the divergences the trainer always evaluates
OWN_ALIASES = {"rkl": "eval/kl_reverse", "fkl": "eval/kl_forward", "jsd": "eval/jsd"}
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
    divergence: str | None = None  # the trained divergence's name (from the run's config)
    source: str = ""  # the label of the folder it was loaded from (opd-compare A B, name=path)
    max_steps: int | None = None  # trainer.max_steps of its last session (from .hydra/config.yaml)
    running: bool = False  # a process holds the run folder's lock now
    truncated: int = 0  # metrics.jsonl is longer than MAX_METRICS_BYTES: the bytes read (its start)
    estimator: str | None = None  # the estimator's name (from the run's config)

    def metrics(self) -> list[str]:
        return sorted(self.series)

    def get(self, metric: str) -> list[tuple[int, float]]:
        """[(step, value)] of ``metric``; ``own``: the run's own eval divergence (``own_series``)."""
        return self.own_series() if metric == OWN else self.series.get(metric, [])

    def steps(self, metric: str) -> list[int]:
        return [s for s, _ in self.get(metric)]

    def values(self, metric: str) -> list[float]:
        return [v for _, v in self.get(metric)]

    def final(self, metric: str) -> float | None:
        """The last value logged for ``metric`` (the final eval for eval metrics); nan or inf
        when that is what the run ended with (a diverged run must not look unmoved)."""
        series = self.get(metric)
        return series[-1][1] if series else None

    def last_step(self) -> int | None:
        return max((s[-1][0] for s in self.series.values() if s), default=None)

    @property
    def finished(self) -> bool:
        """Reached ``trainer.max_steps`` (a folder that does not say how many: it has a summary, or is assumed done)."""
        last = self.last_step()
        if self.max_steps is not None and last is not None:
            return last >= self.max_steps
        return bool(self.summary) or not self.running

    def status(self) -> str:
        """``running, step 54/120`` or ``stopped at step 54/120`` for a job that has not finished."""
        where = f"step {self.last_step()}/{self.max_steps if self.max_steps is not None else '?'}"
        return f"running, {where}" if self.running else f"stopped at {where}"

    def first(self, metric: str) -> float | None:
        """The first value logged (for ``eval/*``: the evaluation before training); for ``own``
        None when the run's own divergence was not measured at its first evaluation (an
        extension that switched to a divergence with no fixed-name twin)."""
        series = self.get(metric)
        if not series:
            return None
        if metric == OWN and series[0][0] > min(self.steps("eval/accuracy") or [series[0][0]]):
            return None
        return series[0][1]

    def own_metric(self) -> str | None:
        """``eval/<divergence>``: the trained divergence at its own parameters (older runs:
        the fixed eval metric it equals, for rkl, fkl and jsd)."""
        if self.divergence is None:
            return None
        key = f"eval/{self.divergence}"
        if key in self.series:
            return key
        alias = OWN_ALIASES.get(self.divergence)
        return alias if alias in self.series else None

    def own_series(self) -> list[tuple[int, float]]:
        """The own eval divergence's [(step, value)]. After an extension that switched to rkl or
        fkl, ``eval/<name>`` starts at the switch; its fixed-name twin (``eval/kl_reverse``,
        ``eval/kl_forward``: the same values wherever both were logged) holds the earlier steps."""
        key = self.own_metric()
        if key is None:
            return []
        own = self.series[key]
        twin = OWN_ALIASES.get(self.divergence or "")
        if twin is None or twin == key or twin not in self.series or not own:
            return own
        theirs = self.series[twin]
        at = dict(theirs)
        if any(step in at and at[step] != v and not (math.isnan(v) and math.isnan(at[step])) for step, v in own):
            return own  # not the same quantity (another beta or alpha): no twin
        start = own[0][0]
        return [(s, v) for s, v in theirs if s < start] + own

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
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: bytes that are not UTF-8
        return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _lines(path: Path, max_bytes: int) -> Iterable[bytes | None]:
    """The lines of a file, streamed; None for a line longer than MAX_LINE_BYTES (skipped
    unread); stops after ``max_bytes``."""
    read = 0
    with open(path, "rb") as fh:
        while read < max_bytes:
            line = fh.readline(min(MAX_LINE_BYTES, max_bytes - read) + 1)
            if not line:
                return
            read += len(line)
            if len(line) <= MAX_LINE_BYTES:
                yield line
                continue
            while line and not line.endswith(b"\n") and read < max_bytes:  # skip the rest of the long line
                line = fh.readline(min(MAX_LINE_BYTES, max_bytes - read) + 1)
                read += len(line)
            yield None


def read_metrics(path: Path, *, max_bytes: int | None = None) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """metrics.jsonl -> ({metric: [(step, value)]}, number of unreadable lines).

    Non-numeric values are skipped; null (a NaN the trainer logged) becomes nan. The file is
    streamed and read up to ``max_bytes`` (default MAX_METRICS_BYTES).
    """
    series: dict[str, list[tuple[int, float]]] = {}
    bad = 0
    for raw in _lines(Path(path), MAX_METRICS_BYTES if max_bytes is None else max_bytes):
        if raw is not None and not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))  # a line that is not UTF-8 counts as unreadable
            step = int(row["step"])
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
            bad += 1  # a job killed mid-write leaves a truncated last line; {"step": 1e999} is no step
            continue
        for key, value in row.items():
            if key == "step" or isinstance(value, bool):
                continue
            if value is None:
                value = math.nan
            if isinstance(value, (int, float)):
                try:
                    series.setdefault(key, []).append((step, float(value)))
                except OverflowError:  # an integer beyond float range
                    series.setdefault(key, []).append((step, math.inf if value > 0 else -math.inf))
    return series, bad


def _lock_held(run_dir: Path) -> bool:
    """Whether a process holds the run folder's lock now: read from /proc/locks (Linux), which
    takes no lock itself (a job starting this instant is never refused because of us); elsewhere,
    whether the pid the lock's owner wrote is alive."""
    lock = run_dir / LOCK_FILE
    try:
        st = lock.stat()
    except OSError:
        return False
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            table = fh.read()
    except OSError:
        try:
            pid = int((run_dir / PID_FILE).read_text().strip())
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except (OSError, ValueError):
            return False
        return True
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(len(p := line.split()) > 5 and p[5].lower() == want for line in table.splitlines())


def read_run(run_dir: str | Path) -> Run:
    """One run folder (must hold metrics.jsonl) -> Run (variant filled in by ``load_runs``)."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    series, bad = read_metrics(path)
    try:
        truncated = MAX_METRICS_BYTES if path.stat().st_size > MAX_METRICS_BYTES else 0
    except OSError:
        truncated = 0
    listed = _read_yaml(run_dir / ".hydra" / "overrides.yaml")
    overrides = parse_overrides(listed if isinstance(listed, list) else [])
    seed: Any = next((overrides[k] for k in SEED_KEYS if k in overrides), None)
    if seed is None:  # not overridden: the composed config still says which seed ran
        config = _read_yaml(run_dir / ".hydra" / "config.yaml")
        seed = config.get("seed") if isinstance(config, dict) else None
    try:
        seed = int(seed) if seed is not None else None
    except (TypeError, ValueError):
        seed = None
    config = _read_yaml(run_dir / ".hydra" / "config.yaml")
    div = config.get("divergence") if isinstance(config, dict) else None
    divergence = overrides.get("divergence.name", overrides.get("divergence"))
    if isinstance(div, dict) and div.get("name"):
        divergence = str(div["name"])
    summary = _read_json(run_dir / "summary.json") if (run_dir / "summary.json").is_file() else {}
    trainer = config.get("trainer") if isinstance(config, dict) else None
    est = config.get("estimator") if isinstance(config, dict) else None
    estimator = overrides.get("estimator.name", overrides.get("estimator"))
    if isinstance(est, dict) and est.get("name"):
        estimator = str(est["name"])
    max_steps = trainer.get("max_steps") if isinstance(trainer, dict) else None
    return Run(
        path=run_dir,
        overrides=overrides,
        seed=seed,
        series=series,
        summary=summary,
        bad_lines=bad,
        divergence=divergence,
        max_steps=max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) else None,
        running=_lock_held(run_dir),
        truncated=truncated,
        estimator=estimator,
    )


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
    found = [p.parent for p in folder.rglob(METRICS_FILE) if p.is_file() and "wandb" not in p.relative_to(folder).parts[:-1]]
    if not found:
        raise AnalysisError(f"no {METRICS_FILE} under {folder}: not an opd-train run or multirun folder (or no job has logged yet)")
    return sorted(found, key=_natural_key)


def find_failed_jobs(folder: str | Path) -> list[Path]:
    """Job folders (with ``.hydra/``) that never wrote metrics.jsonl: jobs that failed at start."""
    folder = Path(folder)
    return sorted(
        (p.parent for p in folder.rglob(".hydra") if p.is_dir() and not (p.parent / METRICS_FILE).is_file()),
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


_LABEL = re.compile(r"^[\w.+-]+$")


def parse_source(spec: str) -> tuple[str | None, Path]:
    """``name=path`` -> (name, path); a plain path -> (None, path). A path that itself holds
    ``=`` (Hydra folder names do) and exists is taken as a path."""
    name, sep, rest = str(spec).partition("=")
    if sep and _LABEL.match(name) and not Path(spec).exists():
        return name, Path(rest)
    return None, Path(spec)


def _short_labels(paths: Sequence[Path]) -> list[str]:
    """The shortest path tails that tell the folders apart (``multirun/a/x``, ``multirun/b/x`` -> ``a/x``, ``b/x``)."""
    parts = [p.resolve().parts for p in paths]
    for n in range(1, max((len(p) for p in parts), default=1) + 1):
        labels = ["/".join(p[-n:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def load_sources(specs: Sequence[str | Path]) -> tuple[list[Run], list[tuple[str, Path]]]:
    """Several folders (``A B C`` or ``name=path``), each a multirun or a single run, as one
    list of Runs; with more than one folder a run's variant is its folder's label (plus the
    variant inside the folder when it holds several). Returns (runs, [(label, folder)])."""
    parsed = [parse_source(str(s)) for s in specs]
    defaults = _short_labels([p for _, p in parsed])
    sources = [(name or default, path) for (name, path), default in zip(parsed, defaults)]
    if len({label for label, _ in sources}) != len(sources):
        raise AnalysisError(f"two folders have the label {[lbl for lbl, _ in sources]!r}; allowed: distinct name=path labels")
    runs: list[Run] = []
    for label, path in sources:
        these = load_runs(path)
        several = len({r.variant for r in these}) > 1
        for r in these:
            r.source = label
            if len(sources) > 1:
                r.variant = f"{label}: {r.variant}" if several else label
        runs += these
    return runs, sources


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
                divergence=((wr.config or {}).get("divergence") or {}).get("name"),
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


def seed_stat(values: Iterable[float | None]) -> tuple[float, float, int]:
    """``mean_std`` over seeds, except that a seed that ended non-finite makes the whole cell
    non-finite (nan, or inf/-inf when every such seed agrees): a diverged seed is never averaged away."""
    xs = [v for v in values if v is not None]
    odd = {v for v in xs if not math.isfinite(v)}
    if not odd:
        return mean_std(xs)
    value = odd.pop() if len(odd) == 1 else math.nan
    return value, math.nan, len(xs)


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


def summary_table(runs: Sequence[Run], metrics: Sequence[str] = TABLE_METRICS, *, own: bool = True) -> list[dict[str, Any]]:
    """One row per variant: ``variant``, ``seeds``, ``n``; per metric its final value
    (``row[m]``), its first value (``row[m + " before"]``: for eval metrics the evaluation
    before training) and the change (``row[m + " delta"]``, per seed, then over seeds), each
    as (mean, std, n) over seeds; with ``own`` the same for the variant's own eval divergence
    (``own``, named in ``row["divergence"]``); and ``steps/s``."""
    rows = []
    for variant, rs in group_by_variant(runs).items():
        row: dict[str, Any] = {"variant": variant, "seeds": [r.seed for r in rs], "n": len(rs)}
        cols = list(metrics)
        if own:
            cols.append(OWN)
            row["divergence"] = ",".join(dict.fromkeys(r.divergence or "?" for r in rs))
        for key in cols:
            after = [r.final(key) for r in rs]
            before = [r.first(key) for r in rs]
            row[key] = seed_stat(after)
            row[f"{key} before"] = seed_stat(before)
            row[f"{key} delta"] = seed_stat(a - b if a is not None and b is not None else None for a, b in zip(after, before))
        row["steps/s"] = mean_std(r.steps_per_s() for r in rs)
        rows.append(row)
    return rows


def curve(runs: Sequence[Run], metric: str) -> dict[str, list[float]]:
    """Seeds of one variant on a common step axis: ``step``, ``mean``, ``std``, ``min``,
    ``max``, ``n`` per step (a step some seeds did not log averages those that did)."""
    by_step: dict[int, list[float]] = {}
    for r in runs:
        for step, v in r.get(metric):
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


def format_stat(stat: tuple[float, float, int], digits: int = 4, signed: bool = False) -> str:
    mean, std, n = stat
    if n == 0:
        return "n/a"
    if not math.isfinite(mean):  # a run that ended diverged (see seed_stat)
        return str(mean)
    value = f"{mean:+.{digits}g}" if signed else f"{mean:.{digits}g}"
    if n == 1:
        return value
    return f"{value} ± {std:.2g}"


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
    """The rows of ``summary_table`` as aligned text, a Markdown table, or CSV (mean,std
    columns, exact metric keys). ``before``: before / after / Δ columns per metric."""
    cols = table_columns(rows, metrics, before)
    own = bool(rows) and OWN in rows[0]
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        keys = [k for _, k in cols]
        w.writerow(["variant", "seeds", "n"] + (["divergence"] if own else []) + [f"{k}_{x}" for k in keys for x in ("mean", "std")])
        for row in rows:
            seeds = " ".join("?" if s is None else str(s) for s in row["seeds"])
            lead = [row["variant"], seeds, row["n"]] + ([row["divergence"]] if own else [])
            w.writerow(lead + [f"{row[k][x]:.6g}" for k in keys for x in (0, 1)])
        return buf.getvalue()
    header = ["variant", "seeds"] + (["divergence"] if own else []) + [h for h, _ in cols]
    body = [
        [row["variant"], ",".join("?" if s is None else str(s) for s in row["seeds"])]
        + ([row["divergence"]] if own else [])
        + [format_stat(row[k], digits=3 if k == "steps/s" else 4, signed=k.endswith(" delta")) for _, k in cols]
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
):
    """One panel per metric, one line per variant (mean over seeds) with the spread over seeds as a
    band (``range``: min..max over seeds; ``std``: mean ± std). Returns the Figure.

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
    groups = group_by_variant(runs)
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
            c = curve(rs, metric)
            if not c["step"]:
                continue
            color, style = styles[variant]
            mean, lo, hi = c["mean"], c["min"], c["max"]
            if band == "std":
                lo = [m - s for m, s in zip(c["mean"], c["std"])]
                hi = [m + s for m, s in zip(c["mean"], c["std"])]
            span = 1.0
            if smooth and not metric.startswith("eval/") and metric != OWN:
                span = auto_span(len(c["step"])) if smooth is True else float(smooth)
                spans.append(span)
            if span > 1:
                ax.plot(c["step"], mean, color=color, alpha=0.2, linewidth=0.8)
                mean, lo, hi = ema(mean, span), ema(lo, span), ema(hi, span)
            seeds = f"{len(rs)} seeds" if len(rs) > 1 else "1 seed"
            ax.plot(
                c["step"],
                mean,
                color=color,
                linestyle=style,
                label=f"{short_label(variant)} ({seeds})",
                marker="." if len(c["step"]) < 20 else None,
            )
            if len(rs) > 1:
                ax.fill_between(c["step"], lo, hi, color=color, alpha=0.2, linewidth=0)
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
        ax.set_xlabel("training step")
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
    if handles:
        from matplotlib.layout_engine import ConstrainedLayoutEngine

        if spare is not None:  # the grid's empty cell holds the legend
            spare.set_visible(True)
            spare.axis("off")
            spare.legend(list(handles.values()), list(handles), loc="center", fontsize="small", frameon=False)
        elif isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):
            fig.legend(
                list(handles.values()),
                list(handles),
                loc="outside lower center",
                ncols=min(4, len(handles)),
                fontsize="small",
                frameon=False,
            )
        else:  # the caller's figure: a legend on the first panel
            axes[0].legend(list(handles.values()), list(handles), fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def figure_title(sources: Sequence[tuple[str, Path]], runs: Sequence[Run]) -> str:
    """``<folder(s)>: N jobs, M steps`` for a figure's title."""
    steps = sorted({max(r.steps(m)[-1] for m in r.series if r.series[m]) for r in runs if r.series})
    where = str(sources[0][1]) if len(sources) == 1 else ", ".join(label for label, _ in sources)
    span = f"{steps[0]} steps" if len(steps) == 1 else f"{steps[0]}–{steps[-1]} steps" if steps else "no steps"
    return f"{where}: {len(runs)} jobs, {span}"
