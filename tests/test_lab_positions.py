"""The position lab sweeps (sweeps/sweep/lab_early_stop.yaml, lab_token_fraction.yaml): each
composes into the jobs its claim needs, on the chain world with the warmed-up student; the
early-stopped arms' training rollouts stop at positions.tokens while evaluation decodes to the
full length; and every job of both sweeps passes the dry launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_sweeps import compose_job

from opd_exp.training.positions import training_rollout_config

ROOT = Path(__file__).resolve().parents[1]
TOKENS = ["4", "8", "16", "56"]
ARMS = ["positions_all", "positions_first", "positions_last", "positions_iw_opd"]


def _params(name: str) -> dict[str, list[str]]:
    hc, _ = compose_job([f"sweep={name}"])
    return {k: str(v).split(",") for k, v in OmegaConf.to_container(hc.sweeper.params).items()}


def _shared_recipe(cfg) -> None:
    """What both sweeps share: the chain world, the 2000-step student, rkl on-policy at lr 1e-3."""
    assert (cfg.task.min_operands, cfg.task.max_operands, cfg.model_pair.name) == (4, 6, "embedded_chain")
    assert cfg.model_pair.embedded.student.sft_steps == 2000
    assert (cfg.divergence.name.value, cfg.estimator.name.value, cfg.rollout.on_policy_fraction) == ("rkl", "full", 1.0)
    assert (cfg.trainer.lr, cfg.trainer.max_steps, cfg.rollout.max_new_tokens) == (1e-3, 100, 56)
    assert (cfg.eval.every, cfg.eval.size, cfg.eval.samples, cfg.checkpoint.every, cfg.logger.name.value) == (25, 100, 0, 0, "none")


def test_early_stop_sweeps_the_rollout_length_and_evaluates_at_full_length():
    assert _params("lab_early_stop") == {"positions.tokens": TOKENS, "seed": ["0", "1", "2"]}
    for num, n in enumerate(TOKENS):
        hc, cfg = compose_job(["sweep=lab_early_stop", f"positions.tokens={n}", "seed=2"], job_num=num)
        assert (cfg.positions.name.value, cfg.positions.tokens) == ("first_n", int(n))
        assert (hc.sweep.dir, hc.sweep.subdir) == ("multirun/lab_early_stop/embedded_chain", f"{num}_tokens{n}_seed2")
        _shared_recipe(cfg)
        train = training_rollout_config(cfg)
        # the training rollouts stop after n tokens; 56 is the whole rollout (the config itself)
        assert train.rollout.max_new_tokens == min(int(n), 56) and (train is cfg) == (n == "56")
        assert cfg.rollout.max_new_tokens == 56  # evaluation reads cfg


def test_token_fraction_arms_include_iw_opd():
    assert _params("lab_token_fraction") == {"variant": ARMS, "seed": ["0", "1", "2"]}
    for num, arm in enumerate(ARMS):
        hc, cfg = compose_job(["sweep=lab_token_fraction", f"variant={arm}", "seed=0"], job_num=num)
        pos = cfg.positions
        assert (pos.name.value, pos.fraction, pos.gamma) == (arm.removeprefix("positions_"), 0.3, 0.5)
        assert (hc.sweep.dir, hc.sweep.subdir) == ("multirun/lab_token_fraction/embedded_chain", f"{num}_{arm}_seed0")
        _shared_recipe(cfg)
        assert training_rollout_config(cfg) is cfg  # no arm shortens the rollouts


@pytest.mark.parametrize(("sweep", "column"), [("lab_early_stop", "positions.tokens="), ("lab_token_fraction", "variant=")])
def test_every_job_passes_the_dry_launcher(sweep, column, tmp_path):
    cmd = [sys.executable, "-m", "opd_exp.cli.train", "-m", f"sweep={sweep}", "hydra/launcher=dry", f"hydra.sweep.dir={tmp_path / 's'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, WANDB_MODE="disabled"), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = [line for line in proc.stdout.splitlines() if line.startswith("opd-train: dry run: job #")]
    assert len(jobs) == 12 and all(line.endswith(": ok") for line in jobs), proc.stdout
    arms = TOKENS if sweep == "lab_early_stop" else ARMS
    assert [sum(f"{column}{a} " in line for line in jobs) for a in arms] == [3, 3, 3, 3]
    assert not (tmp_path / "s").exists()


def _lab_runs(root: Path, worlds=("embedded_chain",), sweep="lab_token_fraction") -> Path:
    """A position lab folder, one run per world: the series the tables read, the world in .hydra/."""
    import json

    import yaml

    folder = root / "multirun" / sweep
    for num, pair in enumerate(worlds):
        job = folder / f"{num}_positions_all_seed{num}"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["variant=positions_all", f"seed={num}"]))
        cfg = {"seed": num, "trainer": {"max_steps": 2}, "model_pair": {"name": pair}, "task": {"name": "arithmetic"}}
        (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
        (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {"sweep": sweep}}}}))
        rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "response/length_mean": 30.0, "perf/step_s": 1.0}]
        rows.append({"step": 2, "response/length_mean": 31.0, "perf/step_s": 1.0, "eval/accuracy": 0.6})
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.mark.parametrize(
    ("folder", "says"),
    [
        (lambda tmp: tmp / "nope", "no such folder: {tmp}/nope; "),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no metrics.jsonl under {tmp}/empty: "),
        (
            lambda tmp: _lab_runs(tmp, sweep="divergence"),
            "{tmp}/multirun/divergence/0_positions_all_seed0: a run of "
            "sweep=divergence (model_pair=embedded_chain, task=arithmetic), not of a position lab; ",
        ),
        (
            lambda tmp: _lab_runs(tmp, ("embedded_chain", "embedded")),
            "runs of two worlds pooled: {tmp}/multirun/lab_token_fraction/"
            "0_positions_all_seed0 (model_pair=embedded_chain, task=arithmetic) and ",
        ),
    ],
    ids=["missing", "empty", "another_sweep", "two_worlds"],
)
def test_the_table_script_answers_a_wrong_folder_in_one_line(tmp_path, folder, says):
    path = folder(tmp_path)
    script = str(ROOT / "benchmarks" / "lab_positions.py")
    proc = subprocess.run([sys.executable, script, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("lab_positions: " + says.format(tmp=tmp_path)), proc.stderr
    assert proc.stderr.rstrip().endswith(
        "allowed: folders of `opd-train -m sweep=lab_early_stop` or `sweep=lab_token_fraction` (one world)"
    )
    # the same runs of one world make a table
    ok = subprocess.run([sys.executable, script, str(_lab_runs(tmp_path / "ok"))], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.splitlines()[2].startswith("| variant=positions_all | 0 | 0.600 |"), ok.stdout + ok.stderr
