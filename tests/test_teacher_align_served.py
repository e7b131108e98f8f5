"""A teacher with another tokenizer (``teacher.align=bytes``) served by ``opd-serve-teacher``, and what the
byte-aligned path got wrong before:

- served (a stand-in server here; marked ``vllm``: a real ``opd-serve-teacher`` vLLM process) gives the
  in-process ``teacher.align=bytes`` losses to 1e-6 relative on a tiny cross-tokenizer pair; a server
  with another tokenizer than the teacher's own is refused in one line; routed teachers are allowed
  (tests/test_routed_align.py) except on the shared vocabulary;
- ``eval/teacher_accuracy`` asks the teacher in its own tokens and chat template (it was given the
  student's ids);
- ``perf/teacher_s`` counts the byte-aligned teacher (it was 0);
- a teacher tokenizer that prepends a BOS (Gemma, Llama) has it at the start of the teacher's prompt,
  exactly once (it had none)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from types import SimpleNamespace

import pytest
import torch

from helpers import golden
from helpers.fake_vllm import FakeVllm
from helpers.tiny import CHARS, AddTask, build_llama_teacher, build_model, small_config
from opd_exp.config.schema import TeacherConfig
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.trainer import Trainer

GROUPS = dict(
    estimator=dict(name="sampled", baseline="none"),
    divergence=dict(name="rkl"),
    loss=dict(name="reinforce", credit="sequence", gamma=1.0),
    trainer=dict(max_steps=3),
    rollout=dict(max_new_tokens=6, max_prompt_tokens=8),
)
MERGES = [("1", "2"), ("3", "4"), ("5", "6"), ("7", "8"), ("9", "0"), ("1", "0"), ("+", "1")]


def teacher_tokenizer(folder, *, bos: bool = False):
    """Another tokenizer than the tiny student's: BPE over the same characters in another id order, with
    merges, a decoder that joins its pieces, a ChatML-like end of turn and chat template; ``bos``: a ``<s>``
    its tokenizer prepends (as Gemma's and Llama's do) and its template writes."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    pieces = [*reversed(CHARS), *("".join(m) for m in MERGES)]
    specials = ["<|im_end|>", "<pad>", *(["<s>"] if bos else [])]
    vocab = {**{s: i for i, s in enumerate(specials)}, **{p: i + len(specials) for i, p in enumerate(pieces)}}
    tok = Tokenizer(models.BPE(vocab, MERGES))
    tok.decoder = decoders.Fuse()  # '78', '90' decode to '7890' (no decoder: '78 90')
    extra = {}
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
        extra["bos_token"] = "<s>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", **extra)
    fast.chat_template = ("{{ bos_token }}" if bos else "") + "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def teacher_model(folder, vocab_size: int, seed: int):
    """The teacher's tiny Llama (``build_llama_teacher``): head size 32, untied."""
    build_llama_teacher(folder, vocab_size, seed, hidden=64, tied=False)


def assert_own_bpe(t_tok, rows: int):
    """The teacher folder's tokenizer is the fixture's BPE, merges included, with one token per output row."""
    assert t_tok.tokenize("7890+12") == ["78", "90", "+", "12"], type(t_tok).__name__
    assert t_tok("78", add_special_tokens=False)["input_ids"] == [t_tok.convert_tokens_to_ids("78")]
    assert len(t_tok) == rows == len(CHARS) + len(MERGES) + 2
    assert t_tok.decode(t_tok("7890+12", add_special_tokens=False)["input_ids"]) == "7890+12"


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    """The tiny student's folder and a teacher folder with its own tokenizer (a BPE with merges: '7890' is
    78|90), exactly as many output rows as tokens (a server normalises over every row), and a head size a
    CPU vLLM supports."""
    from transformers import AutoConfig, AutoTokenizer

    from helpers.tiny import build_tokenizer

    root = tmp_path_factory.mktemp("cross")
    s_tok = build_tokenizer(root / "student")
    build_model(root / "student", len(s_tok), hidden=32, layers=1, seed=1)
    teacher_model(root / "teacher", len(teacher_tokenizer(root / "teacher")), seed=5)
    t_tok = AutoTokenizer.from_pretrained(root / "teacher")  # as the pair loader and the server load it
    assert_own_bpe(t_tok, AutoConfig.from_pretrained(root / "teacher").vocab_size)
    return SimpleNamespace(root=root, student=root / "student", teacher=root / "teacher", s_tok=s_tok, t_tok=t_tok)


