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
import copy
import os
import sys
from pathlib import Path

import hydra
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from opd_exp.cli.jobs import FAILED_JOBS, JOBS_STARTED, failed_summary
from opd_exp.cli.searchpath import register as register_sweeps
from opd_exp.config import TrainConfig, folders, register_configs
from opd_exp.runtime.errors import ConfigError, first_line
from opd_exp.runtime.guards import EXIT_CONFIG, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PREEMPTED, Diverged, Preempted

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
        write_hydra_record(cfg, hc, run_dir)
        if hc.mode == RunMode.MULTIRUN:
            scrub_sweep_record(Path(hc.sweep.dir))
        check_choices(hc)
        typed = _validated(cfg, hc)
        # a resume with other settings is refused before W&B or any model starts
        from opd_exp.runtime.fingerprint import check_run_folder

        check_run_folder(run_dir, typed)
        return _train(typed, run_dir)


def _train(typed: TrainConfig, run_dir: Path) -> float:
    sinks = []
    try:
        # start W&B before the models load: a failure stops at once; under torchrun, rank 0 only
        if typed.logger.name.value == "wandb" and os.environ.get("RANK", "0") == "0":
            from opd_exp.sinks.tracking import WandbSink

            sinks.append(WandbSink.from_config(typed, run_dir))
        from opd_exp.training.engines import require_extras  # heavy imports only after the config is known good
        from opd_exp.training.trainer import Trainer

        require_extras(typed)
        trainer = Trainer(typed, run_dir, sinks=sinks, **build_inputs(typed))
        summary = trainer.run()
    except Preempted as ex:  # the trainer closed its sinks before raising: the W&B run is not failed
        # Exit from inside the job: in a multirun Hydra would go on to the next job.
        print(f"opd-train: preempted: {ex}", file=sys.stderr, flush=True)
        if getattr(ex, "previous_handler", None) is not None:
            ex.previous_handler(ex.signum, None)  # submitit's: requeues the job, then exits
        sys.exit(EXIT_PREEMPTED)
    finally:
        _close(sinks)  # idempotent; during an exception the W&B run is marked failed
    return float(summary.get("eval/kl_reverse", float("nan")))  # what a sweeper minimises


def _close(sinks) -> None:
    for sink in sinks:
        sink.close()


def _job_failed(ex: BaseException, code: int, hc) -> float:
    """One line for a job that cannot run. A single run exits with ``code``; in a multirun the
    other jobs still run (the failure is recorded and ``main`` exits non-zero at the end)."""
    line = one_line(ex)
    print(f"opd-train: error: {line}", file=sys.stderr, flush=True)
    if hc.mode != RunMode.MULTIRUN:
        sys.exit(code)
    FAILED_JOBS.append((int(hc.job.get("num", len(FAILED_JOBS))), str(hc.runtime.output_dir), line, code))
    if "BasicLauncher" not in str(hc.launcher.get("_target_", "")):
        raise ex  # jobs in other processes: Hydra collects the failure (after every job has run)
    return float("nan")


def build_inputs(cfg: TrainConfig) -> dict:
    """The task and the model pair a config names (the data is read before any model loads)."""
    from opd_exp.pairs import load_pair
    from opd_exp.runtime import distributed
    from opd_exp.tasks import build_task

    check_device(cfg.trainer.device, int(os.environ.get("LOCAL_RANK", "0")))
    task = build_task(cfg.task)
    # A missing or damaged dataset fails here, before the models load (both splits: the
    # trainer reads the eval split too).
    for split, problems in (("training", task.train_problems()), ("eval", task.eval_problems())):
        if not problems:
            raise ConfigError(
                f"task: {cfg.task.name!r} has no {split} problems (empty dataset or split); allowed: a task with at least one"
            )
    device = distributed.device_for(cfg.trainer.device, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    return {"task": task, "pair": load_pair(cfg.model_pair, cfg.task, device)}


def check_device(device: str, local_rank: int = 0) -> None:
    """A CUDA device asked for on a machine without one fails here, before the data and both
    models load (the shipped GPU experiments set ``trainer.device: cuda``)."""
    if not (device == "cuda" or device.startswith("cuda:")):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.device={device!r}: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); "
            f"allowed: trainer.device=cpu or auto on this machine, or a machine with a GPU"
        )
    index = int(device.split(":", 1)[1]) if ":" in device else local_rank
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"trainer.device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
            f"allowed: cuda:0 .. cuda:{torch.cuda.device_count() - 1}, cuda, auto or cpu"
        )


# `opd-train` asks Hydra not to write `.hydra/` itself (main() adds hydra.output_subdir=null):
# the job writes it once it holds the folder's lock, with credentials already redacted.
_OWN_RECORD_ENV = "OPD_TRAIN_HYDRA_SUBDIR"


