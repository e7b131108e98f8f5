"""From Hydra's composed config to what the loop needs: a validated ``TrainConfig`` (schema, ranges,
combinations, no unknown keys, chosen options that exist) and the task and model pair it names."""

from __future__ import annotations

import copy
import os

from omegaconf import DictConfig, OmegaConf, open_dict

from opd_exp.config import TrainConfig
from opd_exp.runtime.errors import ConfigError, first_line


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The composed DictConfig as a validated ``TrainConfig`` (ranges + combinations)."""
    typed = OmegaConf.to_object(cfg)
    if not isinstance(typed, TrainConfig):
        raise ConfigError(f"config root is {type(typed).__name__}; allowed: a TrainConfig (conf/train.yaml)")
    _reject_unknown_keys(typed)
    from opd_exp.cli.plugin_check import check_plugin_divergence, check_plugin_estimator

    check_plugin_divergence(typed.divergence.name.value, typed.divergence.params())  # a plugin's costs checked before it trains
    check_plugin_estimator(typed)  # and a plugin estimator's expected gradient
    check_pair_task(typed)
    return typed


def check_pair_task(cfg: TrainConfig) -> None:
    """A pair built for one task (``model_pair.for_task``, the lab's pairs) with another: refused,
    naming the first key that differs from that task option's file."""
    option = cfg.model_pair.for_task
    if not option:
        return
    from opd_exp.config import folders

    path = folders.CONF_DIR / "task" / f"{option}.yaml"
    if not path.is_file():
        raise ConfigError(f"model_pair.for_task={option!r}: no conf/task/{option}.yaml; allowed: a task option (conf/task/)")
    for key, want in (OmegaConf.to_container(OmegaConf.load(path)) or {}).items():
        got = getattr(cfg.task, key, None)
        if got != want:
            raise ConfigError(
                f"task.{key}={got!r} is not allowed with model_pair={cfg.model_pair.name} (built for task={option}, where "
                f"task.{key}={want!r}); allowed: task={option}, or another model_pair"
            )


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
    check_sweep_world(hc.runtime.choices.get("sweep"), hc.runtime.choices.get("experiment"))


def check_sweep_world(sweep: str | None, experiment: str | None) -> None:
    """A sweep that brings its own world (``override /model_pair`` in its defaults, as
    ``sweep=divergence``'s multimodal race does) is applied after an experiment and would replace
    the experiment's pair without a word: refuse the two together."""
    if not (isinstance(sweep, str) and isinstance(experiment, str)):
        return
    from opd_exp.config.folders import SWEEPS_DIR

    path = SWEEPS_DIR / "sweep" / f"{sweep}.yaml"
    text = path.read_text() if path.is_file() else ""
    if any(line.strip().startswith("- override /model_pair") for line in text.splitlines()):
        raise ConfigError(
            f"sweep={sweep} is not allowed with experiment={experiment} (the sweep brings its own world and would replace the "
            f"experiment's pair); allowed: a sweep that runs on the chosen pair (sweep=divergence_all experiment={experiment}), "
            f"or sweep={sweep} alone"
        )


def validated(cfg: DictConfig, hc) -> TrainConfig:
    from omegaconf.errors import MissingMandatoryValue

    try:
        return to_train_config(cfg)
    except MissingMandatoryValue as ex:  # a required group removed (`~model_pair`) or never chosen
        key = str(getattr(ex, "full_key", "") or "") or first_line(ex).rsplit(":", 1)[-1].strip()
        options = _group_options(hc, key)
        allowed = f"{key}=<option> with one of: {', '.join(options)}" if options else f"a value for {key}"
        raise ConfigError(f"{key}: has no value (removed with `~{key}`?); allowed: {allowed}") from None


def read_task(cfg: TrainConfig):
    """The task a config names, its data read and checked: both splits (an empty one, a bad row,
    a question in both splits, ``eval.size`` beyond the eval split). ``opd-train`` calls it before
    W&B starts and before any model loads: a data error leaves no W&B run behind."""
    from opd_exp.tasks import build_task
    from opd_exp.training.evaluate import eval_problems

    task = build_task(cfg.task)
    # A missing or damaged dataset fails here, before the models load (both splits: the
    # trainer reads the eval split too).
    for split, problems in (("training", task.train_problems()), ("eval", task.eval_problems())):
        if not problems:
            raise ConfigError(
                f"task: {cfg.task.name!r} has no {split} problems (empty dataset or split); allowed: a task with at least one"
            )
    eval_problems(cfg, task.train_problems(), task.eval_problems())  # the trainer's own check, now
    return task


def build_inputs(cfg: TrainConfig, task=None) -> dict:
    """The task and the model pair a config names (the data is read before any model loads;
    ``task``: one ``read_task`` already gave)."""
    from opd_exp.pairs import load_pair
    from opd_exp.pairs.load import check_teacher_is_not_student
    from opd_exp.pairs.teacher_map import load_map_teacher
    from opd_exp.runtime import distributed

    check_device(cfg.scale.device, int(os.environ.get("LOCAL_RANK", "0")))
    if task is None:
        task = read_task(cfg)
    device = distributed.device_for(cfg.scale.device, int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    pair = load_pair(cfg.model_pair, cfg.task, device, teacher_align=cfg.teacher.align)  # align=bytes: the teacher's own tokenizer
    check_teacher_is_not_student(cfg, pair)  # a copy of the student in another folder, with nothing to distil
    task.check_tokenizer(pair.tokenizer)  # e.g. a chat task on a tokenizer without a chat template
    # teachers.map's models are loaded by the pairs package, handed to the trainer with the pair
    return {"task": task, "pair": pair, "load_map_teacher": load_map_teacher}


def check_device(device: str, local_rank: int = 0) -> None:
    """A CUDA device asked for on a machine without one fails here, before the data and both
    models load (the shipped GPU experiments set ``scale.device: cuda``)."""
    if not (device == "cuda" or device.startswith("cuda:")):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"scale.device={device!r}: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); "
            f"allowed: scale.device=cpu or auto on this machine, or a machine with a GPU"
        )
    index = int(device.split(":", 1)[1]) if ":" in device else local_rank
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"scale.device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
            f"allowed: cuda:0 .. cuda:{torch.cuda.device_count() - 1}, cuda, auto or cpu"
        )


