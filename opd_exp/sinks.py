"""Metric sinks: where a step's metrics go. Never imports models.

``metrics.jsonl`` in the run folder is always written (one JSON object per logged step);
the chosen logger (W&B or nothing) gets the same dicts. ``Progress`` is the console bar.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Mapping


def _clean(metrics: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None if math.isnan(v) else (float("inf") if v > 0 else float("-inf"))
        out[k] = v
    return out


class Sink:
    """A do-nothing sink (the `none` logger); subclasses override what they need."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record one step's metrics (the `none` logger drops them)."""

    def summary(self, values: Mapping[str, Any]) -> None:
        """Record the run's final values (the `none` logger drops them)."""

    def close(self) -> None:
        """Flush and release (nothing to do for the `none` logger)."""


NullSink = Sink


def _step_of(line: str) -> float:
    """The step of a metrics.jsonl line; a blank or torn line (a kill mid-write) sorts last,
    so a resume drops it."""
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return math.inf


class JsonlSink(Sink):
    """Appends ``{"step": n, ...metrics}`` lines to ``path``.

    ``resume_step``: on resume from a checkpoint at that step, lines logged after it by the
    interrupted run are dropped first, so the file reads as one uninterrupted run.
    """

    def __init__(self, path: Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text(errors="replace").splitlines() if _step_of(line) <= resume_step]
            # temp file + rename: a kill during the rewrite never truncates the run's history
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        elif resume_step is None and self.path.exists():
            self.path.unlink()  # a fresh run in a reused folder starts a fresh file
        self._fh = self.path.open("a")

    def log(self, metrics, step):
        self._fh.write(json.dumps({"step": step, **_clean(metrics)}) + "\n")
        self._fh.flush()

    def summary(self, values):
        (self.path.parent / "summary.json").write_text(json.dumps(_clean(values), indent=2) + "\n")

    def close(self):
        self._fh.close()


class WandbSink(Sink):
    """Weights & Biases (offline by default); the glue lives in ``opd_exp.tracking``.

    The run lives in ``<run_dir>/wandb/``; its id is kept in ``<run_dir>/wandb_id.txt`` so a
    resumed run continues the same W&B run. Every metric is charted against ``step`` (the
    training step, logged with each row), so a resumed run's rows are never dropped. Closing
    while an exception propagates finishes the run as failed (exit code 1).
    """

    def __init__(self, run_dir: Path, *, project: str = "opd-exp", entity=None, group=None, job_type=None, tags=(),
                 mode="offline", name=None, config=None, on_error: str = "fail", overrides=None):
        from opd_exp import tracking

        run_dir = Path(run_dir)
        job = tracking.hydra_job()
        config = tracking.scrub(tracking.plain_config(config or {}))
        overrides = job.overrides if overrides is None else list(overrides)
        run_id = tracking.read_run_id(run_dir) or os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:12]
        self._run = tracking.start_run(
            run_dir, project=project, entity=entity, group=tracking.run_group(group, job), job_type=job_type,
            tags=tracking.run_tags(tags, overrides, config.get("divergence")), mode=mode, on_error=on_error,
            name=name or (run_dir.name if job.multirun else None), config=config, run_id=run_id,
        )
        (run_dir / "wandb_id.txt").write_text(self._run.id)
        tracking.define_metrics(self._run)
        self._tracked = set(tracking.SUMMARIES)

    @classmethod
    def from_config(cls, cfg, run_dir: Path, **kw) -> "WandbSink":
        """From a TrainConfig: its ``logger`` group and the whole config as the run config."""
        lg = cfg.logger
        return cls(run_dir, project=lg.project, entity=lg.entity, group=lg.group, job_type=lg.job_type, tags=lg.tags,
                   mode=lg.mode, name=cfg.name, config=cfg, on_error=getattr(lg, "on_error", "fail"), **kw)

    @property
    def run(self):
        return self._run

    def log(self, metrics, step):
        self._run.log({**_clean(metrics), "step": step})

    def summary(self, values):
        for k, v in _clean(values).items():  # a tracked key keeps its best/last values: its final one
            self._run.summary[f"final/{k}" if k in self._tracked else k] = v  # goes to final/<key>

    def close(self):
        if self._run is None:
            return
        failed = sys.exc_info()[0] is not None  # called from a `finally` during an exception
        run, self._run = self._run, None
        run.finish(exit_code=1 if failed else 0)


class MultiSink(Sink):
    def __init__(self, sinks):
        self.sinks = list(sinks)

    def log(self, metrics, step):
        for s in self.sinks:
            s.log(metrics, step)

    def summary(self, values):
        for s in self.sinks:
            s.summary(values)

    def close(self):
        for s in self.sinks:
            s.close()


class Progress:
    """Console progress: a tqdm bar with ETA and the key metrics (or nothing if disabled)."""

    KEYS = (("loss", "loss"), ("kl/reverse", "rkl"), ("jsd/mean", "jsd"), ("eval/accuracy", "acc"))

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.bar = None
        self.shown: dict[str, str] = {}
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="opd-train", dynamic_ncols=True, file=sys.stderr)

    def update(self, metrics: Mapping[str, Any], n: int = 1) -> None:
        for key, short in self.KEYS:
            v = metrics.get(key)
            if isinstance(v, (int, float)):
                self.shown[short] = f"{v:.3g}"
        if self.bar is not None:
            self.bar.set_postfix(self.shown, refresh=False)
            self.bar.update(n)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Stopwatch:
    def __init__(self):
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t0 = now - self.t0, now
        return dt
