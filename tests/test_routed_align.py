"""Routed teachers (``teachers.map``) with other tokenizers (``teacher.align=bytes``): each row goes to
its domain's teacher, which renders the row for its own tokenizer and scores its own tokens; the chunk
payloads, all on the student's positions, are laid back row by row.

- row for row, the routed payload is exactly what that teacher's own in-process ``teacher.align=bytes``
  scorer gives for the row (float64, 1e-9), and another teacher's is far from it (so a wrong route fails);
- every row routed to one teacher: the Trainer's losses are the single-teacher align=bytes run's;
- two teachers with two tokenizers train through the Trainer, with per-teacher metrics and accuracies;
- what stays refused is one line naming the key, the value and what is allowed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from helpers import golden
from helpers.tiny import CHARS, AddTask, build_llama_teacher, build_model, build_tokenizer, small_config
from opd_exp.config.teachers import TeachersConfig
from opd_exp.pairs.teacher_map import load_map_teacher
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.batch import Batch
from opd_exp.training.teacher_set import TeacherSet
from opd_exp.training.teachers import build_teacher_scorer
from opd_exp.training.trainer import Trainer

GROUPS = dict(
    estimator=dict(name="sampled", baseline="none"),
    divergence=dict(name="rkl"),
    loss=dict(name="reinforce", credit="sequence", gamma=1.0),
    trainer=dict(max_steps=2),
    rollout=dict(max_new_tokens=6, max_prompt_tokens=8),
    teacher=dict(align="bytes"),
)
# two teachers, two tokenizers, neither the student's: each merges other digits
MERGES = {
    "add": [("1", "2"), ("3", "4"), ("5", "6"), ("7", "8"), ("9", "0"), ("1", "0"), ("+", "1")],
    "sub": [("2", "3"), ("4", "5"), ("6", "7"), ("8", "9"), ("-", "1"), ("0", "1")],
}


def bpe_tokenizer(folder, merges):
    """A BPE tokenizer over the tiny student's characters (another id order), ``merges``, a ChatML end of turn."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    pieces = [*reversed(CHARS), *("".join(m) for m in merges)]
    vocab = {"<|im_end|>": 0, "<pad>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, merges)), pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny student, and one teacher folder per domain holding its model and its own tokenizer."""
    root = tmp_path_factory.mktemp("routed_align")
    s_tok = build_tokenizer(root / "student")
    build_model(root / "student", len(s_tok), hidden=32, layers=1, seed=1)
    for seed, (name, merges) in enumerate(MERGES.items(), start=5):
        teacher_model(root / name, len(bpe_tokenizer(root / name, merges)) + 8, seed=seed)  # padded rows
    return root


def teacher_model(folder, vocab_size: int, seed: int):
    """A map teacher's tiny Llama (``build_llama_teacher``)."""
    build_llama_teacher(folder, vocab_size, seed)


def own(world, name: str, *, double: bool = False):
    """(model, tokenizer) of a teacher, loaded afresh from its folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(world / name).eval()
    return (model.double() if double else model), AutoTokenizer.from_pretrained(world / name)


def pair_of(world, teacher: str = "add", *, double: bool = False):
    """The student with ``teacher`` as the pair's own teacher (with its own tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s_tok = AutoTokenizer.from_pretrained(world / "student")
    student = AutoModelForCausalLM.from_pretrained(world / "student")
    model, t_tok = own(world, teacher, double=double)
    return SimpleNamespace(
        student=student.double() if double else student, teacher=model, tokenizer=s_tok, vocab_size=len(s_tok), teacher_tokenizer=t_tok
    )


@dataclass(frozen=True)
class Row:
    prompt: str
    answer: str
    solution: str
    domain: str  # teachers.route=field:domain


class DomainTask(AddTask):
    """'a+b=' (domain add) and 'a-b=' (domain sub) prompts; ``ops='+'``: every prompt is add's."""

    def __init__(self, ops: str = "+-"):
        make = lambda a, op, b: Row(f"{a}{op}{b}=", str(a + b if op == "+" else a - b), "", "add" if op == "+" else "sub")
        every = [make(a, op, b) for a in range(10) for b in range(10) for op in ops]
        self._eval = every[-8:]
        self._train = (every[:-8] * 2)[:64]


def routed(world, urls=None, **groups):
    """The run's config with one teacher per domain (``urls``: each one's server, teacher=served)."""
    urls = urls or {}
    entries = {n: {"path": str(world / n), "covers": [n], **({"url": urls[n]} if n in urls else {})} for n in MERGES}
    return small_config(**{**GROUPS, **groups, "teachers": dict(route="field:domain", map=entries)})


def batch_of(s_tok, prompts, responses):
    """Left-padded prompts and the student's tokens of each response ('~' at the end: a row cut at the cap)."""
    from opd_exp.training.rollout import encode_prompts

    ids, mask = encode_prompts(s_tok, prompts, 8)
    eos = s_tok.eos_token_id
    rows = [s_tok(r.rstrip("~"), add_special_tokens=False)["input_ids"] + ([] if r.endswith("~") else [eos]) for r in responses]
    resp = torch.full((len(rows), max(map(len, rows))), s_tok.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        resp[i, : len(r)] = torch.tensor(r)
    return Batch.from_responses(ids, mask, resp, [eos], lengths=torch.tensor([len(r) for r in rows]))


PROMPTS = ["3+4=", "9-1=", "5+6=", "7-2=", "1-0=", "2+2="]
TEXTS = ["7890", "23 45;", "12+1", "6789 1~", "01-1", "56~"]


def test_routed_payload_is_each_teachers_own_row_for_row(world):
    """Each row's payload is its teacher's own byte-aligned scorer's for that row alone (float64 models, 1e-9);
    the other teacher's payload for the row is far from it, and routes flipped give other payloads; the
    pooled align/* are the sums of the teachers' own counts."""
    problems = [Row(p, "", "", "add" if "+" in p else "sub") for p in PROMPTS]
    with golden.float64():
        cfg = routed(world)
        pair = pair_of(world, double=True)
        _, teachers = TeacherSet.load(cfg, pair, torch.device("cpu"), dict(training=problems), load_map_teacher)
        assert [t.tokenize("7890 12") for t in teachers.tokenizers] == [["78", "90", " ", "12"], ["7", "89", "0", " ", "1", "2"]]
        quiet = dict(device="cpu", autocast=contextlib.nullcontext, warn=lambda _line: None)
        scorer = teachers.scorer(pair.tokenizer, pair.vocab_size, autocast=contextlib.nullcontext, warn=lambda _line: None)
        batch = teachers.route(problems, batch_of(pair.tokenizer, PROMPTS, TEXTS))
        assert batch.route.tolist() == [0, 1, 0, 1, 1, 0]
        got = scorer.score(batch)
        assert got.logits is None  # sampled-only (float32: the teacher's logits are fp32 even in a float64 run)
        single = small_config(**GROUPS)
        alone = {}
        for name in MERGES:  # each teacher's own in-process align=bytes scorer, from its own folder
            model, tok = own(world, name, double=True)
            alone[name] = build_teacher_scorer(single, model, pair.tokenizer, pair.vocab_size, teacher_tokenizer=tok, **quiet)
        want = {name: torch.cat([s.score(batch.select([i])).sampled_logprobs for i in range(len(PROMPTS))]) for name, s in alone.items()}
        for s in alone.values():
            s.counts()  # reset: the rows' counts from their own teachers only, next
        for i, k in enumerate(batch.route.tolist()):
            alone[list(MERGES)[k]].score(batch.select([i]))
        counts = [sum(c) for c in zip(*(s.counts() for s in alone.values()))]
    names = list(MERGES)
    for i, k in enumerate(batch.route.tolist()):
        right, wrong = want[names[k]][i], want[names[1 - k]][i]
        assert torch.allclose(got.sampled_logprobs[i], right, rtol=0, atol=1e-9), (i, names[k])
        assert (got.sampled_logprobs[i] - wrong).abs().max() > 1e-2, (i, "the other teacher's payload is not far from it")
    assert got.route.tolist() == batch.route.tolist()
    # the test fails on a wrong route: the same batch with its routes flipped gives the other teachers' payloads
    with golden.float64():
        flipped = scorer.score(dataclasses.replace(batch, route=1 - batch.route)).sampled_logprobs
    assert not torch.allclose(flipped, got.sampled_logprobs, atol=1e-2)
    for i, k in enumerate(batch.route.tolist()):
        assert torch.allclose(flipped[i], want[names[1 - k]][i], rtol=0, atol=1e-9)
    metrics = scorer.metrics()  # both scorings' chunks: got's, then flipped's (twice the rows)
    chunks, tokens, one, rows = counts
    assert rows == len(PROMPTS)
    assert 1.0 < metrics["align/chunk_tokens_mean"] < 2.0 and 0.0 < metrics["align/one_to_one_rate"] < 1.0
    assert scorer.metrics() == {}
    scorer.score(batch)
    assert scorer.metrics() == {"align/chunk_tokens_mean": tokens / chunks, "align/one_to_one_rate": one / chunks}


def metric_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(cfg, run_dir, pair, task):
    Trainer(cfg, run_dir, pair=pair, task=task, load_map_teacher=load_map_teacher).run()
    return metric_rows(run_dir)


KEYS = ("loss", "kl/reverse", "advantages/mean", "student/logprob_mean", "teacher/logprob_mean", "align/chunk_tokens_mean")


def test_every_row_routed_to_one_teacher_gives_the_single_teacher_losses(world, tmp_path):
    """Only add's prompts: the map's losses are the single-teacher align=bytes run's (add as the pair's
    teacher) to 1e-6 relative over 2 steps; add takes every token, sub none."""
    task = DomainTask(ops="+")
    single = [r for r in train(small_config(**GROUPS), tmp_path / "single", pair_of(world), task) if "loss" in r]
    rows = [r for r in train(routed(world), tmp_path / "map", pair_of(world), task) if "loss" in r]
    assert len(single) == len(rows) == GROUPS["trainer"]["max_steps"]
    for a, b in zip(single, rows):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
        assert b["teacher/add/token_share"] == 1.0 and b["teacher/sub/token_share"] == 0.0
        assert b["teacher/add/kl_reverse"] == pytest.approx(a["kl/reverse"], rel=1e-6)
    # not vacuous: sub as the pair's one teacher gives other losses
    other = [r for r in train(small_config(**GROUPS), tmp_path / "sub", pair_of(world, "sub"), task) if "loss" in r]
    assert abs(other[0]["kl/reverse"] - single[0]["kl/reverse"]) > 1e-3 * abs(single[0]["kl/reverse"])


def test_two_teachers_with_two_tokenizers_train_through_the_trainer(world, tmp_path):
    """Both domains: each teacher takes its share of the tokens, the per-teacher kl/reverse add up to the
    step's, align/* are logged, and each teacher's eval accuracy is asked in its own tokens."""
    cfg = routed(world, eval=dict(every=2, size=8, batch_size=8))
    rows = train(cfg, tmp_path, pair_of(world), DomainTask())
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        shares = [r[f"teacher/{n}/token_share"] for n in MERGES]
        assert sum(shares) == pytest.approx(1.0) and all(0 < s < 1 for s in shares)
        total = sum(r[f"teacher/{n}/token_share"] * r[f"teacher/{n}/kl_reverse"] for n in MERGES)
        assert total == pytest.approx(r["kl/reverse"], rel=1e-5, abs=1e-7)
        assert r["align/chunk_tokens_mean"] >= 1.0 and 0.0 <= r["align/one_to_one_rate"] <= 1.0
    evals = [r for r in rows if "eval/teacher_accuracy" in r]
    assert evals and all(0.0 <= r[f"eval/teacher/{n}/teacher_accuracy"] <= 1.0 for r in evals for n in MERGES)


def test_what_stays_refused_is_one_line(world):
    with pytest.raises(ConfigError) as err:
        routed(world, estimator=dict(name="full"), teacher=dict(align="bytes", align_vocab="shared"))
    line = str(err.value)
    assert "\n" not in line and line.startswith("teacher.align_vocab='shared' is not allowed; allowed: none with teachers.map")
    assert routed(world).teachers.active  # the chunk payload, routed: allowed


def test_a_map_teacher_without_its_own_tokenizer_is_one_line(world, tmp_path):
    """A map teacher folder with no tokenizer files: its key, the folder, and what is allowed."""
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in (world / "add").glob("*.json"):
        if "token" not in f.name and f.name != "chat_template.jinja":
            shutil.copy(f, bare / f.name)
    shutil.copy(world / "add" / "model.safetensors", bare / "model.safetensors")
    cfg = dataclasses.replace(routed(world), teachers=TeachersConfig(map={"bare": {"path": str(bare)}}))
    with pytest.raises(ConfigError) as err:
        TeacherSet.load(cfg, pair_of(world), torch.device("cpu"), dict(training=[]), load_map_teacher)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"teachers.map.bare: cannot load a tokenizer from {str(bare)!r}")
    assert "allowed: a folder or hub id with tokenizer files" in line


def test_served_routed_teachers_give_the_in_process_losses(world, tmp_path):
    """Each teacher behind its own stand-in server (its own tokenizer): the routed run's losses are the
    in-process routed run's to 1e-6 relative, and every server was asked."""
    from helpers.fake_vllm import FakeVllm

    task = DomainTask()
    local = [r for r in train(routed(world), tmp_path / "local", pair_of(world), task) if "loss" in r]
    servers = {name: FakeVllm(*own(world, name), len(own(world, name)[1])) for name in MERGES}
    try:
        served = dict(align="bytes", name="served", retries=0, backoff_s=0.0, timeout_s=30.0)
        cfg = routed(world, {n: s.url for n, s in servers.items()}, teacher=served)
        rows = [r for r in train(cfg, tmp_path / "served", pair_of(world), task) if "loss" in r]
    finally:
        for s in servers.values():
            s.stop()
    assert len(local) == len(rows) == GROUPS["trainer"]["max_steps"]
    for a, b in zip(local, rows):
        for key in (*KEYS, *(f"teacher/{n}/kl_reverse" for n in MERGES)):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    assert all(s.completions > 1 for s in servers.values())  # the self-test's, then the steps' requests
