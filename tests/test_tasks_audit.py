"""Data a task must not take in silence: an empty question, a question in both splits or twice
in the eval set (refused), repeats within the training split (one warning); and
task=chat_arithmetic on a tokenizer without a chat template (refused before training)."""

from __future__ import annotations

import json

import pytest

from helpers.reliability import BASE, one_error_line, pair_args, run_cli
from opd_exp.config.world import TaskConfig
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks import build_task


def _rows(questions: list[str]) -> list[dict]:
    return [{"question": q, "answer": f"work\n#### {i}"} for i, q in enumerate(questions)]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _task(**kw):
    t = build_task(TaskConfig(name="gsm8k", **kw))
    return t.train_problems(), t.eval_problems()


def test_an_empty_question_is_refused(tmp_path):
    data = _write(tmp_path / "d.jsonl", _rows(["q one?", "  ", "q three?"]))
    with pytest.raises(ConfigError) as ex:
        _task(path=str(data))
    assert str(ex.value) == f"task.path: {data} row 1 has an empty question; allowed: a non-empty 'question' in every row"


def test_a_question_in_both_splits_or_twice_in_eval_is_refused(tmp_path):
    (tmp_path / "f").mkdir()
    _write(tmp_path / "f" / "train.jsonl", _rows(["a?", "b?", "shared question?"]))
    _write(tmp_path / "f" / "test.jsonl", _rows(["shared question?", "c?"]))
    with pytest.raises(ConfigError) as ex:
        _task(path=str(tmp_path / "f"))
    assert str(ex.value) == (
        f"task.path: {tmp_path / 'f'}: the question 'shared question?' is in both the training and the eval split; allowed: disjoint splits"
    )
    _write(tmp_path / "f" / "test.jsonl", _rows(["c?", "c?"]))
    with pytest.raises(ConfigError, match=r"the eval question 'c\?' appears 2 times; allowed: each question once"):
        _task(path=str(tmp_path / "f"))


def test_repeats_within_the_training_split_are_warned_about_once(tmp_path, capsys):
    (tmp_path / "f").mkdir()
    _write(tmp_path / "f" / "train.jsonl", _rows(["a?", "a?", "a?", "b?"]))
    _write(tmp_path / "f" / "test.jsonl", _rows(["c?"]))
    train, evals = _task(path=str(tmp_path / "f"))
    assert len(train) == 4 and len(evals) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"opd-train: warning: task.path: {tmp_path / 'f'}: 2 training question(s) repeat an earlier one; they are kept (drawn more often)"
    ]


def test_the_shipped_mini_set_has_no_duplicates(capsys):
    train, evals = _task(path="embedded:gsm8k_mini", n_eval=0)
    assert train and evals and capsys.readouterr().err == ""


def test_chat_arithmetic_on_a_tokenizer_without_a_chat_template_is_refused(local_pair_dir, tmp_path, monkeypatch, capsys):
    args = [a for a in BASE if not a.startswith("task")] + pair_args(local_pair_dir) + ["task=chat_arithmetic", "trainer.max_steps=1"]
    code, _out, err = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
    assert code == 2
    assert [one_error_line(err)] == [
        "opd-train: error: task=chat_arithmetic: the model pair's tokenizer has no chat template; allowed: a pair whose tokenizer has "
        "one (model_pair=smollm2, a Qwen pair), or task=arithmetic for plain text"
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