def write_hydra_record(cfg: DictConfig, hc, run_dir: Path) -> None:
    """Hydra's record of the job (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``),
    written by the job that holds the lock, credentials redacted before they reach the disk.
    When Hydra wrote it (``hydra.output_subdir`` given by the user), it is scrubbed in place."""
    from opd_exp.runtime.secrets import scrub_file, scrub_text

    subdir = hc.output_subdir
    if subdir is not None:
        folder = run_dir / subdir
        for f in folder.glob("*.yaml") if folder.is_dir() else ():
            scrub_file(f)
        return
    subdir = os.environ.get(_OWN_RECORD_ENV)
    if not subdir or os.environ.get("RANK", "0") != "0":  # the user's output_subdir=null; torchrun: rank 0 writes
        return
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = OmegaConf.create(OmegaConf.to_container(HydraConfig.instance().cfg, resolve=False))
    with open_dict(hydra_cfg):
        hydra_cfg.hydra.output_subdir = subdir  # as if Hydra had written it
        hydra_cfg.hydra.overrides.hydra = [o for o in hydra_cfg.hydra.overrides.hydra if not o.startswith("hydra.output_subdir=")]
    folder = run_dir / subdir
    folder.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra_cfg), ("overrides.yaml", hc.overrides.task)):
        tmp = folder / f".{name}.tmp"
        tmp.write_text(scrub_text(OmegaConf.to_yaml(node)))
        os.replace(tmp, folder / name)


def scrub_hydra_dir(folder: Path) -> None:
    """Redact credentials from the YAML records in ``folder`` (``opd_exp.runtime.secrets.scrub_text``)."""
    from opd_exp.runtime.secrets import scrub_file

    for f in Path(folder).glob("*.yaml") if Path(folder).is_dir() else ():
        scrub_file(f)


def scrub_sweep_record(sweep_dir: Path) -> None:
    """The sweep folder's ``multirun.yaml`` (written by Hydra before the first job) records every
    override verbatim: redact credentials there too."""
    from opd_exp.runtime.secrets import scrub_file

    f = sweep_dir / "multirun.yaml"
    if f.is_file():
        with contextlib.suppress(OSError):  # another job may be rewriting it: it scrubs the same way
            scrub_file(f)


def _config_repo(hc):
    """Hydra's view of the config folders this job was composed from (``conf/``, ``sweeps/`` and
    the user's ``hydra.searchpath``), or None where a launcher runs jobs without Hydra's loader."""
    try:
        from hydra._internal.config_repository import ConfigRepository
        from hydra.core.global_hydra import GlobalHydra

        search = copy.deepcopy(GlobalHydra.instance().config_loader().get_search_path())
        entries = search.get_path()
        schema = entries.pop(-1) if entries and entries[-1].provider == "schema" else None
        for path in hc.searchpath or ():  # hydra.searchpath: the user's config folders
            search.append(provider="hydra.searchpath", path=path)
        if schema is not None:
            search.append(provider=schema.provider, path=schema.path)
        return ConfigRepository(search)
    except Exception:  # pragma: no cover
        return None


def _group_options(hc, group: str) -> list[str]:
    from hydra.core.object_type import ObjectType

    repo = _config_repo(hc)
    return sorted(repo.get_group_options(group, ObjectType.CONFIG)) if repo is not None else []


def check_choices(hc) -> None:
    """An explicitly chosen option of an ``optional`` group (``experiment=...``, ``sweep=...``) that
    does not exist is skipped by Hydra without a word: refuse it, listing the valid ones."""
    for group, option in hc.runtime.choices.items():
        if option is None or group.startswith("hydra/") or not isinstance(option, str):
            continue
        options = _group_options(hc, group)
        if options and option not in options:
            raise ConfigError(f"{group}={option}: no such option; allowed: {', '.join(options)}")


def _validated(cfg: DictConfig, hc) -> TrainConfig:
    from omegaconf.errors import MissingMandatoryValue

    try:
        return to_train_config(cfg)
    except MissingMandatoryValue as ex:  # a required group removed (`~model_pair`) or never chosen
        key = str(getattr(ex, "full_key", "") or "") or first_line(ex).rsplit(":", 1)[-1].strip()
        options = _group_options(hc, key)
        allowed = f"{key}=<option> with one of: {', '.join(options)}" if options else f"a value for {key}"
        raise ConfigError(f"{key}: has no value (removed with `~{key}`?); allowed: {allowed}") from None


