"""`opd-train` (also `python -m opd_exp.cli.train`): compose the config, validate it, run the loop.

Config errors (an unknown option or key, a wrong type, an out-of-range value, a
combination that cannot work) end the command with one line on stderr and exit code 2,
before any model loads. Set HYDRA_FULL_ERROR=1 to see Hydra's full report instead.

Exit codes (opd_exp/runtime/guards.py, docs/reliability.md): 0 finished; 2 config/input error
(in a multirun: after every job ran, if any job had one); 3 too many non-finite steps in a row;
75 preempted by SIGTERM/SIGUSR1/SIGUSR2 or Ctrl-C after saving a checkpoint (run the same
command again to resume); 130 a second Ctrl-C (stopped without saving).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import hydra
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from opd_exp.cli.compose import (
    build_inputs,
    check_choices,
    check_device,
    check_shown_config,
    dry_single_run,
    read_task,
    to_train_config,
    validated,
)
from opd_exp.cli.errors import argv_problem, io_error, one_line, yaml_line
from opd_exp.cli.jobs import FAILED_JOBS, HELD, JOBS_STARTED, failed_summary, log_line
from opd_exp.cli.jobs import job_failed as _job_failed
from opd_exp.cli.record import OWN_RECORD_ENV, parameter_counts, scrub_sweep_record, with_parameter_counts, write_hydra_record
from opd_exp.cli.searchpath import register as register_sweeps
from opd_exp.config import TrainConfig, folders, register_configs
from opd_exp.config.deprecated import upgrade_flat, upgrade_overrides
from opd_exp.config.plugins import missing_hint, record_plugins
from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.guards import EXIT_CONFIG, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PREEMPTED, Diverged, Preempted

try:
    register_configs()  # loads OPD_PLUGINS first: their divergences and tasks become choices
except ConfigError as _ex:  # a plugin that does not import: one line from main()
    _PLUGIN_ERROR: ConfigError | None = _ex
else:
    _PLUGIN_ERROR = None
register_sweeps()  # sweeps/ on Hydra's search path: `opd-train -m sweep=<name>`


__all__ = ["CONF_DIR", "build_inputs", "main", "one_line", "to_train_config"]  # what scripts and tests import from here

# An absolute path: as a console script, Hydra would resolve "../conf" as a module and fail.
CONF_DIR = str(folders.CONF_DIR)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _app(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)  # never chdir: paths stay the user's
    JOBS_STARTED.append(run_dir)
    try:
        return _job(cfg, hc, run_dir)
    except ConfigError as ex:  # a bad input (config, data, models, run folder): one line
        return _job_failed(ex, EXIT_CONFIG, hc)
    except OmegaConfBaseException as ex:  # e.g. a group removed with `~model_pair`
        return _job_failed(ex, EXIT_CONFIG, hc)
    except Diverged as ex:
        return _job_failed(ex, EXIT_DIVERGED, hc)
    except OSError as ex:  # a full or read-only disk while writing the run folder
        return _job_failed(io_error(ex), EXIT_CONFIG, hc)


def _job(cfg: DictConfig, hc, run_dir: Path) -> float:
    from opd_exp.runtime.checkpoint import RunLock

    # The folder's lock comes first, before W&B, the models and Hydra's record of the command:
    # a second job on a busy folder changes nothing in it. Under torchrun rank 0 holds it.
    lock = RunLock(run_dir) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()
    with lock:
        HELD.add(run_dir)  # from here on, this job's error line also goes to its train.log
        write_hydra_record(cfg, hc, run_dir)
        record_plugins(run_dir)  # a resume without them is told which to load
        if hc.mode == RunMode.MULTIRUN:
            scrub_sweep_record(Path(hc.sweep.dir))
        check_choices(hc)
        typed = validated(cfg, hc)
        # a resume with other settings is refused before W&B or any model starts
        from opd_exp.runtime.fingerprint import check_run_folder

        check_run_folder(run_dir, typed, upgrade=upgrade_flat)
        return _train(typed, run_dir)


def _train(typed: TrainConfig, run_dir: Path) -> float:
    sinks = []
    try:
        from opd_exp.training.engines import require_extras  # heavy imports only after the config is known good
        from opd_exp.training.trainer import Trainer

        # the device, the extras and the data first: a start that cannot run opens no W&B run
        check_device(typed.scale.device, int(os.environ.get("LOCAL_RANK", "0")))
        require_extras(typed)
        task = read_task(typed)  # every data check (a bad row, a question in both splits)
        # start W&B before the models load: a failure stops at once; under torchrun, rank 0 only
        if typed.logger.name.value == "wandb" and os.environ.get("RANK", "0") == "0":
            from opd_exp.sinks.tracking import WandbSink

            sinks.append(WandbSink.from_config(typed, run_dir))
        inputs = build_inputs(typed, task)
        counts = parameter_counts(inputs["pair"])  # before the trainer wraps the models
        trainer = Trainer(typed, run_dir, sinks=sinks, **inputs)
        trainer.pair_record = with_parameter_counts(trainer.pair_record, counts)  # summary.json's and W&B's pair
        summary = trainer.run()
    except Preempted as ex:  # the trainer closed its sinks before raising: the W&B run is not failed
        # Exit from inside the job: in a multirun Hydra would go on to the next job.
        print(f"opd-train: preempted: {ex}", file=sys.stderr, flush=True)
        log_line(run_dir, f"opd-train: preempted: {ex}")  # train.log holds every console line
        if getattr(ex, "previous_handler", None) is not None:
            ex.previous_handler(ex.signum, None)  # submitit's: requeues the job, then exits
        sys.exit(EXIT_PREEMPTED)
    finally:
        _close(sinks)  # idempotent; during an exception the W&B run is marked failed
    return float(summary.get("eval/kl_reverse", float("nan")))  # what a sweeper minimises


def _close(sinks) -> None:
    for sink in sinks:
        sink.close()


def _fail(ex: BaseException) -> None:
    run_dir = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.lstrip("+").startswith("hydra.run.dir=")), None)
    print(f"opd-train: error: {one_line(ex)}{missing_hint(run_dir)}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)


def main() -> None:
    """Console entry point."""
    import yaml
    from hydra.errors import HydraException

    if _PLUGIN_ERROR is not None:
        _fail(_PLUGIN_ERROR)
    user_wants_full = bool(os.environ.get("HYDRA_FULL_ERROR"))
    problem = argv_problem(sys.argv[1:])
    if problem and not user_wants_full:
        print(f"opd-train: error: {problem}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    original = list(sys.argv)
    try:
        sys.argv = [sys.argv[0], *upgrade_overrides(sys.argv[1:])]  # old keys (trainer.eval_every, ...): one notice each
    except ConfigError as ex:  # an old key beside its new one with another value
        sys.argv = original
        _fail(ex)
    argv = list(sys.argv)
    informational = {"--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help", "--shell-completion", "-sc"}
    if not informational & set(argv[1:]) and not any(a.lstrip("+~").startswith("hydra.output_subdir=") for a in argv[1:]):
        # the job writes .hydra/ itself, after taking the folder's lock (write_hydra_record)
        sys.argv = [*argv, "hydra.output_subdir=null"]
        os.environ[OWN_RECORD_ENV] = ".hydra"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach us instead of Hydra's printer
    FAILED_JOBS.clear()
    JOBS_STARTED.clear()
    HELD.clear()
    try:
        check_shown_config(argv[1:])  # `--cfg job` shows only a config that would run
        dry = dry_single_run(argv[1:])  # `hydra/launcher=dry` without -m: checked, never trained
        if dry is not None:
            print(dry, flush=True)
            return
        _app()
    except Diverged:
        sys.exit(EXIT_DIVERGED)  # its line is already on stderr
    except KeyboardInterrupt:  # Ctrl-C before training started, or a second one during it
        if user_wants_full:
            raise
        print(
            "opd-train: interrupted (Ctrl-C): stopped at once, nothing saved since the last checkpoint; "
            f"run the same command again to resume (exit code {EXIT_INTERRUPTED})",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(EXIT_INTERRUPTED)
    except (ConfigError, HydraException, OmegaConfBaseException) as ex:
        if user_wants_full:
            raise
        if not FAILED_JOBS:  # else: a launcher reported a job already counted (summary below)
            _fail(ex)
    except yaml.YAMLError as ex:
        if user_wants_full:
            raise
        print(f"opd-train: error: {yaml_line(ex)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except OSError as ex:  # e.g. hydra.run.dir under a file, a read-only or full disk
        if user_wants_full:
            raise
        _fail(io_error(ex))
    finally:
        sys.argv = original
        os.environ.pop(OWN_RECORD_ENV, None)
        if not user_wants_full:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    if FAILED_JOBS:
        print(f"opd-train: error: {failed_summary()}", file=sys.stderr, flush=True)
        codes = {c for *_, c in FAILED_JOBS}
        sys.exit(EXIT_CONFIG if EXIT_CONFIG in codes else max(codes))


if __name__ == "__main__":
    main()