SHOW_FLAGS = ("--cfg", "-c")


def check_shown_config(argv: list[str]) -> None:
    """``--cfg job|hydra|all`` prints the composed config and exits 0: validate it first (schema,
    ranges, combinations, chosen options), so a config that would not run is never shown as if
    it would. A command with its own config folder or name (``-cp``/``-cd``/``-cn``) is shown as is."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.cfg is None or args.config_path or args.config_dir or args.config_name:
        return
    from opd_exp.config.folders import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=list(args.overrides), return_hydra_config=True)
        hc = cfg.hydra
        check_choices(hc)
        with open_dict(cfg):
            del cfg["hydra"]
        validated(cfg, hc)


def dry_single_run(argv: list[str]) -> str | None:
    """``opd-train hydra/launcher=dry ...`` without ``-m``: Hydra runs one job without any launcher,
    so the dry launcher would never be asked and the run would train. Act dry instead: compose and
    validate that one run as the launcher does for each job of a multirun (its one line, exit 2, on
    an error), train nothing, write nothing. The line to print when it would run; None when the
    command is not a dry one (or is a multirun, where the launcher itself answers)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    dry = any(o.lstrip("+").replace("override ", "").strip() == "hydra/launcher=dry" for o in args.overrides)
    if not dry or args.multirun or args.config_path or args.config_dir or args.config_name:
        return None
    from opd_exp.config.folders import CONF_DIR

    overrides = [o for o in args.overrides if not o.lstrip("+").startswith("hydra")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=list(args.overrides), return_hydra_config=True)
        hc = cfg.hydra
        check_choices(hc)
        with open_dict(cfg):
            del cfg["hydra"]
        validated(cfg, hc)
    return f"opd-train: dry run (one run, no -m): {' '.join(overrides) or 'the defaults'}: ok; nothing trained, nothing written"


def compose_config(*overrides: str) -> TrainConfig:
    """The validated ``TrainConfig`` ``opd-train <overrides>`` would run, without running it: for
    scripts, benchmarks and notebooks (registered plugins included)."""
    from hydra import compose, initialize_config_dir

    from opd_exp.config import register_configs
    from opd_exp.config.deprecated import upgrade_overrides
    from opd_exp.config.folders import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_train_config(compose("train", overrides=upgrade_overrides(overrides)))