def one_line(ex: BaseException) -> str:
    """Hydra/OmegaConf errors span lines (search paths, options, object types): one line."""
    import re

    from hydra.errors import MissingConfigException
    from omegaconf.errors import MissingMandatoryValue

    if isinstance(ex, (ConfigError, Diverged)):  # ours: already one line
        return first_line(ex, 2000)
    if isinstance(ex, MissingConfigException) and ex.options:
        missing = (ex.missing_cfg_file or "").strip("/")
        group, _, option = missing.rpartition("/")
        if group:
            return f"{group}={option}: no such option; allowed: {', '.join(sorted(ex.options))}"
    text = str(ex)
    # a group file without `# @package _global_`: its keys land under `<group>.`
    m = re.search(r"In '(?P<group>[\w/.-]+)/(?P<name>[\w.-]+)'.*Key '(?P<key>[\w-]+)' not in '\w+'", text, re.DOTALL)
    if m and m["group"].rsplit("/", 1)[-1] == m["key"]:
        return (
            f"{m['group']}={m['name']}: the file {m['group']}/{m['name']}.yaml sets its keys under '{m['key']}.' (its first line "
            f"is not `# @package _global_`); allowed: a first line `# @package _global_` (as in conf/experiment/*.yaml)"
        )
    if isinstance(ex, MissingMandatoryValue) or "has missing mandatory value" in text:
        key = getattr(ex, "full_key", None) or text.rsplit(":", 1)[-1].strip()
        return f"{key}: has no value (removed with `~{key}`?); allowed: a value, or an option of the {key} group (e.g. `{key}=<option>`)"
    if "LexerNoViableAltException" in text or "token recognition error" in text:
        bad = next((c for c in text if ord(c) > 127), None)
        if bad is not None:
            return (
                f"{first_line(ex, 200)}: the override holds the non-ASCII character {bad!r}, which Hydra reads only inside "
                f"quotes; allowed: a quoted value, e.g. 'key=\"{bad}...\"' (the shell's quotes around Hydra's)"
            )
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


def _yaml_line(ex: BaseException) -> str:
    """A YAML syntax error in a config file: where, and what the parser expected."""
    mark = getattr(ex, "problem_mark", None) or getattr(ex, "context_mark", None)
    where = f"{mark.name}:{mark.line + 1}" if mark is not None else "a config file"
    problem = " ".join(str(getattr(ex, "problem", "") or first_line(ex)).split())
    return f"{where} is not valid YAML ({problem}); allowed: a YAML file (quote values with ':', '[', '{{' or '#' in them)"


def _fail(ex: BaseException) -> None:
    print(f"opd-train: error: {one_line(ex)}", file=sys.stderr)
    sys.exit(EXIT_CONFIG)


def _argv_problem(argv: list[str]) -> str | None:
    """Flag combinations Hydra refuses with a traceback."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    shown = [a for a in argv if a in ("--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")]
    if multirun and shown:
        return (
            f"-m and {shown[0]}: Hydra prints the config of one job, not of a multirun; allowed: {shown[0]} without -m "
            f"(with one value per swept key), or -m without {shown[0]} (each job's config is saved in its .hydra/config.yaml)"
        )
    return None


def main() -> None:
    """Console entry point."""
    import yaml
    from hydra.errors import HydraException

    if _PLUGIN_ERROR is not None:
        _fail(_PLUGIN_ERROR)
    user_wants_full = bool(os.environ.get("HYDRA_FULL_ERROR"))
    problem = _argv_problem(sys.argv[1:])
    if problem and not user_wants_full:
        print(f"opd-train: error: {problem}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    argv = list(sys.argv)
    informational = {"--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help", "--shell-completion", "-sc"}
    if not informational & set(argv[1:]) and not any(a.lstrip("+~").startswith("hydra.output_subdir=") for a in argv[1:]):
        # the job writes .hydra/ itself, after taking the folder's lock (write_hydra_record)
        sys.argv = [*argv, "hydra.output_subdir=null"]
        os.environ[_OWN_RECORD_ENV] = ".hydra"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach us instead of Hydra's printer
    FAILED_JOBS.clear()
    JOBS_STARTED.clear()
    try:
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
        print(f"opd-train: error: {_yaml_line(ex)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except OSError as ex:  # e.g. hydra.run.dir under a file, a read-only or full disk
        if user_wants_full:
            raise
        _fail(io_error(ex))
    finally:
        sys.argv = argv
        os.environ.pop(_OWN_RECORD_ENV, None)
        if not user_wants_full:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    if FAILED_JOBS:
        print(f"opd-train: error: {failed_summary()}", file=sys.stderr, flush=True)
        codes = {c for *_, c in FAILED_JOBS}
        sys.exit(EXIT_CONFIG if EXIT_CONFIG in codes else max(codes))


def io_error(ex: OSError) -> ConfigError:
    """A disk or permission problem as one line (a full disk during a checkpoint save included)."""
    where = f" ({ex.filename})" if getattr(ex, "filename", None) else ""
    return ConfigError(
        f"cannot write the run folder or read an input{where}: {ex.strerror or first_line(ex)}; "
        f"allowed: a writable hydra.run.dir with free space, and readable inputs"
    )


if __name__ == "__main__":
    main()
