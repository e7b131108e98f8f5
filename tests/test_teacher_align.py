"""A teacher with another tokenizer through the teacher-scorer seam (``teacher.align=bytes``,
``training/teacher_align.py``; the math: ``divergences/chunks.py`` and
``test_cross_tokenizer_enumeration.py``).

- the same tokenizer sent through the byte-aligned path gives today's losses to 1e-6 relative
  (rkl + sampled + sequence credit, placement=chunk): the machinery adds nothing; placement=sequence
  gives other losses (the check is not vacuous);
- a teacher with its own tokenizer (multi-character tokens, a ChatML end of turn): the payload is the
  teacher's log-prob of its canonical tokens of the student's text, placed as stated, and a short run
  trains and logs align/*;
- what it cannot feed is refused in one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from helpers.tiny import AddTask, small_config
from opd_exp.training.trainer import Trainer

EXACT_GROUPS = dict(
    estimator=dict(name="sampled", baseline="none"),
    divergence=dict(name="rkl"),
    loss=dict(name="reinforce", credit="sequence", gamma=1.0),
    trainer=dict(max_steps=3),
    rollout=dict(max_new_tokens=6, max_prompt_tokens=8),
)


def _pair(tiny_dir, **extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    return SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(tiny_dir / "student"),
        teacher=AutoModelForCausalLM.from_pretrained(tiny_dir / "teacher"),
        tokenizer=tok,
        vocab_size=len(tok),
        **extra,
    )


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path, pair, **teacher):
    groups = {**EXACT_GROUPS, "teacher": teacher}
    Trainer(small_config(**groups), tmp_path, pair=pair, task=AddTask()).run()
    return [r for r in _metrics(tmp_path) if "loss" in r]


def test_same_tokenizer_through_bytes_gives_todays_losses(tiny_dir, tmp_path):
    today = _run(tmp_path / "none", _pair(tiny_dir))
    aligned = _run(tmp_path / "bytes", _pair(tiny_dir), align="bytes", align_placement="chunk")
    assert len(today) == len(aligned) == 3
    for a, b in zip(today, aligned):
        for key in ("loss", "kl/reverse", "advantages/mean", "student/logprob_mean", "teacher/logprob_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
        assert b["align/chunk_tokens_mean"] == 1.0 and b["align/one_to_one_rate"] == 1.0
    # not vacuous: the whole teacher log-prob at each row's end gives other (equally unbiased) losses
    other = _run(tmp_path / "sequence", _pair(tiny_dir), align="bytes", align_placement="sequence")
    assert other[0]["kl/reverse"] == pytest.approx(today[0]["kl/reverse"], rel=1e-6)  # the same sequence costs
    assert abs(other[0]["loss"] - today[0]["loss"]) > 1e-4 * abs(today[0]["loss"])
