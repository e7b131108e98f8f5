"""W&B glue for opd-train: which run, group, tags and config a job gets, and how W&B starts.

Never imports models or the trainer. What it decides for one job:

- **config**: the resolved, validated config as a plain dict (enums by value), with anything
  that looks like a secret redacted (``scrub``).
- **group**: ``logger.group`` if set (each file in ``sweeps/`` sets it to the sweep's name),
  else, in a multirun, the multirun folder (``multirun/2025-01-01/12-00-00``); a single run
  has no group.
- **tags**: ``logger.tags``, then the job's Hydra overrides (``divergence=jsd``,
  ``divergence.beta=0.5``, ``seed=1``; ``hydra.*``/``logger.*`` left out), then the
  divergence it ran (``divergence=jsd``, ``divergence.beta=0.5``) so runs of a sweep that
  picks divergences through another key still carry them. ``opd_exp.analysis.load_wandb``
  reads ``key=value`` tags back as overrides.
- **name**: ``name`` if set, else the job's folder name.
- **id**: kept in ``<run folder>/wandb_id.txt``: running again in the same folder (a resume)
  continues the same W&B run.
- **where**: ``<run folder>/wandb/``.
- **start-up failure** (bad key, no network online, disk full): ``logger.on_error=fail`` stops
  with one line (``TrackingError``); ``offline`` warns in one line and logs offline instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opd_exp.divergences import DIVERGENCES, parameter_names
from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.secrets import REDACTED, SECRET_NAME, plain_config, redact_label, scrub, scrub_text, secret_values  # noqa: F401
from opd_exp.sinks import Sink, _clean

MAX_TAG = 64  # W&B's limit on one tag

# Summary of a metric in W&B: "last" unless listed (best value and last value for eval curves).
SUMMARIES = {
    "eval/accuracy": "max,last",
    "eval/kl_reverse": "min,last",
    "eval/kl_forward": "min,last",
    "eval/jsd": "min,last",
}
STEP_METRIC = "step"  # training step: the x axis of every chart, train and eval alike


class TrackingError(ConfigError):
    """W&B could not start and ``logger.on_error=fail``: one line, exit code 2."""


# -- what Hydra knows about the job -------------------------------------------------


@dataclass
class JobInfo:
    """The Hydra job a run belongs to (empty when not run through Hydra)."""

    overrides: list[str] = field(default_factory=list)  # the job's task overrides, in order
    multirun: bool = False
    sweep_dir: str | None = None  # hydra.sweep.dir, for a multirun
    sweep: str | None = None  # the `sweep=` choice, if any
    job_num: int | None = None


def hydra_job() -> JobInfo:
    """What the running Hydra job says about itself; an empty JobInfo outside Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return JobInfo()
        hc = HydraConfig.get()
    except Exception:  # pragma: no cover - Hydra missing or half set up
        return JobInfo()
    multirun = hc.mode == RunMode.MULTIRUN
    return JobInfo(
        overrides=list(hc.overrides.task),
        multirun=multirun,
        sweep_dir=str(hc.sweep.dir) if multirun else None,
        sweep=hc.runtime.choices.get("sweep"),
        job_num=hc.job.get("num") if multirun else None,
    )


def _override_tag(override: str) -> str | None:
    o = override.lstrip("+~")
    if o.startswith(("hydra.", "hydra/", "logger.", "logger=")):
        return None
    return o


def run_tags(user_tags: Iterable[str], overrides: Iterable[str], divergence: Mapping[str, Any] | None = None) -> list[str]:
    """logger.tags + the job's overrides + the divergence it ran; each <= 64 chars, no repeats."""
    tags = list(user_tags)
    tags += [t for t in map(_override_tag, overrides) if t]
    if divergence:
        name = divergence.get("name")
        tags.append(f"divergence={name}")
        for key in parameter_names(name) if name in DIVERGENCES else ():
            if divergence.get(key) is not None:
                tags.append(f"divergence.{key}={divergence[key]}")
    out: list[str] = []
    for t in scrub(tags):
        t = str(t)[:MAX_TAG]
        if t and t not in out:
            out.append(t)
    return out


def run_group(group: str | None, job: JobInfo) -> str | None:
    """logger.group; else the multirun folder for a multirun; else none."""
    if group:
        return group
    if job.multirun and job.sweep_dir:
        sweep_dir = Path(job.sweep_dir)
        with contextlib.suppress(ValueError):  # outside the working directory: keep it absolute
            sweep_dir = sweep_dir.resolve().relative_to(Path.cwd().resolve())
        return str(sweep_dir)[-128:]
    return None


# -- starting W&B -----------------------------------------------------------------


def _one_line(ex: BaseException) -> str:
    """W&B's messages carry the key that failed: scrub it."""
    return scrub(" ".join(str(ex).split())[:300] or type(ex).__name__)


def read_run_id(run_dir: Path) -> str | None:
    f = Path(run_dir) / "wandb_id.txt"
    return f.read_text().strip() or None if f.is_file() else None


