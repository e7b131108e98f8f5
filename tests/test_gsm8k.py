"""The GSM8K loader on the shipped file and on local files in every supported layout."""

from __future__ import annotations

import json
import sys

import pytest

from opd_exp.config.world import TaskConfig
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks import build_task
from opd_exp.tasks.base import verify
from opd_exp.tasks.gsm8k import MINI_PATH, GSM8KTask, read_rows


def _task(**kw) -> GSM8KTask:
    kw.setdefault("name", "gsm8k")
    kw.setdefault("n_train", 0)
    kw.setdefault("n_eval", 0)
    return build_task(TaskConfig(**kw))


def test_shipped_file_is_gsm8k_format_and_self_consistent():
    rows = read_rows(MINI_PATH)
    assert len(rows) == 32 and all(set(r) == {"question", "answer"} for r in rows)
    task = _task(path="embedded:gsm8k_mini")
    problems = task.train_problems() + task.eval_problems()
    assert len(problems) == 32 and len({p.prompt for p in problems}) == 32
    for p in problems:
        assert p.solution.splitlines()[-1] == f"#### {p.answer}" or p.solution.endswith(f"#### {p.answer}")
        assert verify(p.solution, p.answer)  # the reference solution passes its own verifier
    answers = {p.answer for p in problems}
    assert {"36", "-5", "52", "12"} <= answers


def test_single_file_split_is_fixed_disjoint_and_seeded():
    a = _task(path=str(MINI_PATH), n_eval=6)
    b = _task(path=str(MINI_PATH), n_eval=6, seed=3)
    assert len(a.eval_problems()) == 6 and len(a.train_problems()) == 26
    assert a.eval_problems() == b.eval_problems()  # eval does not move with task.seed
    assert {p.prompt for p in a.train_problems()} == {p.prompt for p in b.train_problems()}
    assert a.train_problems() != b.train_problems()  # only the training order does
    assert not {p.prompt for p in a.eval_problems()} & {p.prompt for p in a.train_problems()}
    assert len(_task(path=str(MINI_PATH)).eval_problems()) == 6  # n_eval=0: a fifth
    assert len(_task(path=str(MINI_PATH), n_eval=6, n_train=10).train_problems()) == 10
    with pytest.raises(ConfigError, match=r"^task\.n_eval: got 40 but .* has only 32 problems"):
        _task(path=str(MINI_PATH), n_eval=40).eval_problems()


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


ROWS = [json.loads(line) for line in MINI_PATH.read_text().splitlines()]


def test_split_template_and_folder_layouts(tmp_path):
    _write(tmp_path / "t" / "train.jsonl", ROWS[:20])
    _write(tmp_path / "t" / "test.jsonl", ROWS[20:])
    task = _task(path=str(tmp_path / "t" / "{split}.jsonl"))
    assert len(task.train_problems()) == 20 and len(task.eval_problems()) == 12
    assert task.eval_problems()[0].prompt == ROWS[20]["question"]  # eval keeps the stored order
    folder = _task(path=str(tmp_path / "t"), n_eval=5)
    assert len(folder.train_problems()) == 20 and folder.eval_problems() == task.eval_problems()[:5]
    with pytest.raises(ConfigError, match=r"has no validation\*\.jsonl/\.parquet file for split 'validation'"):
        _task(path=str(tmp_path / "t"), eval_split="validation").eval_problems()


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "main").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:25]), tmp_path / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[25:]), tmp_path / "main" / "test-00000-of-00001.parquet")
    task = _task(path=str(tmp_path))  # the hub's layout, downloaded
    assert len(task.train_problems()) == 25 and len(task.eval_problems()) == 7


def test_instruction_and_chat_template():
    task = _task(path="embedded:gsm8k_mini", instruction="End with '#### <number>'.")
    p = task.eval_problems()[0]
    assert p.prompt.endswith("?\nEnd with '#### <number>'.")

    class Chat:
        chat_template = "..."

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "<|im_start|>user\n" + messages[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"

    assert task.render_prompt(p, Chat()) == f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n"


def test_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^task\.path: file '/no/such/gsm8k\.jsonl' does not exist; allowed:"):
        _task(path="/no/such/gsm8k.jsonl").train_problems()
    _write(tmp_path / "bad.jsonl", [{"question": "q?", "answer": "no marker"}])
    with pytest.raises(ConfigError, match=r"bad\.jsonl line 1 is not a GSM8K row \(need 'question' and an 'answer' ending in '#### <n>'\)"):
        _task(path=str(tmp_path / "bad.jsonl"), n_eval=1).train_problems()
    (tmp_path / "broken.jsonl").write_text('{"question": 1\n')
    with pytest.raises(ConfigError, match=r"broken\.jsonl line 1 is not valid JSON"):
        _task(path=str(tmp_path / "broken.jsonl")).train_problems()
    _write(tmp_path / "nan.jsonl", [{"question": "q?", "answer": "x\n#### many"}] * 3)
    with pytest.raises(ConfigError, match=r"final answer that is not a number \('many'\)"):
        _task(path=str(tmp_path / "nan.jsonl")).train_problems()
    monkeypatch.setitem(sys.modules, "datasets", None)  # `datasets` not installed
    with pytest.raises(ConfigError) as err:
        _task(path="openai/gsm8k").train_problems()
    assert str(err.value).startswith("task.path: 'openai/gsm8k' is read from the HF hub but `datasets` is not installed")
    assert "\n" not in str(err.value)


def test_unreachable_hub(monkeypatch):
    import types

    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\ndetails")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(ConfigError) as err:
        _task(path="openai/gsm8k").train_problems()
    assert str(err.value) == (
        "task.path: cannot load 'openai/gsm8k' (config 'main', split 'train') from the hub: Couldn't reach "
        "'openai/gsm8k' on the Hub (LocalEntryNotFoundError); allowed: a local .jsonl/.parquet file or folder, "
        "a path with {split}, a hub id like 'openai/gsm8k' (needs `datasets`), or 'embedded:gsm8k_mini'"
    )
