"""Trusting a run folder: settings fingerprinted in every checkpoint, a resume with other
settings refused (naming the keys) unless checkpoint.extend=true, which keeps the learning rate
continuous and records each session in history.yaml; train.log keeps the console lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.tiny import AddTask, small_config
from opd_exp.runtime import checkpoint
from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.fingerprint import config_fingerprint, read_history
from opd_exp.training.trainer import Trainer

LR = 1e-2


def _cfg(**trainer):
    return small_config(trainer=dict(dict(max_steps=4, save_every=2, schedule="linear", warmup_steps=0, lr=LR), **trainer))


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _lrs(run_dir):
    return {r["step"]: r["lr"] for r in _rows(run_dir) if "lr" in r}


def test_fingerprint_leaves_out_what_does_not_shape_the_run():
    a = config_fingerprint(_cfg())
    assert a["trainer.max_steps"] == 4 and a["divergence.name"] == "fkl" and a["trainer.lr"] == LR
    assert not any(k.startswith("logger.") for k in a)
    for key in ("trainer.progress", "scale.device", "eval.every", "checkpoint.extend", "checkpoint.every"):
        assert key not in a
    assert config_fingerprint(_cfg(eval_every=7, progress=True, save_every=1)) == a
    assert config_fingerprint(_cfg(max_steps=5)) != a


def test_resume_with_other_settings_is_refused_naming_the_keys(tiny_pair, tmp_path, capsys):
    Trainer(_cfg(), tmp_path, pair=tiny_pair, task=AddTask()).run(stop_after=2)
    with pytest.raises(ConfigError) as ex:
        Trainer(_cfg(max_steps=8, lr=2e-2), tmp_path, pair=tiny_pair, task=AddTask()).run()
    msg = str(ex.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"hydra.run.dir: {tmp_path} holds a run made with other settings (trainer.lr: 0.01 -> 0.02, trainer.max_steps: 4 -> 8)"
    )
    assert "allowed: the same settings to resume it, checkpoint.extend=true" in msg
    # nothing was written by the refused session
    assert max(r["step"] for r in _rows(tmp_path)) == 2
    # the same settings resume, and say so
    capsys.readouterr()
    Trainer(_cfg(), tmp_path, pair=tiny_pair, task=AddTask()).run()
    err = capsys.readouterr().err
    ckpt = checkpoint.checkpoint_root(tmp_path) / "step_000002"
    assert f"opd-train: resuming from step 2 (checkpoint {ckpt})" in err
    log = (tmp_path / "train.log").read_text()
    assert f"opd-train: resuming from step 2 (checkpoint {ckpt})" in log
    assert "opd-train: student eval accuracy" in log and "summary: {" in log
    assert [h["session"] for h in read_history(tmp_path)] == ["start", "resume"]


def test_extend_keeps_the_learning_rate_continuous_and_records_the_session(tiny_pair, tmp_path, capsys):
    Trainer(_cfg(), tmp_path, pair=tiny_pair, task=AddTask()).run(stop_after=2)
    before = _lrs(tmp_path)
    # linear over 4 steps: the lr before step s is LR * (1 - (s-1)/4)
    assert before == pytest.approx({1: LR, 2: 0.75 * LR})
    capsys.readouterr()
    Trainer(_cfg(max_steps=8, extend=True), tmp_path, pair=tiny_pair, task=AddTask()).run()
    err = capsys.readouterr().err
    assert "opd-train: extending the run from step 2 with other settings (trainer.max_steps: 4 -> 8)" in err
    assert "the learning rate continues from 0.005 to the end of the linear schedule at step 8" in err
    lrs = _lrs(tmp_path)
    # from the checkpoint's factor 0.5 at step 2, linearly to 0 at step 8 (no jump to 0.75)
    want = {s: 0.5 * LR * (1 - (s - 3) / 6) for s in range(3, 9)}
    assert {s: lrs[s] for s in range(3, 9)} == pytest.approx(want)
    history = read_history(tmp_path)
    assert [h["session"] for h in history] == ["start", "extend"]
    assert history[1]["from_step"] == 2 and history[1]["changed"] == {"trainer.max_steps": [4, 8]}
    # the extension's checkpoints carry the new settings: a plain resume with them is fine
    state = json.loads((checkpoint.latest(tmp_path) / "state.json").read_text())
    assert state["config"]["trainer.max_steps"] == 8 and state["lr_segments"] == [{"start": 2, "factor": 0.5, "end": 8}]
    Trainer(_cfg(max_steps=8), tmp_path, pair=tiny_pair, task=AddTask()).run()


def test_eval_size_larger_than_the_eval_split_is_refused(tiny_pair, tmp_path):
    with pytest.raises(ConfigError) as ex:
        Trainer(_cfg(eval_size=100), tmp_path, pair=tiny_pair, task=AddTask(n_eval=16))
    assert str(ex.value) == (
        "eval.size=100 is more than the 16 eval problems of task 'arithmetic'; "
        "allowed: 0 (the whole split) up to 16, or a larger task.n_eval"
    )


def test_extend_with_another_model_is_refused_and_renames_nothing(tiny_pair, tmp_path):
    from types import SimpleNamespace

    from helpers.tiny import build_model

    run = tmp_path / "run"
    Trainer(_cfg(), run, pair=tiny_pair, task=AddTask()).run(stop_after=2)
    root = checkpoint.checkpoint_root(run)
    ckpt = checkpoint.latest(run)
    other = SimpleNamespace(
        **{**vars(tiny_pair), "student": build_model(tmp_path / "other", tiny_pair.vocab_size, hidden=48, layers=1, seed=3)}
    )
    with pytest.raises(ConfigError) as ex:
        Trainer(_cfg(max_steps=8, extend=True), run, pair=other, task=AddTask()).run()
    msg = str(ex.value)
    assert "\n" not in msg
    assert msg.startswith(f"hydra.run.dir: checkpoint {ckpt} holds another model than this run's student (size mismatch for model.")
    assert msg.endswith(
        "; nothing was set aside; allowed: the model pair it was trained with (model_pair=embedded), or a new hydra.run.dir"
    )
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]
    # the run's own command still resumes it
    Trainer(_cfg(), run, pair=tiny_pair, task=AddTask()).run()
    assert max(r["step"] for r in _rows(run)) == 4


def test_extend_to_fewer_steps_than_reached_is_refused(tiny_pair, tmp_path):
    from opd_exp.runtime.fingerprint import check_run_folder

    Trainer(_cfg(), tmp_path, pair=tiny_pair, task=AddTask()).run(stop_after=2)
    want = (
        f"trainer.max_steps=1 is below step 2, which the run in {tmp_path} has reached (nothing would be trained); "
        f"allowed: trainer.max_steps >= 2 (more steps with checkpoint.extend=true), or a new hydra.run.dir"
    )
    for extend in (True, False):
        with pytest.raises(ConfigError) as ex:  # before anything starts (opd-train)...
            check_run_folder(tmp_path, _cfg(max_steps=1, extend=extend))
        assert str(ex.value) == want
    with pytest.raises(ConfigError) as ex:  # ...and where the trainer loads the checkpoint
        Trainer(_cfg(max_steps=1, extend=True), tmp_path, pair=tiny_pair, task=AddTask()).run()
    assert str(ex.value) == want
    assert [h["session"] for h in read_history(tmp_path)] == ["start"]
    check_run_folder(tmp_path, _cfg(max_steps=2, extend=True))  # the step reached: allowed (nothing left to do)


def test_extend_onto_another_eval_set_measures_it_again(tiny_pair, tmp_path, monkeypatch, capsys):
    from opd_exp.training.evaluate import Evaluator

    Trainer(_cfg(eval_size=4), tmp_path, pair=tiny_pair, task=AddTask()).run(stop_after=2)
    measured = []
    real = Evaluator.accuracy
    monkeypatch.setattr(Evaluator, "accuracy", lambda self, engine: measured.append(len(self.problems)) or real(self, engine))
    capsys.readouterr()
    t = Trainer(_cfg(max_steps=4, eval_size=8, extend=True), tmp_path, pair=tiny_pair, task=AddTask())
    summary = t.run()
    err = capsys.readouterr().err
    assert (
        "opd-train: the extension changes what the eval measures (eval.size): the student is evaluated on the new eval "
        "set at step 2 and the teacher's accuracy measured on it again; the summary's 'before' values are that evaluation "
        "(metrics.jsonl rows up to step 2 are on the old set)"
    ) in err
    assert measured == [8]  # the teacher on the 8 new problems, once
    rows = _rows(tmp_path)
    again = [r for r in rows if r["step"] == 2 and "eval/teacher_accuracy" in r]
    assert len(again) == 1 and again[0]["eval/teacher_accuracy"] == summary["eval/teacher_accuracy"]
    assert summary["eval/kl_reverse_before"] == again[0]["eval/kl_reverse"] != rows[0]["eval/kl_reverse"]
    assert read_history(tmp_path)[-1]["eval_set_changed"] == ["eval.size"]


def test_a_setting_added_after_the_checkpoint_is_no_difference_at_its_default():
    """A checkpoint written before a knob existed resumes while the knob holds its default
    (the code did then what the default does now); any other value is a difference."""
    from opd_exp.config.schema import TrainConfig
    from opd_exp.runtime import fingerprint

    cfg = TrainConfig()
    now, defaults = fingerprint.config_fingerprint(cfg), fingerprint.schema_defaults(cfg)
    older = {k: v for k, v in now.items() if k != "loss.ppo_epochs"}  # written before loss.ppo_epochs
    assert "loss.ppo_epochs" in now and fingerprint.differences(older, now, defaults) == {}
    assert fingerprint.refusal(Path("run"), older, now, defaults) is None
    changed = {**now, "loss.ppo_epochs": 4}
    assert fingerprint.differences(older, changed, defaults) == {"loss.ppo_epochs": (None, 4)}
    assert fingerprint.differences(older, now) == {"loss.ppo_epochs": (None, 1)}  # without the defaults: a difference


def test_the_trainer_resumes_a_checkpoint_older_than_a_setting_at_its_default(tmp_path):
    """The trainer's own resume check (after the models load) agrees with the start-up check."""
    from opd_exp.config.schema import TrainConfig
    from opd_exp.runtime import fingerprint
    from opd_exp.training.checkpoints import resume_session

    cfg = TrainConfig()
    now = fingerprint.config_fingerprint(cfg)
    older = {k: v for k, v in now.items() if not k.startswith("loss.ppo_")}
    lines = []
    session, factor = resume_session(cfg, tmp_path, 2, older, now, 1e-3, 1e-3, lines.append)
    assert session == {"session": "resume", "from_step": 2} and factor is None and lines == []
    with pytest.raises(ConfigError, match=r"other settings \(loss.ppo_epochs: None -> 3\)"):
        resume_session(cfg, tmp_path, 2, older, {**now, "loss.ppo_epochs": 3}, 1e-3, 1e-3, lines.append)


def test_a_preempted_run_keeps_its_preemption_line_in_train_log(local_pair_dir, tmp_path, monkeypatch, capsys):
    """opd-train's own lines reach train.log like the trainer's: the preemption line (exit 75)."""
    import os
    import signal

    from helpers.reliability import BASE, pair_args, run_in_process

    real_step = Trainer.train_step

    def step_then_sigterm(self):
        out = real_step(self)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # acted on at the step boundary
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_sigterm)
    run = tmp_path / "run"
    code, _, err = run_in_process(pair_args(local_pair_dir) + BASE + ["trainer.max_steps=6"], run, monkeypatch, capsys)
    assert code == 75, err[-2000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("opd-train: preempted:")]
    assert line.startswith("opd-train: preempted: SIGTERM received: checkpoint at step 2 saved to ")
    logged = [ln.split(" ", 2)[2] for ln in (run / "train.log").read_text().splitlines()]  # "<date> <time> <line>"
    assert logged[-1] == line