def start_run(
    run_dir: Path,
    *,
    project: str,
    entity: str | None,
    group: str | None,
    job_type: str | None,
    tags: list[str],
    mode: str,
    on_error: str,
    name: str | None,
    config: Mapping[str, Any],
    run_id: str,
    warn=None,
):
    """``wandb.init`` in ``<run_dir>/wandb`` with ``id=run_id`` (resumed if it exists); on
    failure, fail or fall back to offline as ``on_error`` says. Returns the wandb Run."""
    import wandb

    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    run_dir = Path(run_dir)
    (run_dir / "wandb").mkdir(parents=True, exist_ok=True)

    def init(m: str):
        with scrubbed_argv():  # W&B records the command line (``args`` in run-*.wandb)
            return _init(m)

    def _init(m: str):
        return wandb.init(
            project=project,
            entity=entity,
            group=group,
            job_type=job_type,
            tags=tags or None,
            mode=m,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=dict(config),
        )

    try:
        return init(mode)
    except Exception as ex:  # bad key, no network, disk full, ...
        why = _one_line(ex)
        if mode == "offline" or on_error != "offline":
            raise TrackingError(
                f"logger=wandb could not start (logger.mode={mode}): {why}; allowed: fix it, or run with "
                f"logger.mode=offline, logger.on_error=offline or logger=none (metrics.jsonl is written in every case)"
            ) from None
        warn(
            f"opd-train: warning: W&B could not start (logger.mode={mode}): {why}; logging offline to "
            f"{run_dir / 'wandb'} instead (upload later with `wandb sync`)"
        )
    with contextlib.suppress(Exception):  # older wandb: nothing to forget
        wandb.teardown()  # forget the failed run, so its id can start again offline
    try:
        return init("offline")
    except Exception as ex:
        raise TrackingError(f"logger=wandb could not start offline either: {_one_line(ex)}; allowed: logger=none") from None


@contextlib.contextmanager
def scrubbed_argv():
    """``sys.argv`` with credentials redacted while W&B reads it (its settings copy the command
    line into the run's metadata), restored afterwards."""
    saved = list(sys.argv)
    sys.argv = [scrub_text(a) for a in saved]
    try:
        yield
    finally:
        sys.argv = saved


def define_metrics(run) -> None:
    """Every metric on the training-step axis; best and last values for the eval curves."""
    run.define_metric(STEP_METRIC)
    for key, summary in SUMMARIES.items():
        run.define_metric(key, step_metric=STEP_METRIC, summary=summary)
    run.define_metric("*", step_metric=STEP_METRIC)


class WandbSink(Sink):
    """Weights & Biases (offline by default); the glue is above.

    The run lives in ``<run_dir>/wandb/``; its id is kept in ``<run_dir>/wandb_id.txt`` so a
    resumed run continues the same W&B run. Every metric is charted against ``step`` (the
    training step, logged with each row), so a resumed run's rows are never dropped. Closing
    while an exception propagates finishes the run as failed (exit code 1).
    """

    is_wandb = True

    def __init__(
        self,
        run_dir: Path,
        *,
        project: str = "opd-exp",
        entity=None,
        group=None,
        job_type=None,
        tags=(),
        mode="offline",
        name=None,
        config=None,
        on_error: str = "fail",
        overrides=None,
    ):
        run_dir = Path(run_dir)
        job = hydra_job()
        config = scrub(plain_config(config or {}))
        if "name" in config:
            config["name"] = redact_label(config["name"])
        if isinstance(config.get("logger"), dict):  # the labels W&B shows: group and tags
            lg = config["logger"]
            lg["group"] = redact_label(lg.get("group"))
            lg["tags"] = [redact_label(t) for t in lg.get("tags") or []]
        overrides = job.overrides if overrides is None else list(overrides)
        run_id = read_run_id(run_dir) or os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:12]
        self._run = start_run(
            run_dir,
            project=project,
            entity=entity,
            group=redact_label(run_group(group, job)),
            job_type=job_type,
            tags=[redact_label(t) for t in run_tags(tags, overrides, config.get("divergence"))],
            mode=mode,
            on_error=on_error,
            name=redact_label(name or (run_dir.name if job.multirun else None)),
            config=config,
            run_id=run_id,
        )
        (run_dir / "wandb_id.txt").write_text(self._run.id)
        define_metrics(self._run)
        self._tracked = set(SUMMARIES)

    @classmethod
    def from_config(cls, cfg, run_dir: Path, **kw) -> WandbSink:
        """From a TrainConfig: its ``logger`` group and the whole config as the run config."""
        lg = cfg.logger
        return cls(
            run_dir,
            project=lg.project,
            entity=lg.entity,
            group=lg.group,
            job_type=lg.job_type,
            tags=lg.tags,
            mode=lg.mode,
            name=cfg.name,
            config=cfg,
            on_error=getattr(lg, "on_error", "fail"),
            **kw,
        )

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
