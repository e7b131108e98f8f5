"""conf/hydra/launcher/: each launcher config composes (when its Hydra plugin is installed)
and points at the plugin's launcher class."""

from __future__ import annotations

import importlib

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import opd_exp.cli.train as T

LAUNCHERS = {
    "local": ("hydra_plugins.hydra_joblib_launcher", "JoblibLauncher", {"n_jobs": 4, "backend": "loky"}),
    "slurm": ("hydra_plugins.hydra_submitit_launcher", "SlurmLauncher", {"gpus_per_node": 1, "max_num_timeout": 3}),
}


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_config_composes(name):
    module, cls, expected = LAUNCHERS[name]
    pytest.importorskip(module)
    with initialize_config_dir(config_dir=T.CONF_DIR, version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"hydra/launcher={name}",
                "sweep=divergence",
                "hydra.launcher.n_jobs=4" if name == "local" else "hydra.launcher.partition=gpu",
            ],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.rsplit(".", 1)[1] == cls
    mod, _, attr = launcher._target_.rpartition(".")
    assert hasattr(importlib.import_module(mod), attr)
    for key, value in expected.items():
        assert launcher[key] == value
    if name == "slurm":
        assert launcher.partition == "gpu"
        assert OmegaConf.to_container(launcher, resolve=False)["submitit_folder"] == "${hydra.sweep.dir}/.submitit/%j"
