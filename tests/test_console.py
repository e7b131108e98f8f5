"""What a run says while it trains: the progress bar shows the trained divergence under its name
(``fkl=`` for an fkl run) and the loss under its form's (``loss[ppo]=``); each eval is one line of
its metrics on stderr and in train.log; the step-0 eval is outside step 1's time and the ETA."""

from __future__ import annotations

import re

import pytest
import tqdm.std

from helpers.tiny import AddTask, small_config
from opd_exp.sinks import Progress
from opd_exp.training.console import eval_line
from opd_exp.training.trainer import Trainer

STEP_METRICS = {"kl/forward": 0.5, "kl/reverse": 0.7, "jsd/mean": 0.125, "loss": -7.38, "eval/accuracy": 0.25}


@pytest.fixture
def clock(monkeypatch):
    """tqdm's clock, moved by hand (seconds)."""
    now = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])
    return now


@pytest.mark.parametrize(
    ("divergence", "loss", "shown"),
    [
        ("fkl", "ppo", {"fkl": "0.5", "jsd": "0.125", "loss[ppo]": "-7.38", "acc": "0.25"}),
        ("rkl", "direct", {"rkl": "0.7", "jsd": "0.125", "loss[direct]": "-7.38", "acc": "0.25"}),
        ("jsd", "reinforce", {"jsd": "0.125", "loss[reinforce]": "-7.38", "acc": "0.25"}),  # jsd/mean is its own estimate: once
    ],
)
def test_the_bar_names_the_trained_divergence_and_the_loss_form(divergence, loss, shown, capsys):
    bar = Progress(4, divergence=divergence, loss=loss)
    bar.update(STEP_METRICS)
    assert bar.shown == shown
    postfix = ", ".join(f"{k}={v}" for k, v in shown.items())
    assert bar.bar.postfix == postfix
    bar.close()
    assert postfix in capsys.readouterr().err


def test_an_fkl_ppo_run_shows_fkl_and_loss_ppo_never_rkl(tiny_pair, tmp_path, capsys):
    cfg = small_config(
        trainer={"max_steps": 2, "progress": True}, divergence={"name": "fkl"}, estimator={"name": "sampled"}, loss={"name": "ppo"}
    )
    Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask()).run()
    err = capsys.readouterr().err
    bars = [seg for seg in re.split(r"[\r\n]", err) if seg.startswith("opd-train: ") and "|" in seg]
    assert bars and "fkl=" in bars[-1] and "loss[ppo]=" in bars[-1] and "acc=" in bars[-1]
    assert "rkl=" not in err


def test_eval_line_is_accuracy_first_then_every_eval_number():
    metrics = {
        "eval/kl_reverse": 1.31946,
        "eval/accuracy": 0.4123,
        "eval/teacher_accuracy": 0.94,
        "eval/jsd": 0.1,
        "eval/note": "not a number",
        "eval/flag": True,
        "loss": 3.0,
    }
    assert eval_line(250, metrics) == "opd-train: eval at step 250: accuracy 0.412 (teacher 0.940), kl_reverse 1.319, jsd 0.1"


def test_each_eval_is_one_line_on_stderr_and_in_train_log(tiny_pair, tmp_path, capsys):
    Trainer(small_config(trainer={"max_steps": 2}, eval={"every": 1}), tmp_path, pair=tiny_pair, task=AddTask()).run()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("opd-train: eval at step ")]
    assert [int(ln.split()[4].rstrip(":")) for ln in lines] == [0, 1, 2]  # step 0 (before training), each eval, once
    for ln in lines:
        assert re.fullmatch(r"opd-train: eval at step \d: accuracy \d\.\d{3}( \(teacher \d\.\d{3}\))?, .*kl_reverse [-\d.e+]+.*", ln), ln
    logged = [ln.split(" ", 2)[2] for ln in (tmp_path / "train.log").read_text().splitlines()]
    assert [ln for ln in logged if ln.startswith("opd-train: eval at step ")] == lines


def test_the_step0_eval_is_outside_step_1s_time_and_the_eta(clock, capsys):
    bar = Progress(4)
    clock[0] += 50.0  # the step-0 eval
    bar.start()
    clock[0] += 2.0  # step 1
    bar.update(STEP_METRICS)
    d = bar.bar.format_dict
    assert d["elapsed"] == pytest.approx(2.0) and d["rate"] == pytest.approx(0.5)  # 1 step in 2 s, not in 52 s
    assert "[00:02<00:06" in str(bar.bar)  # 3 steps left at 2 s each
    bar.close()


def test_the_trainer_starts_the_bar_clock_after_the_step0_eval(tiny_pair, tmp_path, clock, monkeypatch, capsys):
    """A 50 s step-0 eval and 2 s steps (on tqdm's clock): the bar's time and rate are the steps'."""
    real_eval, real_step = Trainer.evaluate, Trainer.train_step

    def evaluate(self):
        out = real_eval(self)
        if self.step == 0:
            clock[0] += 50.0
        return out

    def train_step(self):
        clock[0] += 2.0
        return real_step(self)

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    monkeypatch.setattr(Trainer, "train_step", train_step)
    Trainer(small_config(trainer={"max_steps": 3, "progress": True}), tmp_path, pair=tiny_pair, task=AddTask()).run()
    final = [seg for seg in re.split(r"[\r\n]", capsys.readouterr().err) if "3/3" in seg][-1]
    assert re.search(r"\[00:06<00:00, +2\.00s/it", final), final  # 3 steps x 2 s; the 50 s eval left out
