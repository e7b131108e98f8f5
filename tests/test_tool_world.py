"""The embedded tool world end to end: the calc_tool task and its SFT data (the calculator's result in
the context, never a target), opd-train on model_pair=embedded_tool task=calc_tool (a shrunken
recipe, so the pair builds in seconds) logging the episode and tool metrics, the refusals of what
episodes cannot run with, and docs/examples/my_environment.py training from one file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.reliability import BASE, pair_args, read_metrics, run_subprocess
from opd_exp.config.world import TaskConfig
from opd_exp.tasks import build_environment, build_task

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "my_environment.py"
# the embedded_tool recipe shrunk to a few SFT steps: the wiring, not the skill
SMALL_PAIR = [
    "model_pair.embedded.n_sft=256",
    "model_pair.embedded.n_check=8",
    "model_pair.embedded.teacher.sft_steps=4",
    "model_pair.embedded.student.sft_steps=4",
]
QUICK = [
    "trainer.batch_size=4",
    "eval.size=8",
    "eval.batch_size=8",
    "scale.num_threads=1",
    "trainer.progress=false",
    "logger=none",
]


def test_the_task_draws_products_with_tool_solutions_and_the_sft_mask_skips_the_result():
    from opd_exp.pairs.embedded.sft import encode_sft
    from opd_exp.pairs.embedded.tokenizer import build_tokenizer

    task = build_task(TaskConfig(name="calc_tool", max_operands=2, max_digits=3))
    train, evals = task.train_problems(), task.eval_problems()
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    for p in evals[:20]:
        a, b = map(int, re.fullmatch(r"(\d+)\*(\d+)=\?\n", p.prompt).groups())
        assert 10 <= a <= 999 and 10 <= b <= 999 and p.answer == str(a * b)
        assert p.solution == f"<calc>{a}*{b}</calc><result>{a * b}</result>#### {a * b}" and task.verify(p.solution, p.answer)
    tok = build_tokenizer()
    ids, mask, _ = encode_sft(tok, evals[:3])
    for i, p in enumerate(evals[:3]):
        assert tok.decode(ids[i][mask[i]]) == f"<calc>{p.prompt[:-3]}</calc>#### {p.answer}<eos>"
    assert build_environment(TaskConfig(name="calc_tool")) is not None and build_environment(TaskConfig()) is None


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("task.max_digits", "1", "task.max_digits=1 is not allowed; allowed: an integer in [2, 6] for calc_tool"),
        ("rollout.max_turns", "0", "rollout.max_turns=0 is not allowed; allowed: an integer 1..64"),
        ("rollout.max_episode_tokens", "0", "rollout.max_episode_tokens=0 is not allowed; allowed: an integer >= 1"),
    ],
)
def test_bad_episode_settings_are_one_line(key, value, message):
    from opd_exp.config import schema
    from opd_exp.runtime.errors import ConfigError

    with pytest.raises(ConfigError) as ex:
        if key.startswith("task."):
            build_task(TaskConfig(name="calc_tool", max_digits=int(value)))
        else:
            schema.RolloutConfig(**{key.split(".")[1]: int(value)})
    assert str(ex.value).startswith(message) and "\n" not in str(ex.value)


def test_staleness_and_fsdp_are_refused_with_an_environment(tiny_pair, tmp_path):
    import dataclasses

    from helpers.tiny import AddTask, small_config
    from opd_exp.runtime.errors import ConfigError
    from opd_exp.training.trainer import Trainer

    cfg = small_config(rollout={"max_new_tokens": 4, "max_prompt_tokens": 8, "max_turns": 2, "staleness": 1, "correction": "recompute"})
    cfg = dataclasses.replace(cfg, task=TaskConfig(name="calc_tool"))
    with pytest.raises(ConfigError, match=r"^rollout.staleness=1 is not allowed; allowed: 0 with task=calc_tool"):
        Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())


@pytest.mark.slow
def test_opd_train_on_the_tool_world_runs_and_logs_episodes(tmp_path):
    res = run_subprocess(["experiment=calc_tool", *SMALL_PAIR, *QUICK, "trainer.max_steps=2", "eval.every=2"], tmp_path / "run")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in ("tools/calls_mean", "tools/valid_rate", "tools/result_used_rate", "episode/turns_mean", "episode/env_tokens_mean"):
            assert key in r, key
        assert r["response/length_mean"] == pytest.approx(r["episode/student_tokens_mean"])  # trained: the student's tokens
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2]


@pytest.mark.slow
def test_the_example_environment_trains_from_one_file(local_pair_dir, tmp_path, monkeypatch):
    """docs/examples/my_environment.py through OPD_PLUGINS: its task and environment register, and a
    short run samples episodes against the step checker."""
    monkeypatch.setenv("OPD_PLUGINS", str(EXAMPLE))
    args = [a for a in BASE if not a.startswith("task")] + pair_args(local_pair_dir)
    args += ["task.name=checked_arithmetic", "task.n_train=64", "task.n_eval=4", "rollout.max_turns=8", "trainer.max_steps=2"]
    res = run_subprocess(args, tmp_path / "run")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2 and all("episode/turns_mean" in r and "tools/calls_mean" not in r for r in rows)


def test_the_doc_shows_the_example_environment_as_it_is():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "extending.md").read_text(), flags=re.S)
    assert EXAMPLE.read_text() in blocks
