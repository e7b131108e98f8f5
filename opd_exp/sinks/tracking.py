"""W&B glue for opd-train: which run, group, tags and config a job gets, and how W&B starts.

Never imports models or the trainer. What it decides for one job:

- **config**: the resolved, validated config as a plain dict (enums by value), with anything
  that looks like a secret redacted (``scrub``); only the chosen options' keys (no other
  pair's recipe or other task's knobs: ``chosen_options``), divergence parameters the chosen
  divergence does not take left out (``logged_config``); ``variant``: the label of what the
  job varies.
- **group**: in a multirun ``<sweep>/<model pair>/<hash>``: the sweep is ``logger.group``
  (each file in ``sweeps/`` sets it) or else the multirun folder, and the hash is of the
  overrides every job shares (``trainer.max_steps=100``), so two runs of a sweep with other
  settings get two groups. ``logger.group`` typed on the command line is used as it is; a
  single run gets only that.
- **tags**: ``logger.tags``, then the overrides that define the variant (in a multirun the
  swept ones, read from the sweep file and from ``multirun.yaml``; never the seed,
  ``hydra.*``, ``logger.*`` or bookkeeping such as ``eval.every``), then the
  model pair (``model_pair=smollm2``: the option chosen, or its name), then the divergence it
  ran (``divergence=jsd``, ``divergence.beta=0.5``) so runs of a sweep that
  picks divergences through another key still carry them. ``opd_exp.analysis.load_wandb``
  reads ``key=value`` tags back as overrides.
- **name**: ``name`` if set, else in a multirun the job's folder name plus the group's hash
  (an ad-hoc multirun's bare job number is replaced by the job's swept overrides).
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

# what a variant is called has one owner, shared with opd-compare
from opd_exp.analysis.naming import SEED_KEYS, variant_name
from opd_exp.analysis.naming import variant_overrides as _variant_overrides
from opd_exp.divergences import DIVERGENCES, parameter_names
from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.secrets import (  # noqa: F401
    REDACTED,
    SECRET_NAME,
    plain_config,
    redact_label,
    redact_line,
    scrub,
    scrub_text,
    secret_values,
)
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
    swept: frozenset[str] = frozenset()  # override keys the multirun sweeps (sweep file + comma lists)
    choices: dict[str, Any] = field(default_factory=dict)  # the option chosen in each config group


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
    swept: set[str] = set()
    if multirun:
        params = hc.sweeper.get("params") or {}
        swept |= swept_keys(f"{k}={v}" for k, v in params.items())  # a sweep file's lists, not its constants
        swept |= swept_keys(launch_overrides(Path(str(hc.sweep.dir))))
    return JobInfo(
        overrides=list(hc.overrides.task),
        multirun=multirun,
        sweep_dir=str(hc.sweep.dir) if multirun else None,
        sweep=hc.runtime.choices.get("sweep"),
        job_num=hc.job.get("num") if multirun else None,
        swept=frozenset(swept),
        choices={k: v for k, v in hc.runtime.choices.items() if isinstance(v, str)},
    )


def launch_overrides(sweep_dir: Path) -> list[str]:
    """The command line's overrides of a multirun, as Hydra saved them in ``multirun.yaml``
    (before the jobs start, so every launcher's job can read them)."""
    import yaml

    try:
        saved = yaml.safe_load((sweep_dir / "multirun.yaml").read_text()) or {}
        return [str(o) for o in saved["hydra"]["overrides"]["task"]]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return []


_SWEEP_FUNCS = ("range(", "choice(", "glob(", "interval(", "tag(")


def swept_keys(overrides: Iterable[str]) -> set[str]:
    """Keys given a list on the command line (``divergence=rkl,jsd``, ``seed=range(3)``)."""
    out = set()
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and ("," in value or value.startswith(_SWEEP_FUNCS)) and not value.startswith(("[", "{", "'", '"')):
            out.add(key.lstrip("+~"))
    return out


# -- what defines a variant: tags, the `variant` config key, group and name -------------


def _key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def variant_overrides(overrides: Iterable[str], job: JobInfo) -> list[str]:
    """The overrides that define this run's variant (``naming.variant_overrides``): in a
    multirun the swept ones (not the seed); in a single run those that pick the variant."""
    return _variant_overrides(overrides, job.swept if job.multirun else None)


def constant_overrides(overrides: Iterable[str], job: JobInfo) -> list[str]:
    """A multirun's overrides that every job shares (not swept, not the seed, not hydra/logger):
    what tells one sweep from another run of it with other settings (100 vs 2500 steps)."""
    out = []
    for o in overrides:
        o = o.lstrip("+~")
        k = _key(o)
        if "=" in o and k not in job.swept and k not in SEED_KEYS and not o.startswith(("hydra.", "hydra/", "logger.", "logger=")):
            out.append(o)
    return sorted(out)


def settings_hash(overrides: Iterable[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(sorted(overrides)).encode()).hexdigest()[:8]


def _override_tag(override: str) -> str | None:
    o = override.lstrip("+~")
    if o.startswith(("hydra.", "hydra/", "logger.", "logger=")):
        return None
    return o


def run_tags(
    user_tags: Iterable[str], overrides: Iterable[str], divergence: Mapping[str, Any] | None = None, pair: str | None = None
) -> list[str]:
    """logger.tags + the variant's overrides (``variant_overrides``) + the model pair (``model_pair=smollm2``:
    a CPU stand-in is never tagged like the real pair) + the divergence it ran; each <= 64 chars, no repeats."""
    tags = list(user_tags)
    tags += [t for t in map(_override_tag, overrides) if t]
    if pair:
        tags.append(f"model_pair={pair}")
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


def run_group(group: str | None, job: JobInfo, pair: str | None = None, overrides: Iterable[str] | None = None) -> str | None:
    """A multirun's group: ``<sweep>/<model pair>/<hash of the shared overrides>``, where the
    sweep is ``logger.group`` (each file in sweeps/ sets it) or else the multirun folder; so a
    100-step and a 2500-step run of one sweep never share a group. ``logger.group`` given on
    the command line is taken as it is; a single run has only that."""
    overrides = list(job.overrides if overrides is None else overrides)
    explicit = any(o.lstrip("+~").startswith("logger.group=") for o in overrides)
    if group and (explicit or not job.multirun):
        return group
    if not job.multirun:
        return None
    base = group
    if not base and job.sweep_dir:
        sweep_dir = Path(job.sweep_dir)
        with contextlib.suppress(ValueError):  # outside the working directory: keep it absolute
            sweep_dir = sweep_dir.resolve().relative_to(Path.cwd().resolve())
        base = str(sweep_dir)
    if not base:
        return None
    parts = [base] + ([pair] if pair else []) + [settings_hash(constant_overrides(overrides, job))]
    return "/".join(parts)[-128:]


def run_name(name: str | None, run_dir: Path, job: JobInfo, overrides: Iterable[str] | None = None) -> str | None:
    """``name`` if set; in a multirun the job folder plus the hash of the shared overrides (the
    group's), so two sweeps with other settings never give two runs one name."""
    if name or not job.multirun:
        return name
    overrides = list(job.overrides if overrides is None else overrides)
    label = run_dir.name
    swept = [o.lstrip("+~") for o in overrides if _key(o) in job.swept and "=" in o]
    if label.isdigit() and swept:  # an ad-hoc multirun's bare job number: what the job sweeps
        label = ",".join(swept)
    elif label.isdigit() and job.sweep_dir:  # multirun/<date>/<time>/<n>
        label = f"{Path(job.sweep_dir).name}_{label}"
    return f"{label[:110]}-{settings_hash(constant_overrides(overrides, job))}"


def _only(group: Any, drop: Iterable[str]) -> Any:
    return {k: v for k, v in group.items() if k not in set(drop)} if isinstance(group, Mapping) else group


def chosen_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config without the knobs of options the run did not choose: another pair's recipe
    (``model_pair.embedded`` of a SmolLM2 run), another task's (``task.min_answers`` of an
    arithmetic run), a served teacher's connection of an in-process one, LoRA's, vLLM's and the
    loss forms' keys where they are off."""
    from opd_exp.config.positions import chosen_positions
    from opd_exp.config.world import COMMON_TASK_KEYS, TASK_KEYS

    out = dict(config)
    pair = out.get("model_pair")
    if isinstance(pair, Mapping):
        models = [str(pair.get("student", "")), str(pair.get("teacher", ""))]
        out["model_pair"] = _only(pair, [p for p in ("embedded", "smollm2") if not any(m.startswith(f"{p}:") for m in models)])
    task = out.get("task")
    if isinstance(task, Mapping) and task.get("name") in TASK_KEYS:
        keep = set(COMMON_TASK_KEYS) | set(TASK_KEYS[task["name"]])
        out["task"] = {k: v for k, v in task.items() if k in keep}
    teacher = out.get("teacher")
    if isinstance(teacher, Mapping) and teacher.get("name") != "served":
        out["teacher"] = {"name": teacher.get("name")}
    est = out.get("estimator")
    if isinstance(est, Mapping) and not str(est.get("name", "")).startswith("topk"):
        out["estimator"] = _only(est, ["k"])
    loss = out.get("loss")
    if isinstance(loss, Mapping):
        drop = [] if loss.get("name") == "ppo" else ["clip_eps", *(k for k in loss if k.startswith("ppo_"))]
        drop += [] if loss.get("credit") == "sequence" else ["gamma"]
        out["loss"] = _only(loss, drop)
    if isinstance(out.get("positions"), Mapping):
        out["positions"] = chosen_positions(out["positions"])
    scale = out.get("scale")
    if isinstance(scale, Mapping) and not scale.get("lora_rank"):
        out["scale"] = _only(scale, [k for k in scale if k.startswith("lora_")])
    rollout = out.get("rollout")
    if isinstance(rollout, Mapping) and rollout.get("engine") != "vllm":
        out["rollout"] = _only(rollout, ["vllm_gpu_memory_utilization"])
    return out


def logged_config(config: Mapping[str, Any], variant: str, pair_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config W&B gets: only the chosen options' keys (``chosen_options``), parameters the
    chosen divergence does not take left out (an rkl run has no ``divergence.beta``), the
    ``variant`` label, and the prepared pair's record."""
    out = chosen_options(config)
    div = out.get("divergence")
    if isinstance(div, Mapping) and div.get("name") in DIVERGENCES:
        keep = set(parameter_names(div["name"])) | {"name", "temperature"}
        out["divergence"] = {k: v for k, v in div.items() if k in keep}
    out["variant"] = variant
    if pair_info:
        out["pair"] = dict(pair_info)
    return out


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
    quiet: bool = False,
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
            # a multirun's jobs would each print W&B's banners: keep its console quiet
            settings=wandb.Settings(silent=True) if quiet else None,
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
    while an exception propagates finishes the run as failed (exit code 1); a preempted run ends with
    exit code 75.
    """

    is_wandb = True
    takes_exit_code = True  # MultiSink.close passes a preempted run's 75

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
        for key, value in (("logger.project", project), ("logger.entity", entity)):
            if value and redact_label(str(value)) != str(value):  # a pasted API key would be W&B's folder name
                raise TrackingError(
                    f"{key}: the value looks like a credential (an API key or token, not shown); allowed: a W&B {key[7:]} name"
                )
        if redact_line(str(run_dir.resolve())) != str(run_dir.resolve()):  # W&B writes the folder's path into its files
            raise TrackingError(
                f"hydra.run.dir={redact_line(str(run_dir))}: the run folder's path holds a credential (a token, not shown), and "
                f"W&B records that path in its files (debug.log, run-*.wandb); allowed: a run folder whose path has no "
                f"credential, or logger=none"
            )
        job = hydra_job()
        config = scrub(plain_config(config or {}))
        if "name" in config:
            config["name"] = redact_label(config["name"])
        if isinstance(config.get("logger"), dict):  # the labels W&B shows: group and tags
            lg = config["logger"]
            lg["group"] = redact_label(lg.get("group"))
            lg["tags"] = [redact_label(t) for t in lg.get("tags") or []]
        overrides = job.overrides if overrides is None else list(overrides)
        variant = variant_overrides(overrides, job)
        pair = (config.get("model_pair") or {}).get("name") if isinstance(config.get("model_pair"), Mapping) else None
        run_id = read_run_id(run_dir) or os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:12]
        self._run = start_run(
            run_dir,
            project=project,
            entity=entity,
            group=redact_label(run_group(group, job, pair, overrides)),
            job_type=job_type,
            tags=[redact_label(t) for t in run_tags(tags, variant, config.get("divergence"), job.choices.get("model_pair") or pair)],
            mode=mode,
            on_error=on_error,
            name=redact_label(run_name(name, run_dir, job, overrides)),
            config=logged_config(config, variant_name(variant)),
            run_id=run_id,
            quiet=job.multirun,
        )
        (run_dir / "wandb_id.txt").write_text(self._run.id)
        define_metrics(self._run)
        self._tracked = set(SUMMARIES)
        div = config.get("divergence")
        own = f"eval/{div.get('name')}" if isinstance(div, Mapping) and div.get("name") else None
        if own and own not in self._tracked:  # eval/<the trained divergence>: best and last, like the fixed ones
            self._run.define_metric(own, step_metric=STEP_METRIC, summary="min,last")
            self._tracked.add(own)

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

    def config(self, values):
        self._run.config.update(dict(values), allow_val_change=True)

    def summary(self, values):
        for k, v in _clean(values).items():  # a tracked key keeps its best/last values: its final one
            self._run.summary[f"final/{k}" if k in self._tracked else k] = v  # goes to final/<key>

    def close(self, exit_code: int | None = None):
        """Finish the W&B run with ``exit_code`` where one is given (75: preempted, saved, to be
        resumed; the stop propagates as an exception), else 1 while an exception propagates, else 0."""
        if self._run is None:
            return
        failed = sys.exc_info()[0] is not None  # called from a `finally` during an exception
        run, self._run = self._run, None
        run.finish(exit_code=exit_code or (1 if failed else 0))
