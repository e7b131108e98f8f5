"""conf/hydra/launcher/: each launcher config composes (when its Hydra plugin is installed)
and points at the plugin's launcher class."""

from __future__ import annotations

import importlib

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import opd_exp.cli.train as T

LAUNCHERS = {
    "local": ("hydra_plugins.opd_exp_launchers.local_launcher", "LocalLauncher", {"n_jobs": 4}),
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

    cmd = [
        sys.executable,
        "-m",
        "opd_exp.cli.train",
        "-m",
        "sweep=jsd_beta",
        "hydra/launcher=dry",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        *extra,
    ]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "offline"}, timeout=300)


@pytest.mark.slow  # a whole opd-train process end to end
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


@pytest.mark.slow  # a whole opd-train process end to end
def test_local_launcher_a_killed_job_fails_alone_with_one_line(tmp_path):
    """SIGKILL to one job's process (what the OOM killer does): one line names the job, the other jobs finish."""
    import os
    import signal
    import subprocess
    import sys
    import time

    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "offline", "OPD_EXP_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    args = ["divergence=rkl,fkl,jsd", "trainer.max_steps=2", "eval.size=2", "trainer.progress=false", "logger=none"]
    cmd = [
        sys.executable,
        "-m",
        "opd_exp.cli.train",
        "-m",
        "hydra/launcher=local",
        "hydra.launcher.n_jobs=2",
        *args,
        f"hydra.sweep.dir={sweep}",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = sweep / "1" / ".opd-train.pid"
    deadline = time.monotonic() + 300
    while not (pid_file.is_file() and pid_file.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)  # job #1, as it starts
    _, err = proc.communicate(timeout=600)
    assert "Traceback" not in err and "TerminatedWorkerError" not in err, err[-3000:]
    line = (
        f"opd-train: error: job #1 ({sweep / '1'}): its process was killed by SIGKILL (the OOM killer sends it when memory "
        "runs out); run the same multirun again to resume it"
    )
    assert line in err.splitlines()
    assert err.strip().splitlines()[-1].startswith(f"opd-train: error: 1 of 3 jobs of the multirun failed: #1 ({sweep / '1'}): its process")
    assert proc.returncode == 128 + signal.SIGKILL
    assert (sweep / "0" / "summary.json").is_file() and (sweep / "2" / "summary.json").is_file()  # the others finished
    assert not (sweep / "1" / "summary.json").exists()
