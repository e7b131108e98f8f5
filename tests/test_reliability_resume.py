"""Exact resume and preemption through the real CLI (`python -m opd_exp.cli.train`) on a tiny local
pair: a run SIGKILLed at a random step, and a run preempted by SIGTERM then by SIGUSR1, each
started again on its folder, end with the same metrics.jsonl (timings aside) and bit-identical
weights as one uninterrupted run."""

from __future__ import annotations

import random
import signal
import time

import pytest
import torch

from helpers.reliability import BASE, comparable, final_weights, pair_args, popen, read_metrics, run_subprocess
from opd_exp.runtime.guards import EXIT_PREEMPTED

STEPS = 80
ARGS = BASE + [
    f"trainer.max_steps={STEPS}",
    "checkpoint.every=7",
    "eval.every=40",
    "checkpoint.keep=2",
    "trainer.schedule=cosine",
    "trainer.warmup_steps=5",
    "rollout.on_policy_fraction=0.8",
    "estimator=sampled",
    "loss=reinforce",
    "divergence=jsd",
]


def _logged_steps(run_dir) -> int:
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}"))
    except FileNotFoundError:
        return 0


def _signal_after(args, run_dir, sig, k: int, timeout: float = 240):
    """Start a run, send ``sig`` once ``k`` metric rows are written, wait for it to end."""
    proc = popen(args, run_dir)
    deadline = time.monotonic() + timeout
    while _logged_steps(run_dir) < k and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, f"run ended before it got the signal: {proc.communicate()[1][-2000:]}"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def reference(local_pair_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    res = run_subprocess(pair_args(local_pair_dir) + ARGS, run_dir)
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


def _assert_same_run(run_dir, reference):
    got, want = comparable(read_metrics(run_dir)), comparable(read_metrics(reference))
    assert [r["step"] for r in got] == list(range(STEPS + 1))
    assert got == want  # every metric of every step, exactly (JSON floats round-trip)
    a, b = final_weights(run_dir), final_weights(reference)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_rerun_equals_uninterrupted(local_pair_dir, reference, tmp_path):
    run_dir = tmp_path / "run"
    k = random.Random().randint(5, STEPS // 2)
    code, _, err = _signal_after(pair_args(local_pair_dir) + ARGS, run_dir, signal.SIGKILL, k)
    assert code == -signal.SIGKILL, err[-2000:]
    killed_at = _logged_steps(run_dir) - 1
    assert 0 < killed_at < STEPS, killed_at
    again = run_subprocess(pair_args(local_pair_dir) + ARGS, run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    _assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_sigterm_then_sigusr1_save_exit_75_and_the_resumed_run_equals_uninterrupted(local_pair_dir, reference, tmp_path):
    run_dir = tmp_path / "run"
    args = pair_args(local_pair_dir) + ARGS
    stopped = []
    for sig, k in ((signal.SIGTERM, 8), (signal.SIGUSR1, 40)):
        code, out, err = _signal_after(args, run_dir, sig, k)
        assert code == EXIT_PREEMPTED, err[-3000:]
        skip = ("opd-train: resuming from step ", "opd-train: eval at step ", "opd-train: warning: ")  # lines of their own
        lines = [ln for ln in err.splitlines() if ln.startswith("opd-train:") and not ln.startswith(skip)]
        assert ("opd-train: resuming from step " in err) == bool(stopped)
        assert not stopped or f"opd-train: resuming from step {stopped[-1]} (checkpoint " in err
        assert len(lines) == 1 and lines[0].startswith(f"opd-train: preempted: {sig.name} received: checkpoint at step "), err[-2000:]
        assert "Traceback" not in err and not out.strip()  # no summary line: the run is not finished
        step = int(lines[0].split("checkpoint at step ")[1].split()[0])
        # the checkpoint is at the step boundary the signal reached: the last row logged
        assert read_metrics(run_dir)[-1]["step"] == step and (run_dir / "checkpoints" / f"step_{step:06d}").is_dir()
        stopped.append(step)
    assert 0 < stopped[0] < stopped[1] < STEPS
    done = run_subprocess(args, run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("opd-train: student eval accuracy")
    _assert_same_run(run_dir, reference)
