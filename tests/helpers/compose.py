"""The real config composed as `opd-train` would (conf/ and sweeps/), validated, without a run."""

from __future__ import annotations


def compose_config(*overrides: str):
    """A validated TrainConfig of ``opd-train OVERRIDES`` (logger=none unless overridden)."""
    from hydra import compose, initialize_config_dir

    import opd_exp.cli.train  # noqa: F401  (sweeps/ on the search path)
    from opd_exp.cli.compose import to_train_config
    from opd_exp.config.folders import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_train_config(compose("train", overrides=["logger=none", *overrides]))
