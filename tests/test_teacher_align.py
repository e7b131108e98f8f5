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
import torch

from helpers.tiny import AddTask, small_config
from opd_exp.runtime.errors import ConfigError
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


def _run(tmp_path, pair, extra=None, **teacher):
    groups = {**EXACT_GROUPS, **(extra or {}), "teacher": teacher}
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


LOO = dict(estimator=dict(name="sampled", baseline="loo"), rollout=dict(max_new_tokens=6, max_prompt_tokens=8, n_samples=2))


def test_same_tokenizer_through_bytes_with_the_leave_one_out_baseline(tiny_dir, tmp_path):
    """estimator.baseline=loo (allowed with align=bytes: it reads only the other samples' costs) gives
    today's losses through the byte path too, and other losses than without the baseline."""
    today = _run(tmp_path / "none", _pair(tiny_dir), LOO)
    aligned = _run(tmp_path / "bytes", _pair(tiny_dir), LOO, align="bytes", align_placement="chunk")
    for a, b in zip(today, aligned):
        for key in ("loss", "kl/reverse", "advantages/mean", "estimator/baseline"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    plain = _run(tmp_path / "plain", _pair(tiny_dir), {"rollout": LOO["rollout"]}, align="bytes", align_placement="chunk")
    assert plain[0]["kl/reverse"] == pytest.approx(aligned[0]["kl/reverse"], rel=1e-6)  # the same samples
    assert abs(plain[0]["loss"] - aligned[0]["loss"]) > 1e-4 * abs(plain[0]["loss"])


MERGES = [("1", "2"), ("3", "4"), ("5", "6"), ("7", "8"), ("9", "0"), ("1", "0"), ("+", "1")]


def build_teacher_tokenizer(folder):
    """Another tokenizer: BPE over the same characters in another id order, seven merges (multi-
    character tokens whose splits look ahead), and a ChatML end of turn."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from helpers.tiny import CHARS

    pieces = [*reversed(CHARS), *("".join(m) for m in MERGES)]
    vocab = {"<|im_end|>": 0, "<pad>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    tok = Tokenizer(models.BPE(vocab, MERGES))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    fast.save_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory):
    from helpers.tiny import build_model

    root = tmp_path_factory.mktemp("other_teacher")
    tok = build_teacher_tokenizer(root / "tokenizer")
    model = build_model(root / "teacher", len(tok), hidden=32, layers=2, seed=5)
    return tok, model


def _batch(student_tok, prompts, responses):
    from opd_exp.training.batch import Batch
    from opd_exp.training.rollout import encode_prompts

    ids, mask = encode_prompts(student_tok, prompts, 8)
    R = max(len(r) for r in responses)
    rows = [student_tok(r, add_special_tokens=False)["input_ids"] for r in responses]
    eos = student_tok.eos_token_id
    resp = torch.full((len(rows), R + 1), student_tok.pad_token_id, dtype=torch.long)
    lengths = []
    for i, (r, text) in enumerate(zip(rows, responses)):
        ended = not text.endswith("~")  # '~': a row cut at the length cap (no end of turn)
        r = r if ended else student_tok(text[:-1], add_special_tokens=False)["input_ids"]
        full = r + ([eos] if ended else [])
        resp[i, : len(full)] = torch.tensor(full)
        lengths.append(len(full))
    return Batch.from_responses(ids, mask, resp, [eos], lengths=torch.tensor(lengths))


def _canonical_logprob(model, tok, prompt, text, ended):
    """log T_canon: the teacher's own tokens of the text (then its end), one unpadded sequence."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(text, add_special_tokens=False)["input_ids"] + ([tok.convert_tokens_to_ids("<|im_end|>")] if ended else [])
    ids = torch.tensor([p + r])
    with torch.no_grad():
        z = model(input_ids=ids).logits[0, len(p) - 1 : -1, : len(tok)].float()
    return float(z.log_softmax(-1).gather(-1, torch.tensor(r)[:, None]).sum()), r


@pytest.mark.parametrize("placement", ["sequence", "chunk"])
def test_other_tokenizer_payload_is_the_canonical_teacher_logprob(tiny_dir, other_teacher, placement):
    from transformers import AutoTokenizer

    from opd_exp.training.teacher_align import ByteAlignedTeacher

    s_tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    t_tok, t_model = other_teacher
    prompts = ["3+4=", "9+1=", "5+6=", "1+2="]
    texts = ["7890", "12+1;", "", "3456 10~"]  # the last row is cut (no end of turn)
    batch = _batch(s_tok, prompts, texts)
    scorer = ByteAlignedTeacher(t_model, s_tok, t_tok, temperature=1.0, device="cpu", placement=placement)
    t = scorer.score(batch).sampled_logprobs
    m = batch.response_mask
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        ended = not text.endswith("~")
        want, _ = _canonical_logprob(t_model, t_tok, prompt, text.rstrip("~"), ended)
        n = int(m[i].sum())
        assert float(t[i, :n].double().sum()) == pytest.approx(want, rel=1e-5, abs=1e-5)  # the costs sum to log S - log T_canon
        if placement == "sequence":
            assert torch.all(t[i, : n - 1] == 0) and t[i, n - 1] != 0
        assert torch.all(t[i, n:] == 0)
    # "7890" + end: student 7|8|9|0|<eos>, teacher 78|90|<|im_end|>: chunks (7,8) (9,0) (<eos>)
    _, rows = scorer.teacher_rows(batch)
    assert [(c.student, c.teacher) for c in rows[0][1]] == [((0, 2), (0, 1)), ((2, 4), (1, 2)), ((4, 5), (2, 3))]
    metrics = scorer.metrics()
    assert 1.0 < metrics["align/chunk_tokens_mean"] < 2.0 and 0.0 < metrics["align/one_to_one_rate"] < 1.0
    assert scorer.metrics() == {}  # per step: reset after reading


@pytest.mark.parametrize("extra", [None, LOO], ids=["no_baseline", "loo"])
def test_other_tokenizer_trains_through_the_trainer(tiny_dir, other_teacher, tmp_path, extra):
    t_tok, t_model = other_teacher
    pair = _pair(tiny_dir, teacher_tokenizer=t_tok)
    pair.teacher = t_model
    rows = _run(tmp_path, pair, extra, align="bytes")
    assert len(rows) == 3
    for r in rows:
        assert r["loss"] == r["loss"] and r["align/chunk_tokens_mean"] >= 1.0 and 0.0 <= r["align/one_to_one_rate"] <= 1.0
        assert ("estimator/baseline" in r) == (extra is not None)


@pytest.mark.parametrize(
    "groups,message",
    [
        (dict(estimator=dict(name="full")), "estimator.name='full' is not allowed; allowed: sampled with teacher.align=bytes"),
        (dict(divergence=dict(name="jsd")), "divergence.name='jsd' is not allowed; allowed: rkl with teacher.align=bytes"),
        (dict(loss=dict(name="reinforce", credit="token")), "loss.credit='token' is not allowed; allowed: loss.credit=sequence"),
        (dict(loss=dict(name="reinforce", credit="sequence", gamma=0.9)), "loss.gamma=0.9 is not allowed"),
        (dict(estimator=dict(name="sampled", baseline="exact")), "estimator.baseline='exact' is not allowed; allowed: none or loo"),
        (dict(teacher=dict(align="bytes", name="ema")), "teacher.name='ema' is not allowed; allowed: in_process"),
        (
            dict(teacher=dict(align="bytes", align_placement="token")),
            "teacher.align_placement='token' is not allowed; allowed: sequence | chunk",
        ),
        (dict(teacher=dict(align="chars")), "teacher.align='chars' is not allowed; allowed: none | bytes"),
    ],
)
def test_what_it_cannot_feed_is_refused_in_one_line(groups, message):
    merged = {**EXACT_GROUPS, "teacher": dict(align="bytes")}
    for k, v in groups.items():
        merged[k] = {**merged.get(k, {}), **v}
    with pytest.raises(ConfigError) as e:
        small_config(**merged)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_token_credit_named_on_purpose_is_allowed():
    cfg = small_config(
        **{**EXACT_GROUPS, "loss": dict(name="reinforce", credit="token"), "teacher": dict(align="bytes", align_biased=True)}
    )
    assert cfg.teacher.align_biased


def test_chunk_placement_with_another_tokenizer_and_unmappable_ends_are_refused(tiny_dir, other_teacher, tmp_path):
    t_tok, t_model = other_teacher
    pair = _pair(tiny_dir, teacher_tokenizer=t_tok)
    pair.teacher = t_model
    with pytest.raises(ConfigError, match="teacher.align_placement='chunk' is not allowed with a teacher whose tokenizer"):
        _run(tmp_path / "a", pair, align="bytes", align_placement="chunk")
    from transformers import AutoTokenizer

    from opd_exp.training.teacher_align import ByteAlignedTeacher

    s_tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    no_end = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    no_end.eos_token = None
    with pytest.raises(ConfigError, match="end cannot be mapped"):
        ByteAlignedTeacher(t_model, s_tok, no_end, temperature=1.0, device="cpu")


class TemplateTask(AddTask):
    """AddTask asked through each tokenizer's chat template (where it has one)."""

    def render_prompt(self, problem, tokenizer):
        from opd_exp.tasks.base import render_prompt

        return render_prompt(problem.prompt, tokenizer)


@pytest.mark.parametrize("own_template", [True, False], ids=["teacher_template", "no_template"])
def test_the_teacher_is_asked_through_its_own_chat_template(tiny_dir, other_teacher, tmp_path, own_template):
    """A teacher with another tokenizer and a chat template of its own reads the problem rendered with
    that template (the student samples from its own); a teacher without one (a base model) reads the
    student's rendering."""
    import copy

    t_tok, t_model = other_teacher
    t_tok = copy.deepcopy(t_tok)
    # a template in characters the student's tokenizer holds (a byte-level one holds any)
    t_tok.chat_template = "{% for m in messages %}# {{ m['content'] }};{% endfor %}" if own_template else None
    pair = _pair(tiny_dir, teacher_tokenizer=t_tok)
    pair.teacher = t_model
    task = TemplateTask()
    trainer = Trainer(small_config(**{**EXACT_GROUPS, "teacher": dict(align="bytes")}), tmp_path, pair=pair, task=task)
    batch = trainer.sample(0)
    view, _ = trainer.teacher_scorer.teacher_rows(batch)
    by_student = {task.render_prompt(p, pair.tokenizer): p for p in task.train_problems()}
    for i in range(batch.num_sequences):
        P = batch.prompt_len
        student_prompt = pair.tokenizer.decode(batch.input_ids[i, :P][batch.attention_mask[i, :P].bool()].tolist())
        problem = by_student[student_prompt]
        teacher_ids = view.input_ids[i, : view.prompt_len][view.attention_mask[i, : view.prompt_len].bool()].tolist()
        want = task.render_prompt(problem, t_tok if own_template else pair.tokenizer)
        assert teacher_ids == t_tok(want, add_special_tokens=False)["input_ids"]
        assert (want != student_prompt) == own_template


def test_a_teacher_template_the_student_cannot_hold_is_one_line(tiny_dir, other_teacher, tmp_path):
    """The teacher's rendering reaches the byte-aligned teacher as the student tokenizer's ids of its
    text: a template with characters the student's tokenizer maps to an unknown token is refused."""
    t_tok, t_model = other_teacher  # its template writes <|im_end|>, which the character-level student cannot
    pair = _pair(tiny_dir, teacher_tokenizer=t_tok)
    pair.teacher = t_model
    with pytest.raises(ConfigError) as e:  # when the trainer is built, before any step
        Trainer(small_config(**{**EXACT_GROUPS, "teacher": dict(align="bytes")}), tmp_path, pair=pair, task=TemplateTask())
    assert str(e.value).startswith("the teacher's chat template renders a prompt the student's tokenizer does not keep (")
    assert "\n" not in str(e.value)
