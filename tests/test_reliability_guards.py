"""Non-finite guards, empty batches, checkpoint integrity and the run-folder lock, on the tiny
in-memory pair (no subprocess): each promise of docs/reliability.md checked with numbers."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

import opd_exp.training.rollout as rollout_mod
import opd_exp.training.sampler as sampler_mod
import opd_exp.training.scoring as scoring_mod
from helpers.reliability import read_metrics
from helpers.tiny import AddTask, small_config
from opd_exp.runtime import checkpoint
from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.guards import Diverged
from opd_exp.sinks import JsonlSink
from opd_exp.training.trainer import Trainer


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _digest(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def _nan_teacher_from(step_from: int, monkeypatch, trainer_ref: list):
    """Teacher logits become NaN from training step ``step_from`` on (a test-only fault)."""
    real = scoring_mod.teacher_logits

    def faulty(*args, **kw):
        z = real(*args, **kw)
        t = trainer_ref[0]
        if t.student.training and t.step + 1 >= step_from:  # training steps only, not eval
            z = z.clone()
            z[0, 0, 3] = float("nan")
        return z

    monkeypatch.setattr(scoring_mod, "teacher_logits", faulty)


def test_nan_loss_skips_the_step_and_counts_it(tiny_pair, tmp_path, monkeypatch):
    cfg = small_config(trainer={"max_steps": 4, "max_bad_steps": 3})
    t = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    real = t.objective.__class__.__call__
    snapshots = {}

    def poisoned(self, *a, **kw):
        out = real(self, *a, **kw)
        if t.step + 1 == 2:  # step 2's loss is NaN
            snapshots["before"] = _params(t.student)
            snapshots["adam"] = {k: v["step"].clone() for k, v in t.optimizer.state.items()}
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(type(t.objective), "__call__", poisoned)
    lines = []
    t.warn = lines.append
    t.run()
    rows = read_metrics(tmp_path)
    assert [r["guard/skipped_steps"] for r in rows[1:]] == [0, 1, 1, 1]
    assert [r["grad/skipped"] for r in rows[1:]] == [0, 1, 0, 0]
    assert rows[2]["loss"] is None  # NaN is written as null, the other steps are finite
    assert all(math.isfinite(r["loss"]) for r in rows[1:] if r["step"] != 2)
    assert any("step 2 skipped (no update): loss=nan" in ln for ln in lines)
    # AdamW stepped once before step 2 and three times in all: step 2 made no update
    assert snapshots["adam"] and all(int(v) == 1 for v in snapshots["adam"].values())
    assert all(int(v["step"]) == 3 for v in t.optimizer.state.values())


def test_nan_teacher_is_caught_before_the_loss_and_stops_the_run(tiny_pair, tmp_path, monkeypatch):
    cfg = small_config(trainer={"max_steps": 10, "save_every": 2, "max_bad_steps": 3, "keep_checkpoints": 1})
    t = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    ref = [t]
    _nan_teacher_from(4, monkeypatch, ref)
    seen = []
    real_call = type(t.objective).__call__

    def spy(self, student_z, teacher, *a, **kw):
        z = teacher.logits if hasattr(teacher, "logits") else teacher  # TeacherScores (dense here) or logits
        seen.append(bool(torch.isfinite(z).all()))
        return real_call(self, student_z, teacher, *a, **kw)

    monkeypatch.setattr(type(t.objective), "__call__", spy)
    lines = []
    t.warn = lines.append
    with pytest.raises(Diverged) as err:
        t.run()
    assert seen and all(seen)  # the objective ran and never saw a NaN teacher logit
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        "3 non-finite steps in a row (steps 4-6; last: teacher log-probs are not finite at step 6 (1 NaN of "
    )
    assert "last checkpoint intact: " in msg and msg.rstrip().endswith("trainer.max_bad_steps=3")
    assert any(ln.startswith("opd-train: warning: step 4 skipped (no update): teacher log-probs are not finite at step 4") for ln in lines)
    # the last good checkpoint (step 2; step 4's periodic save fell inside the bad run) is intact and loads
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2]
    assert checkpoint.latest(tmp_path).name in msg
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(7)) and rows[-1]["guard/skipped_steps"] == 3


def test_a_batch_without_response_tokens_is_a_counted_no_op(tiny_pair, tmp_path, monkeypatch):
    for mod, name in ((rollout_mod, "generate"), (sampler_mod, "lean_generate")):  # either engine

        def no_tokens(*a, real=getattr(mod, name), **kw):
            b = real(*a, **kw)
            if kw.get("do_sample", True):  # training rollouts only
                b.response_mask = torch.zeros_like(b.response_mask)
            return b

        monkeypatch.setattr(mod, name, no_tokens)
    t = Trainer(small_config(trainer={"max_steps": 2}), tmp_path, pair=tiny_pair, task=AddTask())
    before = _params(t.student)
    t.run()
    rows = read_metrics(tmp_path)[1:]
    assert [r["guard/empty_steps"] for r in rows] == [1, 2] and [r["guard/skipped_steps"] for r in rows] == [0, 0]
    for r in rows:
        assert r["loss"] == 0.0 and r["response/length_mean"] == 0.0
        assert all(v is not None and (not isinstance(v, float) or math.isfinite(v)) for v in r.values()), r
    for a, b in zip(before, t.student.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_crash_while_writing_a_checkpoint_leaves_none_that_resume_accepts(tiny_pair, tmp_path, monkeypatch):
    cfg = small_config(trainer={"max_steps": 4, "save_every": 2, "keep_checkpoints": 1})
    t = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    real_save = torch.save
    calls = []

    def dies_at_step_4(obj, f, *a, **kw):  # dies after writing the weights and the optimizer
        calls.append(str(f))
        if "step_000004" in str(f) and str(f).endswith("rng.pt"):
            raise KeyboardInterrupt("killed mid-write")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(checkpoint.torch, "save", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        t.run()
    root = checkpoint.checkpoint_root(tmp_path)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2]  # the old one is not pruned
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # the partial write is removed
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    t2 = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    assert t2.resume() and t2.step == 2
    t2.run()
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [4]
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())


def test_truncated_or_damaged_checkpoints_are_never_loaded(tiny_pair, tmp_path):
    cfg = small_config(trainer={"max_steps": 4, "save_every": 2, "keep_checkpoints": 2})
    Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask()).run()
    newest = checkpoint.latest(tmp_path)
    weights = newest / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a copy cut short
    assert checkpoint.latest(tmp_path).name == "step_000002"  # manifest size check
    weights.write_bytes(b"\xff" * len(data))  # same size, unreadable header
    assert checkpoint.latest(tmp_path) == newest
    t = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    lines = []
    t.warn = lines.append
    assert t.resume() and t.step == 2  # fell back to the older one...
    assert lines and lines[0].startswith(f"opd-train: warning: checkpoint {newest} cannot be loaded")
    assert (newest.parent / "step_000004.bad").is_dir() and not newest.exists()  # ...and set the bad one aside


def test_no_loadable_checkpoint_is_one_line_and_keeps_the_metrics(tiny_pair, tmp_path):
    cfg = small_config(trainer={"max_steps": 2, "save_every": 2, "keep_checkpoints": 1})
    Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask()).run()
    state = checkpoint.latest(tmp_path) / "state.json"
    state.write_text("{" + "x" * (state.stat().st_size - 1))  # same size: only loading finds out
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    for _attempt in range(2):  # first: the load fails (set aside as .bad); then: only a .bad is left
        t = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
        t.warn = lambda line: None
        with pytest.raises(ConfigError) as err:
            t.run()
        assert "\n" not in str(err.value) and str(err.value).startswith("hydra.run.dir: no checkpoint in ")
        assert str(err.value).endswith("move checkpoints/ away to start the run over")
        assert (tmp_path / "metrics.jsonl").read_bytes() == metrics  # never started over on top of the history


def test_a_second_process_on_the_same_run_folder_is_refused(tiny_pair, tmp_path):
    t = Trainer(small_config(), tmp_path, pair=tiny_pair, task=AddTask())
    import fcntl

    (tmp_path / checkpoint.OWNER).write_text("4242\n")  # the owner's record
    with open(tmp_path / checkpoint.LOCK, "w") as other:  # as another process holding the lock
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConfigError, match=r"is in use by another opd-train process \(pid 4242\)"):
            t.run()
    assert not (tmp_path / "metrics.jsonl").exists()
    t.run()  # released: runs


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a"')  # killed mid-write
    JsonlSink(path, resume_step=1).close()
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [0, 1]


def test_resave_of_an_existing_step_keeps_the_complete_checkpoint(tiny_pair, tmp_path, monkeypatch):
    t = Trainer(small_config(trainer={"max_steps": 1, "keep_checkpoints": 1}), tmp_path, pair=tiny_pair, task=AddTask())
    t.run()
    path = checkpoint.latest(tmp_path)
    before = _digest(path)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *a, **k: pytest.fail("removed a complete checkpoint"))
    assert t.save() == path and _digest(path) == before


def test_preemption_under_submitit_saves_then_hands_over_to_its_handler(local_pair_dir, tmp_path, monkeypatch, capsys):
    """submitit installs its own SIGUSR2 handler (checkpoint + requeue + exit) before the job
    runs; opd-train defers it to the step boundary, saves, then calls it."""
    import os
    import signal

    from helpers.reliability import BASE, pair_args, run_in_process

    calls = []

    def submitit_like(signum, frame):
        calls.append((signum, [s for s, _ in checkpoint.list_checkpoints(tmp_path / "run")]))
        raise SystemExit(-1)  # what submitit does after requeueing

    real_step = Trainer.train_step

    def step_and_signal(self):
        out = real_step(self)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGUSR2)
        return out

    monkeypatch.setattr(Trainer, "train_step", step_and_signal)
    previous = signal.signal(signal.SIGUSR2, submitit_like)
    try:
        code, _, err = run_in_process(pair_args(local_pair_dir) + BASE + ["trainer.max_steps=8"], tmp_path / "run", monkeypatch, capsys)
        assert signal.getsignal(signal.SIGUSR2) is submitit_like  # opd-train put it back
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert code == -1 and calls == [(signal.SIGUSR2, [3])], (code, calls, err[-2000:])
    assert "opd-train: preempted: SIGUSR2 received: checkpoint at step 3 saved to " in err


def test_a_run_whose_every_step_is_skipped_is_not_a_success(tiny_pair, tmp_path, monkeypatch):
    cfg = small_config(trainer={"max_steps": 3, "max_bad_steps": 5, "save_every": 1})  # never 5 in a row
    t = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    _nan_teacher_from(1, monkeypatch, [t])
    t.warn = lambda line: None
    with pytest.raises(Diverged) as err:
        t.run()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        "every one of the run's 3 steps was non-finite and skipped (last: teacher log-probs are not finite at step 3 (1 NaN of "
    )
    assert msg.endswith("nothing was trained, no checkpoint written (last checkpoint: none); allowed: a teacher with finite "
                        "log-probs, a lower trainer.lr, or trainer.grad_clip > 0")  # fmt: skip
    assert checkpoint.list_checkpoints(tmp_path) == [] and not (tmp_path / "summary.json").exists()


def test_a_nonfinite_teacher_at_the_eval_before_training_stops_at_once(tiny_pair, tmp_path, monkeypatch):
    real = scoring_mod.teacher_logits
    monkeypatch.setattr(scoring_mod, "teacher_logits", lambda *a, **kw: real(*a, **kw) * float("nan"))
    t = Trainer(small_config(trainer={"max_steps": 3, "max_bad_steps": 5}), tmp_path, pair=tiny_pair, task=AddTask())
    steps = []
    monkeypatch.setattr(t, "train_step", lambda: steps.append(1))
    with pytest.raises(Diverged) as err:
        t.run()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("the evaluation before training (step 0) is not finite (eval/")
    assert "=nan" in msg and msg.endswith(
        "stopped before training, no checkpoint written; allowed: a teacher (and student) with finite log-probs"
    )
    assert steps == [] and read_metrics(tmp_path) == []


def test_a_stop_names_the_configs_large_coefficients_before_the_teacher_and_the_lr():
    from opd_exp.runtime.guards import StepGuard, large_coefficients

    saved = {  # a run's .hydra/config.yaml as read back (plain values)
        "loss": {"kl_coef": 1.0},
        "reward": {"coef": 1e30},
        "positions": {"name": "iw_opd", "gamma": 1e300},
        "divergence": {"name": "rkl", "clip": None},
    }
    assert large_coefficients(saved) == ("reward.coef=1e+30", "positions.gamma=1e+300")
    saved["positions"]["name"] = "all"  # gamma is iw_opd's: another rule does not read it
    assert large_coefficients(saved) == ("reward.coef=1e+30",)
    assert large_coefficients(small_config()) == ()  # a typed config, every coefficient in range
    guard = StepGuard(2, large=large_coefficients(saved))
    for step in (1, 2):
        guard.record(step, "loss=inf, grad/norm=nan")
    assert guard.stop_message(2, None) == (
        "2 non-finite steps in a row (steps 1-2; last: loss=inf, grad/norm=nan); stopped without saving, last checkpoint "
        "intact: none; the config's reward.coef=1e+30 scales the loss past float range; allowed: values that keep the loss "
        "finite (at most 1e+06), then a lower trainer.lr, trainer.grad_clip > 0, a teacher with finite log-probs, or a larger "
        "trainer.max_bad_steps=2"
    )
    assert "the config's reward.coef=1e+30 scales the loss past float range; allowed: values that keep the loss finite" in (
        guard.all_skipped_message(2, None)
    )
    assert "past float range" not in StepGuard(2).stop_message(2, None)  # nothing large: the advice as it was
