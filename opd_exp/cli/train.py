"""`opd-train` (also `python -m opd_exp.cli.train`): compose the config, validate it, run the loop.

Config errors (an unknown option or key, a wrong type, an out-of-range value, a
combination that cannot work) end the command with one line on stderr and exit code 2,
before any model loads. Set HYDRA_FULL_ERROR=1 to see Hydra's full report instead.

Exit codes (opd_exp/runtime/guards.py, docs/reliability.md): 0 finished; 2 config/input error;
3 too many non-finite steps in a row; 75 preempted by SIGTERM/SIGUSR1/SIGUSR2 after saving
a checkpoint (run the same command again to resume).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from opd_exp.cli.searchpath import register as register_sweeps
from opd_exp.config import TrainConfig, register_configs
from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.guards import EXIT_CONFIG, EXIT_DIVERGED, EXIT_PREEMPTED, Diverged, Preempted

try:
    register_configs()  # loads OPD_PLUGINS first: their divergences and tasks become choices
except ConfigError as _ex:  # a plugin that does not import: one line from main()
    _PLUGIN_ERROR: ConfigError | None = _ex
else:
    _PLUGIN_ERROR = None
register_sweeps()  # sweeps/ on Hydra's search path: `opd-train -m sweep=<name>`


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The composed DictConfig as a validated ``TrainConfig`` (ranges + combinations)."""
    typed = OmegaConf.to_object(cfg)
    if not isinstance(typed, TrainConfig):
        raise ConfigError(f"config root is {type(typed).__name__}; allowed: a TrainConfig (conf/train.yaml)")
    _reject_unknown_keys(typed)
    return typed


def _reject_unknown_keys(obj, prefix: str = "") -> None:
    """`+key=value` slips past the schema (OmegaConf sets it as an attribute): refuse it."""
    import dataclasses

    if not dataclasses.is_dataclass(obj):
        return
    names = [f.name for f in dataclasses.fields(obj)]
    for key in vars(obj):
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown key; allowed: {', '.join(names)}")
    for name in names:
        _reject_unknown_keys(getattr(obj, name), f"{prefix}{name}.")


# An absolute path: as a console script, Hydra would resolve "../conf" as a module and fail.
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _app(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)  # never chdir: paths stay the user's
    scrub_hydra_dir(run_dir / (HydraConfig.get().output_subdir or ".hydra"))  # before anything can fail
    try:
        typed = to_train_config(cfg)
    except ConfigError as ex:  # exit here: Hydra would add its own "Error executing job" line
        _fail(ex)
    try:  # a resume with other settings: refused before W&B or any model starts
        from opd_exp.runtime.fingerprint import check_run_folder

        check_run_folder(run_dir, typed)
    except ConfigError as ex:
        _fail(ex)
    sinks = []
    # start W&B before the models load: a failure stops at once; under torchrun, rank 0 only
    if typed.logger.name.value == "wandb" and os.environ.get("RANK", "0") == "0":
        from opd_exp.sinks.tracking import TrackingError, WandbSink

        try:
            sinks.append(WandbSink.from_config(typed, run_dir))
        except TrackingError as ex:
            _fail(ex)
    from opd_exp.training.trainer import Trainer, require_extras  # heavy imports only after the config is known good

    try:
        try:
            require_extras(typed)
            trainer = Trainer(typed, run_dir, sinks=sinks, **build_inputs(typed))
        except BaseException:
            for sink in sinks:
                sink.close()  # inside the exception: the W&B run is marked failed
            raise
        summary = trainer.run()
    except ConfigError as ex:  # a bad input found while loading (data, models, run folder): one line
        _fail(ex)
    except Preempted as ex:
        # Exit from inside the job: in a multirun Hydra would go on to the next job.
        print(f"opd-train: preempted: {ex}", file=sys.stderr, flush=True)
        if getattr(ex, "previous_handler", None) is not None:
            ex.previous_handler(ex.signum, None)  # submitit's: requeues the job, then exits
        sys.exit(EXIT_PREEMPTED)
    except Diverged as ex:
        print(f"opd-train: error: {ex}", file=sys.stderr, flush=True)
        from hydra.types import RunMode

        if HydraConfig.get().mode != RunMode.MULTIRUN:
            sys.exit(EXIT_DIVERGED)
        raise  # in a multirun the other jobs still run; main() exits 3 at the end
    return float(summary.get("eval/kl_reverse", float("nan")))  # what a sweeper minimises


