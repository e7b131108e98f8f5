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


def _dry(tmp_path, *extra):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "opd_exp.cli.train", "-m", "sweep=jsd_beta", "hydra/launcher=dry", f"hydra.sweep.dir={tmp_path / 'sweep'}", *extra]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"}, timeout=300)


def test_dry_launcher_validates_every_job_and_writes_nothing(tmp_path):
    ok = _dry(tmp_path)
    jobs = [line for line in ok.stdout.splitlines() if line.startswith("opd-train: dry run: job #")]
    assert ok.returncode == 0 and jobs and all(line.endswith(": ok") for line in jobs), ok.stdout + ok.stderr
    assert "divergence.beta=" in jobs[0] or "variant=" in jobs[0]  # each line names the job's overrides
    bad = _dry(tmp_path, "trainer.lr=-1")
    lines = [line for line in bad.stdout.splitlines() if line.startswith("opd-train: dry run: job #")]
    assert bad.returncode == 2 and len(lines) == len(jobs)
    assert all(": error: trainer.lr=-1" in line for line in lines), bad.stdout
    assert bad.stderr.strip().splitlines()[-1].startswith(f"opd-train: error: {len(jobs)} of {len(jobs)} jobs of the multirun failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no sweep folder, no multirun.yaml
