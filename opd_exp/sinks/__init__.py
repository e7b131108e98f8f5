"""Metric sinks: where a step's metrics go. Never imports models.

``metrics.jsonl`` in the run folder is always written (one JSON object per logged step);
the chosen logger (W&B, ``tracking.py``, or nothing) gets the same dicts. ``Progress`` is
the console bar.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


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

    def config(self, values: Mapping[str, Any]) -> None:
        """Add to the run's config what is known only once the models load (the prepared
        pair's hash and accuracies); the `none` logger drops it."""

    def close(self) -> None:
        """Flush and release (nothing to do for the `none` logger)."""


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
    interrupted run are dropped first, so the file reads as one uninterrupted run. A resume
    without the file (deleted, or moved away) is refused: its rows up to the checkpoint are not
    in the checkpoint. A file deleted while the run writes it is put back from the open handle,
    which still holds every row, with one warning line.
    """

    def __init__(self, path: Path, resume_step: int | None = None, warn=None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        if resume_step is not None and not self.path.exists():
            from opd_exp.runtime.errors import ConfigError

            raise ConfigError(
                f"hydra.run.dir: {self.path} is missing but the run resumes from its checkpoint at step {resume_step}: "
                f"the metric rows of steps 0-{resume_step} would be lost; allowed: put metrics.jsonl back, or move "
                f"checkpoints/ away to start the run over"
            )
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text(errors="replace").splitlines() if _step_of(line) <= resume_step]
            # temp file + rename: a kill during the rewrite never truncates the run's history
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        elif resume_step is None and self.path.exists():
            self.path.unlink()  # a fresh run in a reused folder starts a fresh file
        self._fh = self.path.open("a+")

    def _deleted(self) -> bool:
        return not self.path.exists() or os.fstat(self._fh.fileno()).st_nlink == 0

    def _restore(self) -> None:
        """Write what the open (deleted) file holds back to ``path`` and continue there."""
        self._fh.flush()
        self._fh.seek(0)
        rows = self._fh.read()
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text(rows)
        os.replace(tmp, self.path)
        self._fh.close()
        self._fh = self.path.open("a+")
        self._warn(
            f"opd-train: warning: {self.path} was deleted during the run; rewritten from this run's "
            f"{rows.count(chr(10))} rows, the next rows follow"
        )

    def log(self, metrics, step):
        if self._deleted():
            self._restore()
        self._fh.write(json.dumps({"step": step, **_clean(metrics)}) + "\n")
        self._fh.flush()

    def summary(self, values):
        (self.path.parent / "summary.json").write_text(json.dumps(_clean(values), indent=2) + "\n")

    def close(self):
        self._fh.close()


class MultiSink(Sink):
    def __init__(self, sinks):
        self.sinks = list(sinks)

    def log(self, metrics, step):
        for s in self.sinks:
            s.log(metrics, step)

    def summary(self, values):
        for s in self.sinks:
            s.summary(values)

    def config(self, values):
        for s in self.sinks:
            s.config(values)

    def close(self, exit_code: int | None = None):
        """``exit_code``: the process's coming exit code (75 after a preemption), for the sinks
        that record one (``takes_exit_code``: W&B)."""
        for s in self.sinks:
            if exit_code is not None and getattr(s, "takes_exit_code", False):
                s.close(exit_code=exit_code)
            else:
                s.close()


# the per-step estimate the progress bar shows a trained divergence by (others: their exact/<name> when logged)
PROGRESS_OWN = {"rkl": "kl/reverse", "fkl": "kl/forward", "jsd": "jsd/mean"}


class Progress:
    """Console progress: a tqdm bar with ETA and the key metrics (or nothing if disabled): the
    trained divergence's per-step estimate under its name (``fkl=`` for an fkl run), ``jsd/mean``
    (every run's common axis), the loss under its form's name (``loss[ppo]=``: PPO's clipped
    surrogate is not a divergence) and the last eval accuracy. ``start`` restarts the clock
    after the step-0 eval: step 1's rate and the ETA count training steps only."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, *, divergence: str = "rkl", loss: str = "direct"):
        self.bar = None
        self.shown: dict[str, str] = {}
        own = PROGRESS_OWN.get(divergence, f"exact/{divergence}")
        keys = [(own, divergence)] + [("jsd/mean", "jsd")] * (own != "jsd/mean")
        self.keys = (*keys, ("loss", f"loss[{loss}]"), ("eval/accuracy", "acc"))
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="opd-train", dynamic_ncols=True, file=sys.stderr)

    def start(self) -> None:
        """The clock from now (after the step-0 eval): the rate and the ETA leave the eval out."""
        if self.bar is not None:
            self.bar.start_t = self.bar.last_print_t = self.bar._time()
            self.bar.last_print_n = self.bar.n

    def update(self, metrics: Mapping[str, Any], n: int = 1) -> None:
        for key, short in self.keys:
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
