"""`opd-train` end to end through Hydra on a tiny local pair: metrics.jsonl in the run folder,
the summary line, and a second run on the same folder resuming instead of starting over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.reliability import make_local_pair


@pytest.fixture(scope="module")
def local_pair(tmp_path_factory) -> Path:
    return make_local_pair(tmp_path_factory.mktemp("local_pair"))


def _run(args, run_dir):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    return subprocess.run(
        [sys.executable, "-m", "opd_exp.cli.train", *args, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
def test_opd_train_cli_runs_and_resumes(local_pair, tmp_path):
    args = [
        "model_pair=local",
        f"model_pair.student={local_pair / 'student'}",
        f"model_pair.teacher={local_pair / 'teacher'}",
        "task=arithmetic",
        "task.n_train=64",
        "task.n_eval=8",
        "divergence=jsd",
        "divergence.beta=0.9",
        "trainer.max_steps=3",
        "trainer.batch_size=4",
        "eval.every=2",
        "checkpoint.every=2",
        "scale.device=cpu",
        "scale.num_threads=1",
        "trainer.progress=false",
        "rollout.max_new_tokens=6",
        "logger=none",
    ]
    run_dir = tmp_path / "run"
    first = _run(args, run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.strip().splitlines()[-1].startswith("opd-train: student eval accuracy")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all("jsd/mean" in r for r in rows[1:]) and "eval/kl_reverse" in rows[-1]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "summary.json").is_file()
    assert Path.cwd() != run_dir  # never chdir
    again = _run(args, run_dir)  # same folder: resumes from step 3 (done), no new steps
    assert again.returncode == 0, again.stderr[-3000:]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 4
