"""The distribution trained on is the one sampled: a checkpoint's generation_config changes
nothing, scoring runs with dropout off, and rollout/logprob_gap shows it on every step."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from helpers.tiny import AddTask, small_config
from opd_exp.training.rollout import checkpoint_sampling_settings, generate
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import dropout_off, response_logits, student_logits, token_logprobs

# What many instruct checkpoints ship (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20, ...)
SHIPPED = dict(do_sample=True, repetition_penalty=1.3, no_repeat_ngram_size=2, temperature=0.5, top_k=3, min_p=0.2)


@pytest.fixture
def shipping_pair(tiny_dir, tmp_path):
    """The tiny pair, its student's folder with a generation_config.json that ships SHIPPED."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder = tmp_path / "student"
    shutil.copytree(tiny_dir / "student", folder)
    GenerationConfig(eos_token_id=1, pad_token_id=0, **SHIPPED).save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    student = AutoModelForCausalLM.from_pretrained(folder)
    assert student.generation_config.repetition_penalty == 1.3  # loaded like a hub checkpoint
    return SimpleNamespace(
        student=student,
        teacher=AutoModelForCausalLM.from_pretrained(tiny_dir / "teacher"),
        tokenizer=tok,
        vocab_size=len(tok),
    )


PROMPTS = ["1+1=", "22+2=", "3+33=", "4+4="]


def _trainer_logprobs(pair, batch, temperature, top_k, top_p):
    with torch.no_grad():
        z = student_logits(pair.student, batch, pair.vocab_size, SamplingSpec(temperature, top_k, top_p))
    return token_logprobs(z, batch.response_ids)


@pytest.mark.parametrize("row_keyed", [False, True], ids=["global_rng", "row_keyed"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 6, 1.0), (1.2, 0, 0.85)])
def test_a_checkpoints_generation_config_does_not_change_what_is_sampled(shipping_pair, temperature, top_k, top_p, row_keyed):
    """generate's processed scores, and the log-probs it records, are the trainer's transform
    (repetition penalty, n-gram ban, min_p, its own top_k/temperature: all off)."""
    torch.manual_seed(0)
    pair = shipping_pair
    seeds = list(range(len(PROMPTS) * 2)) if row_keyed else None
    batch, scores = generate(
        pair.student,
        pair.tokenizer,
        PROMPTS,
        n_samples=2,
        max_new_tokens=8,
        sampling=SamplingSpec(temperature, top_k, top_p),
        vocab_size=pair.vocab_size,
        return_scores=True,
        row_seeds=seeds,
    )
    m = batch.response_mask
    ours = _trainer_logprobs(pair, batch, temperature, top_k, top_p)
    if not row_keyed:  # generate's own processed scores (row-keyed: a one-hot choice)
        ref = torch.log_softmax(scores[..., : pair.vocab_size].float(), -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        assert (ours - ref).abs()[m].max() < 1e-5
    gap = (batch.sampling_logprobs - ours).abs()[m]
    assert gap.max() < 1e-5, gap.max()
    assert pair.student.generation_config.repetition_penalty == 1.3  # the model's own config is left as it was


def test_greedy_is_plain_argmax_whatever_the_checkpoint_ships(shipping_pair):
    pair = shipping_pair
    batch = generate(pair.student, pair.tokenizer, PROMPTS, max_new_tokens=8, do_sample=False, vocab_size=pair.vocab_size)
    with torch.no_grad():
        argmax = response_logits(pair.student, batch, pair.vocab_size).argmax(-1)
    m = batch.response_mask
    assert torch.equal(batch.response_ids[m], argmax[m])
    assert batch.sampling_logprobs is None


def test_the_ignored_settings_are_named_once(shipping_pair, tmp_path, monkeypatch):
    from opd_exp.training.console import Console
    from opd_exp.training.trainer import Trainer

    assert checkpoint_sampling_settings(shipping_pair.student) == SHIPPED
    lines = []
    monkeypatch.setattr(Console, "warn", lambda self, line: lines.append(line))  # every line the trainer says
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "sampled"}, loss={"name": "reinforce"})
    trainer = Trainer(cfg, tmp_path, pair=shipping_pair, task=AddTask())
    m = trainer.train_step()  # and a training step samples the trainer's distribution
    assert m["rollout/logprob_gap"] < 1e-5 and m["rollout/logprob_gap_max"] < 1e-5
    assert lines == [
        "opd-train: warning: the student's generation_config sets do_sample=True, min_p=0.2, temperature=0.5, top_k=3, "
        "repetition_penalty=1.3, no_repeat_ngram_size=2; rollouts and evaluation ignore it "
        "(they sample exactly rollout.temperature/top_k/top_p, and greedy eval is plain argmax)"
    ]


def _dropout_pair(tiny_dir, tmp_path, attention_dropout):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    student = AutoModelForCausalLM.from_pretrained(tiny_dir / "student", attention_dropout=attention_dropout)
    assert student.config.attention_dropout == attention_dropout
    return SimpleNamespace(
        student=student, teacher=AutoModelForCausalLM.from_pretrained(tiny_dir / "teacher"), tokenizer=tok, vocab_size=len(tok)
    )


@pytest.mark.parametrize(
    "attention_dropout,trainer",
    [
        (0.0, {"lora_rank": 4, "lora_dropout": 0.3, "lora_target_modules": ["q_proj", "v_proj"]}),
        (0.5, {}),
        (0.5, {"grad_checkpointing": True}),
    ],
    ids=["lora_dropout", "attention_dropout", "attention_dropout_checkpointed"],
)
def test_scoring_runs_with_dropout_off_and_keeps_gradients(tiny_dir, tmp_path, attention_dropout, trainer):
    """The student is scored as it sampled (dropout off): the logged gap is float-level, and the
    gradient equals the one of the model in eval mode (with activation checkpointing too)."""
    from opd_exp.training.trainer import Trainer

    pair = _dropout_pair(tiny_dir, tmp_path, attention_dropout)
    cfg = small_config(
        divergence={"name": "rkl"}, estimator={"name": "sampled"}, loss={"name": "reinforce"}, trainer={"batch_size": 4, **trainer}
    )
    t = Trainer(cfg, tmp_path, pair=pair, task=AddTask())
    batch = t.sample(0)
    assert t.student.training  # the loop's mode: dropout modules would be live
    t.optimizer.zero_grad(set_to_none=True)
    _, tally = t.accumulate(batch)
    assert tally["rollout/logprob_gap"] / batch.num_response_tokens < 1e-5
    assert tally.maxes["rollout/logprob_gap_max"] < 1e-5
    got = [p.grad.detach().clone() for p in t.params]
    assert sum(float(g.abs().sum()) for g in got) > 0  # (LoRA B starts at 0: A gets none yet)
    # the same loss with every module in eval mode (no dropout, no checkpointing)
    t.optimizer.zero_grad(set_to_none=True)
    t.student.eval()
    _, again = t.accumulate(batch)
    t.student.train()
    for a, b in zip(got, (p.grad for p in t.params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert again["student/logprob_mean"] == pytest.approx(tally["student/logprob_mean"], rel=1e-6)
    # modes are restored after scoring: dropout_off is a scope, not a switch
    modes = {name: m.training for name, m in t.student.named_modules()}
    with dropout_off(t.student):
        assert not any(m.training for m in t.student.modules() if isinstance(m, torch.nn.Dropout))
    assert modes == {name: m.training for name, m in t.student.named_modules()}
