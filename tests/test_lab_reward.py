"""The reward-vs-distillation lab (sweeps/sweep/lab_reward_vs_opd.yaml and its imperfect-teacher
half lab_reward_vs_opd_weak.yaml): every arm composes with the same number of steps and of
sampled rollouts per step and differs only in its advantage (and lr); the two pairs share one
student and differ only in the teacher's SFT length; every job passes the dry launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_sweeps import compose_job

from opd_exp.config.reward import RewardBaseline
from opd_exp.config.world import as_pair_config, as_task_config
from opd_exp.pairs.embedded.prepare import model_key

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = {"lab_reward_vs_opd": ["reward_only", "opd", "opd_reward"], "lab_reward_vs_opd_weak": ["opd", "opd_reward"]}
PAIRS = {"lab_reward_vs_opd": "embedded_warm", "lab_reward_vs_opd_weak": "embedded_warm_weak"}
# arm -> (estimator, loss, loss.kl_coef, reward.coef, reward.baseline, batch_size, n_samples, lr)
ARMS = {
    "reward_only": ("sampled", "reinforce", 0.0, 1.0, RewardBaseline.loo, 16, 4, 1e-4),
    "opd": ("full", "direct", 1.0, 0.0, RewardBaseline.loo, 64, 1, 1e-3),
    "opd_reward": ("full", "direct", 1.0, 1.0, RewardBaseline.none, 64, 1, 1e-3),
}


def _params(sweep: str) -> dict[str, list[str]]:
    hc, _ = compose_job([f"sweep={sweep}"])
    return {k: str(v).split(",") for k, v in OmegaConf.to_container(hc.sweeper.params).items()}


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_the_sweep_composes_its_arms_by_three_seeds(sweep):
    assert _params(sweep) == {"variant": SWEEPS[sweep], "seed": ["0", "1", "2"]}
    for num, arm in enumerate(SWEEPS[sweep]):
        hc, cfg = compose_job([f"sweep={sweep}", f"variant={arm}", "seed=1"], job_num=num)
        assert (hc.sweep.dir, hc.sweep.subdir) == (f"multirun/{sweep}/{PAIRS[sweep]}", f"{num}_{arm}_seed1")
        got = (
            cfg.estimator.name.value,
            cfg.loss.name.value,
            cfg.loss.kl_coef,
            cfg.reward.coef,
            cfg.reward.baseline,
            cfg.trainer.batch_size,
            cfg.rollout.n_samples,
            cfg.trainer.lr,
        )
        assert got == ARMS[arm]
        # equal steps, equal sampled rollouts per step, the same schedule and the default divergence
        assert cfg.trainer.batch_size * cfg.rollout.n_samples == 64
        assert (cfg.trainer.max_steps, cfg.trainer.schedule.value, cfg.trainer.warmup_steps) == (600, "constant", 20)
        assert (cfg.divergence.name.value, cfg.reward.std_normalize, cfg.rollout.on_policy_fraction) == ("fkl", False, 1.0)
        assert (cfg.task.name, cfg.model_pair.name, cfg.model_pair.for_task) == ("arithmetic", PAIRS[sweep], "arithmetic")
        assert (cfg.eval.every, cfg.eval.size, cfg.checkpoint.every, cfg.logger.name.value) == (50, 200, 0, "none")
    assert (cfg.estimator.name.value, cfg.reward.coef) == ("full", 1.0)  # the last arm of each sweep is opd + reward


def test_the_pairs_share_one_student_and_differ_in_the_teacher_s_sft_length():
    pairs = {name: as_pair_config(OmegaConf.load(ROOT / "conf" / "model_pair" / f"{name}.yaml")) for name in PAIRS.values()}
    default = as_pair_config(OmegaConf.load(ROOT / "conf" / "model_pair" / "embedded.yaml")).embedded
    warm, weak = pairs["embedded_warm"].embedded, pairs["embedded_warm_weak"].embedded
    assert (default.student.sft_steps, warm.student.sft_steps, weak.student.sft_steps) == (800, 1600, 1600)
    assert (default.teacher.sft_steps, warm.teacher.sft_steps, weak.teacher.sft_steps) == (4000, 4000, 1500)
    task = as_task_config(OmegaConf.load(ROOT / "conf" / "task" / "arithmetic.yaml"))
    # one cache entry per model: the warm pair's teacher is the default world's, the student is shared
    assert model_key("teacher", warm, task) == model_key("teacher", default, task)
    assert model_key("student", warm, task) == model_key("student", weak, task) != model_key("student", default, task)
    assert model_key("teacher", weak, task) != model_key("teacher", warm, task)


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_every_job_passes_the_dry_launcher(sweep):
    cmd = [sys.executable, "-m", "opd_exp.cli.train", "-m", f"sweep={sweep}", "hydra/launcher=dry"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, WANDB_MODE="disabled"), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = [line for line in proc.stdout.splitlines() if line.startswith("opd-train: dry run: job #")]
    assert len(jobs) == 3 * len(SWEEPS[sweep]) and all(line.endswith(": ok") for line in jobs), proc.stdout
    assert [sum(f"variant={arm} " in line for line in jobs) for arm in SWEEPS[sweep]] == [3] * len(SWEEPS[sweep])
