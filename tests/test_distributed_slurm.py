"""SLURM requeue (hydra/launcher=slurm, hydra-submitit-launcher): submitit requeues a timed-out
or preempted job by pickling ``launcher.checkpoint(*same args)`` (a DelayedSubmission of the
launcher itself) and calling it again in the new allocation. The job folder is
``hydra.sweep.dir/hydra.sweep.subdir`` computed from that pickled config: these tests check it
is the same folder after the round trip (sweeps/ set fixed folders; the default
``multirun/${now:...}`` is resolved once at launch and its cached value travels in the
pickle), so the requeued job finds its checkpoints and resumes (exit 75 -> resume is tested in
tests/test_reliability_*.py). Also: submitit's multi-task SLURM environment -> torch's."""

from __future__ import annotations

import pickle
import time

import pytest
from hydra import compose, initialize_config_dir

import opd_exp.cli.train as T

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


def _launcher(overrides):
    from hydra.core.utils import setup_globals
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
    from omegaconf import OmegaConf

    setup_globals()  # Hydra's ${now:} resolver (cached, as in a real launch)
    with initialize_config_dir(config_dir=T.CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", *overrides], return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    params.pop("_target_")
    launcher = SlurmLauncher(**params)
    launcher.setup(hydra_context=None, task_function=T._app, config=cfg)
    return launcher, cfg


@pytest.mark.parametrize("overrides", [["sweep=divergence"], []], ids=["sweep-file", "default-timestamp"])
def test_requeued_job_gets_the_same_folder(overrides):
    launcher, cfg = _launcher(overrides)
    before = str(launcher.config.hydra.sweep.dir)  # what launch() logs and creates
    args = (["divergence=jsd"], "hydra.sweep.dir", 3, "job_id_for_3", {})
    requeue = launcher.checkpoint(*args)  # what submitit calls on SIGUSR2 / timeout
    time.sleep(1.1)  # a new allocation, seconds later: ${now:...} must not move
    again = pickle.loads(pickle.dumps(requeue))
    assert again.args == args  # the same job number and overrides -> the same subdir
    assert str(again.function.config.hydra.sweep.dir) == before
    if overrides:
        assert "${now" not in str(cfg.hydra.sweep._get_node("dir")._value())


def test_submitit_multitask_env_becomes_torch_env(monkeypatch):
    from opd_exp.runtime import distributed as D

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "x")  # recorded, so what the export sets is removed afterwards
        monkeypatch.delenv(k)
    env = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_ID": "123",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_NTASKS_PER_NODE": "2",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        got = D.torchrun_env()
    except Exception as ex:
        pytest.skip(f"submitit's TorchDistributedEnvironment needs more of SLURM here: {ex}")
    assert got == {"RANK": 2, "WORLD_SIZE": 4, "LOCAL_RANK": 0}
