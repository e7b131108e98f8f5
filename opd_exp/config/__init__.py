"""Typed configuration of opd-exp runs (dataclasses in Hydra's ConfigStore)."""

from __future__ import annotations

from .schema import (
    Credit,
    DivergenceConfig,
    DivergenceName,
    EstimatorConfig,
    EstimatorName,
    LoggerConfig,
    LoggerName,
    LossConfig,
    LossName,
    Precision,
    RolloutConfig,
    Schedule,
    TrainConfig,
    TrainerConfig,
    validate,
)

_REGISTERED = False


def register_configs() -> None:
    """Store the run schema as ``train_schema``; conf/train.yaml extends it, so every group
    file is merged into a typed node (unknown keys, wrong types and bad enum names fail)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    _REGISTERED = True


__all__ = [
    "Credit",
    "DivergenceConfig",
    "DivergenceName",
    "EstimatorConfig",
    "EstimatorName",
    "LoggerConfig",
    "LoggerName",
    "LossConfig",
    "LossName",
    "Precision",
    "RolloutConfig",
    "Schedule",
    "TrainConfig",
    "TrainerConfig",
    "register_configs",
    "validate",
]