def test_the_teacher_folder_reloads_its_own_bpe_tokenizer(cross):
    """What makes the pair cross-tokenizer beyond a reordered vocabulary: the reloaded teacher tokenizer
    merges ('7890' is 78|90, '12' one token), and its size is the teacher model's rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_tok = AutoTokenizer.from_pretrained(cross.teacher)
    rows = AutoModelForCausalLM.from_pretrained(cross.teacher).get_output_embeddings().weight.shape[0]
    assert_own_bpe(t_tok, rows)
    assert_own_bpe(cross.t_tok, rows)
    s = cross.s_tok("7890+12", add_special_tokens=False)["input_ids"]
    t = t_tok("7890+12", add_special_tokens=False)["input_ids"]
    assert len(s) == 7 and len(t) == 4


def load_pair(cross):
    from transformers import AutoModelForCausalLM

    return SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(cross.student),
        teacher=AutoModelForCausalLM.from_pretrained(cross.teacher),
        tokenizer=cross.s_tok,
        vocab_size=len(cross.s_tok),
        teacher_tokenizer=cross.t_tok,
    )


def metric_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(run_dir, pair, task=None, **teacher):
    Trainer(small_config(**{**GROUPS, "teacher": {"align": "bytes", **teacher}}), run_dir, pair=pair, task=task or AddTask()).run()
    return metric_rows(run_dir)


def steps(rows):
    return [r for r in rows if "loss" in r]


def served(url: str, **fields) -> dict:
    return dict(name="served", url=url, retries=0, backoff_s=0.0, timeout_s=30.0, **fields)


KEYS = ("loss", "kl/reverse", "advantages/mean", "student/logprob_mean", "teacher/logprob_mean", "align/chunk_tokens_mean")


def assert_same_losses(a, b, rel):
    assert len(a) == len(b) == GROUPS["trainer"]["max_steps"]
    for ra, rb in zip(a, b):
        for key in KEYS:
            assert rb[key] == pytest.approx(ra[key], rel=rel, abs=1e-9), key


# -- served: the same losses as in process --------------------------------------------------------


def test_served_cross_tokenizer_teacher_gives_the_in_process_losses(cross, tmp_path):
    """The stand-in server scores the teacher's own ids with the teacher (its tokenizer the teacher's):
    per-step losses equal the in-process align=bytes run's to 1e-6 relative; the run records the server.
    Float64 (the scorer still rounds the teacher's logits to float32): in float32 the server's unpadded
    rows and the in-process padded batch differ by ~2e-7 nats a token (the self-test's in_process line),
    ~1e-6 relative on kl/reverse; in float64 only a float32 rounding flips now and then (~1e-7)."""
    with golden.float64():
        local = steps(run(tmp_path / "local", load_pair(cross)))
        pair = load_pair(cross)
        server = FakeVllm(pair.teacher, cross.t_tok, len(cross.t_tok))
        try:
            rows = run(tmp_path / "served", pair, **served(server.url))
        finally:
            server.stop()
    assert_same_losses(local, steps(rows), rel=1e-6)
    assert any(r["align/chunk_tokens_mean"] > 1 for r in local)  # some sampled text has a merge ('12', '78', ...)
    assert server.completions > 3  # the self-test's, then the steps' requests
    state = json.loads(next((tmp_path / "served").glob("checkpoints/step_*/state.json")).read_text())
    assert state["config"]["teacher.server.k"] == 1  # the actual token's log-prob is all it needs


def batch_of(s_tok, prompts, responses):
    """Left-padded prompts and the student's (one character a token) ids of each response, ended by its EOS."""
    from opd_exp.training.batch import Batch
    from opd_exp.training.rollout import encode_prompts

    ids, mask = encode_prompts(s_tok, prompts, 8)
    eos = s_tok.eos_token_id
    rows = [s_tok(r, add_special_tokens=False)["input_ids"] + [eos] for r in responses]
    resp = torch.full((len(rows), max(map(len, rows))), s_tok.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        resp[i, : len(r)] = torch.tensor(r)
    return Batch.from_responses(ids, mask, resp, [eos], lengths=torch.tensor([len(r) for r in rows]))


def test_served_payload_with_merged_chunks_is_the_in_process_payload(cross):
    """Responses the teacher merges ('7890' is 78|90: chunks of two student tokens, '+12' two teacher tokens
    over three student ones): the served scorer's chunk payload is the in-process one's (float64 models; the
    float32 payload differs by a rounding at most)."""
    from opd_exp.training.teachers import build_teacher_scorer

    prompts, texts = ["3+4=", "12+1=", "5+6=", "7+8="], ["7890", "13+12", "1", "56 78;"]
    quiet = dict(device="cpu", warn=lambda _line: None, teacher_tokenizer=cross.t_tok)
    with golden.float64():
        pair = load_pair(cross)
        pair.teacher.double().eval()
        batch = batch_of(cross.s_tok, prompts, texts)
        local = build_teacher_scorer(
            small_config(**GROUPS, teacher=dict(align="bytes")), pair.teacher, cross.s_tok, len(cross.s_tok), **quiet
        )
        want = local.score(batch).sampled_logprobs
        counts = local.counts()
        server = FakeVllm(pair.teacher, cross.t_tok, len(cross.t_tok))
        try:
            cfg = small_config(**GROUPS, teacher=dict(align="bytes", **served(server.url)))
            scorer = build_teacher_scorer(cfg, pair.teacher, cross.s_tok, len(cross.s_tok), **quiet)
            got = scorer.score(batch).sampled_logprobs
            scorer.close()
        finally:
            server.stop()
    chunks, tokens, one_to_one, _rows = counts
    assert tokens > chunks and one_to_one < chunks  # merged chunks were scored
    assert (want != 0).any() and torch.allclose(got, want, rtol=1e-6, atol=1e-9)


def test_a_server_with_another_tokenizer_than_the_teachers_is_one_line(cross, tmp_path):
    pair = load_pair(cross)
    server = FakeVllm(pair.teacher, cross.s_tok, len(cross.t_tok))  # the student's tokenizer behind the teacher's name
    try:
        with pytest.raises(ConfigError) as err:
            Trainer(small_config(**{**GROUPS, "teacher": {"align": "bytes", **served(server.url)}}), tmp_path, pair=pair, task=AddTask())
    finally:
        server.stop()
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"teacher.url={server.url} (model 'teacher'): the server tokenizes a probe string")
    assert "the teacher's own tokenizer (model_pair.teacher's, teacher.align=bytes)" in line and "another tokenizer; allowed:" in line
    assert server.completions == 0


def test_routed_teachers_with_another_tokenizer_are_refused_only_on_the_shared_vocabulary():
    """Routed byte-aligned teachers are allowed (tests/test_routed_align.py); their shared-vocabulary payloads are not."""
    from opd_exp.config.teacher import validate_teacher
    from opd_exp.config.teachers import TeachersConfig, TeacherSource

    cfg = small_config(**GROUPS)
    teachers = TeachersConfig(
        map={"a": TeacherSource(path="/models/a"), "b": TeacherSource(path="/models/b", covers=["+"])}, route="operator"
    )
    validate_teacher(dataclasses.replace(cfg, teacher=TeacherConfig(align="bytes"), teachers=teachers))
    with pytest.raises(ConfigError) as err:
        validate_teacher(dataclasses.replace(cfg, teacher=TeacherConfig(align="bytes", align_vocab="shared"), teachers=teachers))
    line = str(err.value)
    assert "\n" not in line and line.startswith("teacher.align_vocab='shared' is not allowed; allowed: none with teachers.map")


# -- the bugs -------------------------------------------------------------------------------------


class OwnAnswers(AddTask):
    """AddTask whose prompts go through the chat template (where a tokenizer has one) and whose answers
    are given: the teacher's own greedy completions, so a teacher asked in its own tokens scores 1."""

    def __init__(self, answers: dict[str, str]):
        super().__init__()
        self.answers = answers
        self._eval = [dataclasses.replace(p, answer=answers.get(p.prompt, p.answer)) for p in self._eval]

    def render_prompt(self, problem, tokenizer):
        from opd_exp.tasks.base import render_prompt

        return render_prompt(problem.prompt, tokenizer)

    def extract_answer(self, completion: str) -> str:
        return completion.strip()


def test_eval_teacher_accuracy_asks_the_teacher_in_its_own_tokens(cross, tmp_path):
    """Before: the teacher was given the student's ids (and decoded with the student's tokenizer)."""
    import copy

    from opd_exp.training.evaluate import evaluate_accuracy

    pair = load_pair(cross)
    # the teacher's own chat template, in characters the character-level student's tokenizer holds
    pair.teacher_tokenizer = copy.deepcopy(cross.t_tok)
    pair.teacher_tokenizer.chat_template = "{% for m in messages %}# {{ m['content'] }}{% endfor %}"
    problems = AddTask().eval_problems()[:4]
    want = evaluate_accuracy(pair.teacher, pair.teacher_tokenizer, OwnAnswers({}), problems, max_new_tokens=6, return_completions=True)
    answers = {p.prompt: c.strip() for p, c in zip(problems, want["completions"])}
    assert len(set(answers.values())) > 1  # the teacher says different things: an accuracy of 1 means something
    rows = run(tmp_path, pair, task=OwnAnswers(answers))
    accs = [r["eval/teacher_accuracy"] for r in rows if "eval/teacher_accuracy" in r]
    assert accs and all(a == 1.0 for a in accs)


def test_perf_teacher_s_counts_the_byte_aligned_teacher(cross, tmp_path):
    rows = steps(run(tmp_path, load_pair(cross)))
    assert rows and all(r["perf/teacher_s"] > 0 and r["perf/teacher_tokens_per_s"] > 0 for r in rows)
    assert all(r["perf/train_s"] > 0 for r in rows)


def test_a_teacher_tokenizer_that_prepends_a_bos_gets_it_once(cross, tmp_path):
    """Gemma/Llama-like: ``<s>`` first in the teacher's prompt, once, whether the prompt text has it or not;
    the payload is the teacher's log-prob of its canonical tokens after ``<s>`` + prompt."""
    from opd_exp.training.batch import Batch
    from opd_exp.training.rollout import encode_prompts
    from opd_exp.training.teacher_align import ByteAlignedTeacher, bos_prepended

    t_tok = teacher_tokenizer(tmp_path / "bos", bos=True)
    bos = t_tok.convert_tokens_to_ids("<s>")
    assert bos_prepended(t_tok) == bos and bos_prepended(cross.t_tok) is None and bos_prepended(cross.s_tok) is None
    model = build_model(tmp_path / "bos_teacher", len(t_tok), hidden=32, layers=2, seed=7)
    s_tok = cross.s_tok
    prompts, texts = ["3+4=", "12+1="], ["7", "13"]
    ids, mask = encode_prompts(s_tok, prompts, 8)
    eos = s_tok.eos_token_id
    rows = [s_tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    resp = torch.full((2, max(map(len, rows))), s_tok.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        resp[i, : len(r)] = torch.tensor(r)
    batch = Batch.from_responses(ids, mask, resp, [eos], lengths=torch.tensor([len(r) for r in rows]))
    # a teacher whose chat template writes the BOS itself, its prompt carried as the student's ids of that text
    # (a student tokenizer that holds '<s>', as a byte-level one holds any text)
    import copy

    from opd_exp.tasks.base import Problem
    from opd_exp.training.teacher_prompt import TeacherPrompt

    s_bos = copy.deepcopy(s_tok)
    s_bos.add_special_tokens({"additional_special_tokens": ["<s>"]})
    t_template = copy.deepcopy(t_tok)
    t_template.chat_template = "<s>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    problems = [Problem(prompt=p, answer="", solution="") for p in prompts]
    asked = TeacherPrompt(OwnAnswers({}), s_bos, "none", 8, render_with=lambda k: t_template).attach(batch, problems)
    assert s_bos.decode(asked.teacher_view.input_ids[0][asked.teacher_view.attention_mask[0].bool()][:2].tolist()).startswith("<s>")
    for tok, rows_of in ((s_tok, batch), (s_bos, asked)):
        scorer = ByteAlignedTeacher(model, tok, t_tok, temperature=1.0, device="cpu")
        view, _ = scorer.teacher_rows(rows_of)
        P = view.prompt_len
        for i, prompt in enumerate(prompts):
            got = view.input_ids[i, :P][view.attention_mask[i, :P].bool()].tolist()
            assert got == [bos, *t_tok(prompt, add_special_tokens=False)["input_ids"]]
        t = scorer.score(rows_of).sampled_logprobs
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            p = t_tok(prompt, add_special_tokens=True)["input_ids"]  # <s> + prompt
            r = t_tok(text, add_special_tokens=False)["input_ids"] + [t_tok.convert_tokens_to_ids("<|im_end|>")]
            with torch.no_grad():
                z = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1, : len(t_tok)].float()
            want = float(z.log_softmax(-1).gather(-1, torch.tensor(r)[:, None]).sum())
            assert float(t[i].double().sum()) == pytest.approx(want, rel=1e-5, abs=1e-5)


# -- a real opd-serve-teacher (vLLM's CPU build) ---------------------------------------------------


# what teacher.align=bytes trains (the server composes opd-train's config, so it must be one that validates)
RECIPE = ["estimator=sampled", "estimator.baseline=none", "divergence=rkl", "loss=reinforce", "loss.credit=sequence"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_opd_serve_teacher_serves_a_cross_tokenizer_teacher(cross, tmp_path):
    """``opd-serve-teacher model_pair=local ... teacher.align=bytes`` (a vLLM process, CPU, fp32) on the tiny
    cross-tokenizer pair: per-step losses equal the in-process align=bytes run's to 1e-6 relative."""
    from opd_exp.cli.serve_teacher import TeacherServer, options_from_args

    argv = [
        "model_pair=local",
        f"model_pair.student={cross.student}",
        f"model_pair.teacher={cross.teacher}",
        *RECIPE,
        "teacher.align=bytes",
    ]
    options = options_from_args([*argv, f"port={free_port()}", "max_model_len=128", "kv_cache_gib=1"])
    assert options.align == "bytes" and options.folder == str(cross.teacher.resolve())
    local = steps(run(tmp_path / "local", load_pair(cross)))
    with TeacherServer(options).start(ready_s=float(os.environ.get("OPD_VLLM_READY_S", "600"))) as server:
        rows = steps(run(tmp_path / "served", load_pair(cross), **served(server.o.url)))
    print("in process", [r["loss"] for r in local], "served", [r["loss"] for r in rows])
    assert_same_losses(local, rows, rel=1e-6)
    assert server.proc.poll() is not None


def test_opd_serve_teacher_prints_the_align_override(cross):
    from opd_exp.cli.serve_teacher import options_from_args

    argv = ["model_pair=local", f"model_pair.student={cross.student}", f"model_pair.teacher={cross.teacher}", "port=8001"]
    assert options_from_args(argv).align == "none"
    assert options_from_args([*argv, *RECIPE, "teacher.align=bytes"]).align == "bytes"
