"""Read opd-train run folders (and W&B runs) back as tidy records: one ``Run`` per job.

A run folder (one Hydra job) holds ``metrics.jsonl`` (one JSON object per logged step, always
with ``step``) and ``.hydra/overrides.yaml`` (the command-line overrides that made the job). A
multirun folder holds one run folder per job (``multirun/<date>/<time>/<job_num>/``)::

    from opd_exp.analysis import load_runs, summary_table
    runs = load_runs("multirun/2025-01-01/12-00-00")
    for row in summary_table(runs):
        print(row["variant"], row["seeds"], row["eval/accuracy"])

A *variant* is what was compared: a job's overrides that tell it from the other jobs of its
folder, minus the seed (``trainer.max_steps=50`` given once on the command line says nothing
about which variant a job is); one run is named as W&B names it (``naming.run_name``). Seeds of
one variant are averaged (``aggregate``).

Needs only the standard library and PyYAML (which Hydra brings); wandb is imported inside
``load_wandb`` only.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opd_exp.analysis.naming import SEED_KEYS, assign_variants, parse_overrides

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
    config: dict[str, Any] = field(default_factory=dict)  # .hydra/config.yaml (W&B: the run's config)
    choices: dict[str, str] = field(default_factory=dict)  # Hydra's chosen option per config group (sweep, model_pair, ...)

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
    config = _read_yaml(run_dir / ".hydra" / "config.yaml")
    config = config if isinstance(config, dict) else {}
    seed: Any = next((overrides[k] for k in SEED_KEYS if k in overrides), None)
    if seed is None:  # not overridden: the composed config still says which seed ran
        seed = config.get("seed")
    try:
        seed = int(seed) if seed is not None else None
    except (TypeError, ValueError):
        seed = None
    div = config.get("divergence")
    divergence = overrides.get("divergence.name", overrides.get("divergence"))
    if isinstance(div, dict) and div.get("name"):
        divergence = str(div["name"])
    summary = _read_json(run_dir / "summary.json") if (run_dir / "summary.json").is_file() else {}
    trainer = config.get("trainer")
    est = config.get("estimator")
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
        config=config,
        choices=_hydra_choices(run_dir),
    )


def _hydra_choices(run_dir: Path) -> dict[str, str]:
    """``hydra.runtime.choices`` of .hydra/hydra.yaml (which sweep, which model pair), if saved."""
    saved = _read_yaml(run_dir / ".hydra" / "hydra.yaml")
    try:
        choices = saved["hydra"]["runtime"]["choices"]
    except (TypeError, KeyError):
        return {}
    return {str(k): str(v) for k, v in choices.items() if isinstance(v, (str, int, float))} if isinstance(choices, dict) else {}


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
                config=dict(wr.config or {}),
            )
        )
    assign_variants(runs)
    return runs


def __getattr__(name: str) -> Any:
    """Names that lived here before the split (``from opd_exp.analysis.runs import curve``)
    still resolve, to the package's."""
    import importlib

    package = importlib.import_module("opd_exp.analysis")
    if name in package.__all__:
        return getattr(package, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
