"""The tool-use lab (sweeps/sweep/lab_tool_masks.yaml): its three arms compose on the tool world with
the same episodes, steps and rollouts per step and differ only in what they train (the environment's
tokens masked or trained; reward-only RL); every job passes the dry launcher; the table script
(benchmarks/lab_tool_masks.py) prints the numbers of fake run folders and answers a wrong folder in
one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_sweeps import compose_job

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "lab_tool_masks.py"
ARMS = ["tool_masked", "tool_env_trained", "tool_reward_only"]
# arm -> (rollout.env_tokens, estimator, loss, loss.kl_coef, reward.coef, batch_size, n_samples, lr)
RECIPES = {
    "tool_masked": ("masked", "full", "direct", 1.0, 0.0, 64, 1, 3e-3),
    "tool_env_trained": ("trained", "full", "direct", 1.0, 0.0, 64, 1, 3e-3),
    "tool_reward_only": ("masked", "sampled", "reinforce", 0.0, 1.0, 16, 4, 1e-4),
}


def test_the_sweep_composes_three_arms_by_three_seeds_at_equal_rollouts():
    hc, _ = compose_job(["sweep=lab_tool_masks"])
    params = {k: str(v).split(",") for k, v in OmegaConf.to_container(hc.sweeper.params).items()}
    assert params == {"variant": ARMS, "seed": ["0", "1", "2"]}
    for num, arm in enumerate(ARMS):
        hc, cfg = compose_job(["sweep=lab_tool_masks", f"variant={arm}", "seed=1"], job_num=num)
        assert (hc.sweep.dir, hc.sweep.subdir) == ("multirun/lab_tool_masks/embedded_tool", f"{num}_{arm}_seed1")
        assert (cfg.task.name, cfg.model_pair.name) == ("calc_tool", "embedded_tool")
        ro, tr = cfg.rollout, cfg.trainer
        assert (ro.max_turns, ro.max_new_tokens, ro.max_episode_tokens, tr.max_steps) == (4, 24, 64, 250)
        got = (ro.env_tokens.value, cfg.estimator.name.value, cfg.loss.name.value, cfg.loss.kl_coef, cfg.reward.coef)
        assert got + (tr.batch_size, ro.n_samples, tr.lr) == RECIPES[arm]
        assert tr.batch_size * ro.n_samples == 64  # the same episodes per step in every arm
        assert (cfg.divergence.name.value, cfg.eval.every, cfg.eval.size, cfg.checkpoint.every) == ("fkl", 50, 100, 0)


def test_every_job_of_the_sweep_passes_the_dry_launcher(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "opd_exp.cli.train",
        "-m",
        "sweep=lab_tool_masks",
        "hydra/launcher=dry",
        f"hydra.sweep.dir={tmp_path / 's'}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, WANDB_MODE="disabled"), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = [line for line in proc.stdout.splitlines() if line.startswith("opd-train: dry run: job #")]
    assert len(jobs) == 9 and all(line.endswith(": ok") for line in jobs), proc.stdout
    assert [sum(f"variant={arm} " in line for line in jobs) for arm in ARMS] == [3, 3, 3]


def _runs(root: Path, arms=ARMS, *, tools: bool = True, steps: int = 4) -> Path:
    """A lab_tool_masks folder: per arm seeds 0 and 1, evals at 0 and ``steps``, the train rate per step."""
    import yaml

    folder = root / "multirun" / "lab_tool_masks" / "embedded_tool"
    num = 0
    for a, arm in enumerate(arms):
        for seed in (0, 1):
            job = folder / f"{num}_{arm}_seed{seed}"
            num += 1
            (job / ".hydra").mkdir(parents=True)
            (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"variant={arm}", f"seed={seed}"]))
            cfg = {"seed": seed, "trainer": {"max_steps": steps}, "model_pair": {"name": "embedded_tool"}, "task": {"name": "calc_tool"}}
            (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
            choices = {"sweep": "lab_tool_masks", "model_pair": "embedded_tool", "variant": arm}
            (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))
            rows = [{"step": 0, "eval/accuracy": 0.6}]
            for s in range(1, steps + 1):  # train rate: 0.1 * s * (a + 1) + seed / 100
                rows.append({"step": s, "loss": 1.0, **({"tools/self_result_rate": 0.1 * s * (a + 1) + seed / 100} if tools else {})})
            final = {"eval/accuracy": 0.5 + 0.1 * a + 0.02 * seed}
            if tools:
                final |= {"eval/tools/result_used_rate": 0.9 - 0.1 * a, "eval/tools/self_result_rate": 0.05 * a + 0.01 * seed}
            rows[-1] |= final
            (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_table_script_prints_each_arms_mean_over_seeds(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(_runs(tmp_path))], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "final eval (step 4; greedy episodes), mean ± 95% CI over seeds"
    rows = {line.split(" | ")[0].lstrip("| "): [c.strip() for c in line.strip("| ").split(" | ")] for line in lines[4:]}
    assert list(rows) == ARMS
    # tool_env_trained (a = 1): accuracy 0.6 and 0.62, result used 0.8, self results 0.05 and 0.06,
    # the train rate's last quarter of 4 steps (step 4): 0.8 and 0.81
    env = rows["tool_env_trained"]
    assert env[1] == "0,1" and [c.split(" ")[0] for c in env[2:]] == ["0.610", "0.800", "0.055", "0.805"], env
    assert [c.split(" ")[0] for c in rows["tool_masked"][2:]] == ["0.510", "0.900", "0.005", "0.405"]


@pytest.mark.parametrize(
    ("folder", "says"),
    [
        (lambda tmp: tmp / "nope", "no such folder: {tmp}/nope; "),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no metrics.jsonl under {tmp}/empty: "),
        (
            lambda tmp: _runs(tmp, ["tool_masked"], tools=False),
            "{tmp}/multirun/lab_tool_masks/embedded_tool/0_tool_masked_seed0: logs no eval/tools/result_used_rate "
            "(sweep=lab_tool_masks, model_pair=embedded_tool): not a run of the tool world; ",
        ),
    ],
    ids=["missing", "empty", "no_tool_metrics"],
)
def test_the_table_script_answers_a_wrong_folder_in_one_line(tmp_path, folder, says):
    path = folder(tmp_path)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("lab_tool_masks: " + says.format(tmp=tmp_path)), proc.stderr
    assert proc.stderr.rstrip().endswith("allowed: folders of `opd-train -m sweep=lab_tool_masks` (multirun/lab_tool_masks/embedded_tool)")
