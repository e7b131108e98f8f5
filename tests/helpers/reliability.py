"""Shared by the reliability tests: a tiny local pair on disk, the `opd-train` arguments that
train it in a few seconds, and two ways to run the CLI (in this process, or as a real
subprocess that can be signalled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.tiny import build_model


def make_local_pair(root: Path) -> Path:
    """Student and teacher folders sharing the embedded byte-level tokenizer (259 tokens)."""
    from opd_exp.pairs.embedded.tokenizer import load_tokenizer, save_tokenizer

    for name in ("student", "teacher"):
        save_tokenizer(root / name)
    V = len(load_tokenizer(root / "student"))
    build_model(root / "student", V, hidden=32, layers=1, seed=1)
    build_model(root / "teacher", V, hidden=32, layers=2, seed=2)
    return root


def pair_args(pair: Path, student: Path | str | None = None, teacher: Path | str | None = None) -> list[str]:
    return ["model_pair=local", f"model_pair.student={student or pair / 'student'}", f"model_pair.teacher={teacher or pair / 'teacher'}"]


# Small and deterministic on CPU: one thread, fp32, no W&B, no progress bar.
BASE = [
    "task=arithmetic",
    "task.n_train=64",
    "task.n_eval=4",
    "trainer.batch_size=2",
    "eval.size=4",
    "eval.batch_size=4",
    "eval.every=0",
    "scale.device=cpu",
    "scale.num_threads=1",
    "trainer.progress=false",
    "trainer.warmup_steps=0",
    "trainer.lr=1e-2",
    "rollout.max_new_tokens=6",
    "logger=none",
]


def run_cli(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """`opd-train ARGS` via opd_exp.cli.train.main in this process: (exit code, stdout, stderr)."""
    from opd_exp.cli.train import main

    monkeypatch.setattr(sys, "argv", ["opd-train", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as ex:
        code = ex.code if isinstance(ex.code, int) else (0 if ex.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


def run_in_process(args: list[str], run_dir: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """`opd-train ARGS hydra.run.dir=RUN` in this process (see ``run_cli``)."""
    return run_cli([*args, f"hydra.run.dir={run_dir}"], monkeypatch, capsys)


def popen(args: list[str], run_dir: Path, **kw) -> subprocess.Popen:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.Popen(
        [sys.executable, "-m", "opd_exp.cli.train", *args, f"hydra.run.dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


def run_subprocess(args: list[str], run_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = popen(args, run_dir)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def comparable(rows: list[dict]) -> list[dict]:
    """Metric rows without wall-clock timings (perf/*), which no two runs share."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    from opd_exp.runtime import checkpoint

    path = checkpoint.latest(run_dir)
    assert path is not None, f"no checkpoint in {run_dir}"
    return load_file(str(path / "model.safetensors"))


def one_error_line(stderr: str) -> str:
    """The stderr of a failed run must be exactly one `opd-train: error: ...` line."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [ln for ln in lines if ln.startswith("opd-train: error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]