def build_inputs(cfg: TrainConfig) -> dict:
    """The task and the model pair a config names (the data is read before any model loads)."""
    from opd_exp.pairs import load_pair
    from opd_exp.runtime import distributed
    from opd_exp.tasks import build_task

    task = build_task(cfg.task)
    task.train_problems()  # a missing or damaged dataset fails here, before the models load
    device = distributed.device_for(cfg.trainer.device, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    return {"task": task, "pair": load_pair(cfg.model_pair, cfg.task, device)}


def scrub_hydra_dir(folder: Path) -> None:
    """Redact credentials from Hydra's record of the run (``.hydra/*.yaml``): an override like
    ``+logger.api_key=...`` or a token pasted into a value is written there before any
    validation runs. Same rules as the W&B config (``opd_exp.runtime.secrets.scrub``)."""
    import re

    from opd_exp.runtime.secrets import REDACTED, SECRET_NAME, secret_values

    if not folder.is_dir():
        return
    pattern = re.compile(r"([\w.+~/-]*(?:" + SECRET_NAME.pattern + r")[\w.-]*)(\s*[=:]\s*)([^\s,'\"\]}]+)", re.IGNORECASE)
    secrets = secret_values()
    for f in folder.glob("*.yaml"):
        text = f.read_text()
        clean = pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
        for value in secrets:
            clean = clean.replace(value, REDACTED)
        if clean != text:
            tmp = f.with_name(f".{f.name}.tmp")
            tmp.write_text(clean)
            os.replace(tmp, f)


def _one_line(ex: BaseException) -> str:
    """Hydra/OmegaConf errors span lines (search paths, options, object types): one line."""
    from hydra.errors import MissingConfigException

    if isinstance(ex, MissingConfigException) and ex.options:
        missing = (ex.missing_cfg_file or "").strip("/")
        group, _, option = missing.rpartition("/")
        if group:
            return f"{group}={option}: no such option; allowed: {', '.join(sorted(ex.options))}"
    parts = []
    for e in (ex, ex.__cause__):
        if e is None:
            continue
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        keep = [
            ln
            for ln in lines
            if not ln.startswith(("full_key:", "object_type", "reference_type", "Config search path", "provider=", "Set the environment"))
        ]
        key = getattr(e, "full_key", None)
        text = "; ".join(keep[:3])
        parts.append(f"{key}: {text}" if key and key not in text else text)
    return " -- ".join(p for p in parts if p) or type(ex).__name__


def _fail(ex: BaseException) -> None:
    print(f"opd-train: error: {_one_line(ex)}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)


def main() -> None:
    """Console entry point."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if _PLUGIN_ERROR is not None:
        _fail(_PLUGIN_ERROR)
    user_wants_full = bool(os.environ.get("HYDRA_FULL_ERROR"))
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach us instead of Hydra's printer
    try:
        _app()
    except Diverged:
        sys.exit(EXIT_DIVERGED)  # its line is already on stderr
    except (ConfigError, HydraException, OmegaConfBaseException) as ex:
        if user_wants_full:
            raise
        _fail(ex)
    except OSError as ex:  # e.g. hydra.run.dir under a file, a read-only or full disk
        if user_wants_full:
            raise
        where = f" ({ex.filename})" if getattr(ex, "filename", None) else ""
        _fail(
            ConfigError(
                f"cannot write the run folder or read an input{where}: {ex.strerror or ex}; allowed: a writable hydra.run.dir and readable inputs"
            )
        )
    finally:
        if not user_wants_full:
            os.environ.pop("HYDRA_FULL_ERROR", None)


if __name__ == "__main__":
    main()
