"""Data a task must not take in silence: an empty question, a question in both splits or twice
in the eval set (refused; for one file split in two, naming its lines: deduplicate the file),
repeats within the training split (one warning); found before W&B starts; and
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
    assert str(ex.value) == f"task.path: {data} line 2 has an empty question; allowed: a non-empty 'question' in every row"


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


def test_one_file_with_a_question_twice_is_told_to_deduplicate_naming_its_lines(tmp_path):
    """One file split into eval and training: the copies are the file's, not the split's; its lines
    are 1-based and count blank lines, as an editor shows them."""
    data = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in _rows(["dup question?", "dup question?", "dup question?"])]
    data.write_text(f"{lines[0]}\n\n{lines[1]}\n")  # line 2 blank
    with pytest.raises(ConfigError) as ex:
        _task(path=str(data), n_eval=1)  # one copy in eval, the other in training
    assert str(ex.value) == (
        f"task.path: {data}: the question 'dup question?' is on lines 1 and 3 of the file, and the file's split into eval and "
        "training put copies in both; allowed: each question once in the file (deduplicate it: keep one of lines 1 and 3)"
    )
    data.write_text(f"{lines[0]}\n{lines[1]}\n\n{lines[2]}\n")
    with pytest.raises(ConfigError) as ex:
        _task(path=str(data), n_eval=2)  # two copies in eval
    assert str(ex.value) == (
        f"task.path: {data}: the question 'dup question?' is on lines 1, 2 and 4 of the file, and the file's split into eval and "
        "training put 2 copies in the eval set; allowed: each question once in the file (deduplicate it: keep one of lines 1, 2 and 4)"
    )
    json_file = tmp_path / "d.json"  # a .json list: rows, counted from 1
    json_file.write_text(json.dumps(_rows(["x?", "dup?", "dup?"])[:1] + [{"question": "dup?", "answer": "#### 1"}] * 2))
    with pytest.raises(ConfigError, match=r"is on rows 2 and 3 of the file"):
        _task(path=str(json_file), n_eval=2)


@pytest.mark.parametrize("layout", ["one_file", "folder"])
def test_a_duplicate_across_splits_is_found_before_wandb_starts(layout, local_pair_dir, tmp_path, monkeypatch, capsys):
    """logger=wandb: the data is read and checked before wandb.init, so a refused start leaves no
    W&B run (whose id the next good run would reuse); its one line is also in train.log."""
    if layout == "one_file":
        path = _write(tmp_path / "d.jsonl", _rows(["a?", "shared question?", "b?", "shared question?", "c?"]))
        # eval draws 4 of these 5 rows: the two copies are split apart or both in eval, never both in training
        split = ["task.n_eval=4"]
    else:
        (tmp_path / "f").mkdir()
        _write(tmp_path / "f" / "train.jsonl", _rows(["a?", "b?", "shared question?"]))
        _write(tmp_path / "f" / "test.jsonl", _rows(["shared question?", "c?"]))
        path, split = tmp_path / "f", ["task.n_eval=0"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = [a for a in BASE if not a.startswith(("task", "logger", "eval.size"))] + pair_args(local_pair_dir)
    args += ["task=gsm8k", f"task.path={path}", *split, "eval.size=0", "trainer.max_steps=1", "logger=wandb", "logger.mode=offline"]
    run = tmp_path / "run"
    code, out, err = run_cli([*args, f"hydra.run.dir={run}"], monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and not out.strip() and [ln for ln in err.splitlines() if ln.strip()] == [line]
    assert "'shared question?'" in line and ("deduplicate it" if layout == "one_file" else "allowed: disjoint splits") in line
    assert not (run / "wandb").exists() and not (run / "wandb_id.txt").exists()
    assert (run / "train.log").read_text().endswith(f" {line}\n")


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
