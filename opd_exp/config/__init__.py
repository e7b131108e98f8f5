"""Typed configuration of opd-exp runs (dataclasses in Hydra's ConfigStore)."""

from __future__ import annotations

from .schema import (
    CheckpointConfig,
    Credit,
    DivergenceConfig,
    DivergenceName,
    EstimatorConfig,
    EstimatorName,
    EvalConfig,
    LoggerConfig,
    LoggerName,
    LossConfig,
    LossName,
    Precision,
    RolloutConfig,
    ScaleConfig,
    Schedule,
    TrainConfig,
    TrainerConfig,
    validate,
)

_REGISTERED = False


def register_configs() -> None:
    """Load the user's plugins (``opd_exp.config.plugins``), then store the run schema as
    ``train_schema``; conf/train.yaml extends it, so every group file is merged into a typed
    node (unknown keys, wrong types and bad enum names fail)."""
    global _REGISTERED
    from opd_exp.config.plugins import load_plugins

    load_plugins()  # OPD_PLUGINS and entry points: their divergences and tasks are valid choices
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("opd_pid", launcher_pid, use_cache=True, replace=True)

    store_divergence_options(ConfigStore.instance())
    if _REGISTERED:
        return
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    _REGISTERED = True


def launcher_pid() -> int:
    """``${opd_pid:}`` in conf/train.yaml's default run folder: this process's id, so two runs
    started in the same second never share a folder; under torchrun (LOCAL_RANK set) the id of
    the torchrun agent, the parent every local rank shares, so the ranks agree."""
    import os

    return os.getppid() if "LOCAL_RANK" in os.environ else os.getpid()


def store_divergence_options(store) -> None:
    """``divergence=<name>`` for every registered divergence without a conf/divergence/ file
    (a registered one needs no YAML; Hydra lists it among the options)."""
    from opd_exp.config.folders import CONF_DIR
    from opd_exp.divergences import DIVERGENCES

    conf = CONF_DIR / "divergence"
    for name in DIVERGENCES:
        if not (conf / f"{name}.yaml").exists():
            store.store(group="divergence", name=name, node={"name": name})


__all__ = [
    "CheckpointConfig",
    "Credit",
    "DivergenceConfig",
    "DivergenceName",
    "EstimatorConfig",
    "EstimatorName",
    "EvalConfig",
    "LoggerConfig",
    "LoggerName",
    "LossConfig",
    "LossName",
    "Precision",
    "RolloutConfig",
    "ScaleConfig",
    "Schedule",
    "TrainConfig",
    "TrainerConfig",
    "register_configs",
    "validate",
]
