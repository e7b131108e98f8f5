"""The shared-vocabulary path (``teacher.align=bytes teacher.align_vocab=shared``): the dense and top-k
estimators fed a teacher with another tokenizer through a vocabulary map and a tail bucket at the
aligned one-to-one positions (``opd_exp/divergences/shared_vocab.py``, ``training/shared_vocab.py``).

By enumeration, on the tiny tokenizers and tabular models of ``test_cross_tokenizer_enumeration.py``
(alphabet {a, b} + end, strings of at most 3 characters, float64): the map and tail buckets by hand;
the completion over the student's vocabulary has the value and gradient of the coarse divergence for
every registered divergence; the project's Objective fed the scores follows exactly the gradient of
E_S[sum over one-to-one positions of D(S_c || T_c)] (computed here independently, from strings);
identical tokenizers give today's dense/top-k losses; the bias against the sequence-level
KL(S || T_canon) is measured; a changed map or tail bucket stops matching. Through the trainer: the
tiny same-tokenizer pair gives today's losses to 1e-6 relative, the scorer on a teacher with its own
BPE tokenizer returns the teacher's distribution at exactly the one-to-one chunks, and that pair trains
two steps with full and topk.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_cross_tokenizer_enumeration import AB, BA, CHAR, END, Student, Teacher, autograd, exact_sequence_kl, spans, text

from helpers.tiny import AddTask, small_config
from opd_exp.divergences import DIVERGENCES, get_divergence
from opd_exp.divergences.chunks import align_chunks
from opd_exp.divergences.shared_vocab import build_shared_vocab, coarse_logprobs, complete_teacher, project_teacher
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.objective import Objective
from opd_exp.training.scoring import TeacherScores
from opd_exp.training.shared_vocab import SharedVocabScores

PAIRS = {"ab_vs_ba": (AB, BA), "char_vs_ab": (CHAR, AB), "char_vs_char": (CHAR, CHAR)}


def teacher_log_dist(teacher: Teacher, prefix: tuple) -> torch.Tensor:
    """The tabular teacher's log-probs over its tokens after its tokens ``prefix`` (its own seeding)."""
    key = zlib.crc32(repr((teacher.seed, prefix)).encode())
    z = teacher.scale * torch.randn(len(teacher.tokens), generator=torch.Generator().manual_seed(key))
    return z.log_softmax(-1)


def aligned(seq, teacher):
    """(the teacher's canonical tokens of the student row's text, [(student pos, teacher pos)] of its one-to-one chunks)."""
    tseq = teacher.canonical(text(seq))
    return tseq, [(c.student[0], c.teacher[0]) for c in align_chunks(spans(seq), spans(tseq)) if c.one_to_one]


def shared_scores(seq, student, teacher, vocab) -> SharedVocabScores:
    """What ``SharedVocabTeacher.score`` returns for one row, from the tabular teacher."""
    tseq, pairs = aligned(seq, teacher)
    n = len(seq)
    shared, tail = torch.zeros(1, n, vocab.size), torch.zeros(1, n)
    one = torch.zeros(1, n, dtype=torch.bool)
    for i, j in pairs:
        shared[0, i], tail[0, i] = project_teacher(teacher_log_dist(teacher, tseq[:j]), vocab)
        one[0, i] = True
    return SharedVocabScores(shared=shared, tail=tail, one_to_one=one, vocab=vocab)


def student_row(student, seq):
    z = torch.stack([student.logits(seq[:i]) for i in range(len(seq))])[None]
    return z, torch.tensor([[student.tokens.index(t) for t in seq]])


def config(estimator="full", credit="sequence", divergence="rkl", k=2):
    loss = dict(name="reinforce", credit=credit, gamma=1.0, kl_coef=1.0) if credit == "sequence" else dict(name="direct", kl_coef=1.0)
    return small_config(estimator=dict(name=estimator, k=k), divergence=dict(name=divergence), loss=loss)


def expected_gradient(student, teacher, cfg, vocab, *, scores=shared_scores):
    """sum_y S(y) grad loss(y): the loss the project's Objective computes from the row's scores."""
    obj = Objective(cfg, teacher_k=None, vocab_size=len(student.tokens))
    total = torch.zeros_like(student.z)
    for seq in student.sequences():
        z, ids = student_row(student, seq)
        out = obj(z, scores(seq, student, teacher, vocab), ids, torch.ones_like(ids, dtype=torch.bool), on_policy=True, normalizer=1.0)
        (g,) = torch.autograd.grad(out.loss, student.z)
        total = total + student.token_logprobs(seq).sum().exp().detach() * g
    return total


def string_bins(student, teacher):
    """The coarse bins from the token strings alone (independent of the map code): the student's ids
    and the teacher's of each string both have, then everything else (each side's tail)."""
    common = [t for t in student.tokens if t in teacher.tokens]
    return [student.tokens.index(t) for t in common], [teacher.tokens.index(t) for t in common]


def coarse(lp, ids):
    """log-probs over ``ids`` then the log of the rest's mass (-inf when there is no rest)."""
    rest = [v for v in range(lp.shape[-1]) if v not in ids]
    tail = torch.logsumexp(lp[..., rest], -1, keepdim=True) if rest else torch.full((*lp.shape[:-1], 1), -math.inf)
    return torch.cat([lp[..., ids], tail], -1)


def shared_objective(student, teacher, divergence="rkl", *, prefix_frozen=False):
    """E_{y~S}[sum over one-to-one positions of D(S_c || T_c)] computed from strings (with grad);
    ``prefix_frozen``: the GKD form, S(y) held constant (what credit=token follows)."""
    d = get_divergence(divergence)
    s_ids, t_ids = string_bins(student, teacher)
    J = torch.zeros(())
    for seq in student.sequences():
        tseq, pairs = aligned(seq, teacher)
        row = torch.zeros(())
        for i, j in pairs:
            sc = coarse(student.logits(seq[:i]).log_softmax(-1), s_ids)
            tc = coarse(teacher_log_dist(teacher, tseq[:j]), t_ids)
            if not torch.isfinite(sc[-1]) and not torch.isfinite(tc[-1]):  # no tail on either side: no tail bin
                sc, tc = sc[:-1], tc[:-1]
            elif not torch.isfinite(sc[-1]):  # the student has no tail: the teacher renormalised over the shared ids
                sc, tc = sc[:-1], tc[:-1].log_softmax(-1)
            row = row + d.full(sc[None], tc[None])[0]
        w = student.token_logprobs(seq).sum().exp()
        J = J + (w.detach() if prefix_frozen else w) * row
    return J


def rel(a, b):
    return float((a - b).norm() / b.norm())


def cos(a, b):
    return float((a * b).sum() / (a.norm() * b.norm()))


# -- (a) the map and the tail buckets, by hand ---------------------------------------------------------


@pytest.mark.usefixtures("float64_default")
def test_map_and_tail_buckets_by_hand():
    # AB (a, b, ab, <end>) vs BA (a, b, ba, <end>): a, b and the end map; ab and ba are the tails
    vocab = build_shared_vocab([*AB, END], [*BA, END])
    assert vocab.student_ids.tolist() == [0, 1, 3] and vocab.teacher_ids.tolist() == [0, 1, 3]
    assert vocab.unmapped("student").tolist() == [False, False, True, False]
    assert vocab.unmapped("teacher").tolist() == [False, False, True, False]
    lt = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    shared, tail = project_teacher(lt, vocab)
    torch.testing.assert_close(shared.exp(), torch.tensor([0.1, 0.2, 0.4]), rtol=1e-15, atol=0)
    torch.testing.assert_close(tail.exp(), torch.tensor(0.3), rtol=1e-15, atol=0)
    # a student with two unmapped ids splits the teacher's tail as it splits its own: T'(v) = T_tail S(v) / S_tail
    s_keys, t_keys = ["a", "b", "ab", "aa", END], ["b", "a", "ba", END]
    vocab = build_shared_vocab(s_keys, t_keys)
    assert list(zip(vocab.student_ids.tolist(), vocab.teacher_ids.tolist())) == [(0, 1), (1, 0), (4, 3)]
    S = torch.tensor([0.3, 0.1, 0.15, 0.05, 0.4])
    T = torch.tensor([0.25, 0.35, 0.3, 0.1])  # over b, a, ba, <end>
    shared, tail = project_teacher(T.log(), vocab)
    got = complete_teacher(S.log()[None], shared[None], tail[None], torch.tensor([True]), vocab)[0].exp()
    want = torch.tensor([0.35, 0.25, 0.3 * 0.15 / 0.2, 0.3 * 0.05 / 0.2, 0.1])
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    assert float(got.sum()) == pytest.approx(1.0, abs=1e-15)
    # a position that is not one-to-one: the student's own distribution (no term)
    torch.testing.assert_close(complete_teacher(S.log()[None], shared[None], tail[None], torch.tensor([False]), vocab)[0].exp(), S)
    # a key on two ids of one side maps neither; a pinned pair (the ends) replaces what held either id
    vocab = build_shared_vocab(["a", "b", "b", "<s_end>"], ["a", "b", "<t_end>", "<s_end>"], pinned=[(3, 2)])
    assert list(zip(vocab.student_ids.tolist(), vocab.teacher_ids.tolist())) == [(0, 0), (3, 2)]


def _byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|im_end|>": 0, "a": 1, "Ġ": 2, "Ċ": 3, "Ġa": 4, "é": 5, "Ã": 6, "©": 7}
    tok = Tokenizer(models.BPE(vocab, [("Ġ", "a")]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    return fast


def _sentencepiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<end_of_turn>": 0, "a": 1, "▁": 2, "<0x0A>": 3, "▁a": 4, "<0x20>": 5, "é": 6, "<0x61>": 7}
    tok = Tokenizer(models.BPE(vocab, [("▁", "a")], byte_fallback=True))
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end_of_turn>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}<end_of_turn>{% endfor %}"
    return fast


def test_byte_level_and_sentencepiece_keys():
    """Byte-level BPE's characters are read back to bytes ('Ġ' a space, 'Ċ' a newline, 'Ã©' the two
    bytes of 'é'); SentencePiece's '▁' is a space and '<0xHH>' the byte HH, a fallback giving way to a
    regular token of the same bytes; the two ends of turn are pinned to each other."""
    from opd_exp.training.shared_vocab import byte_level, pair_vocab, token_keys

    bl, sp = _byte_level_tokenizer(), _sentencepiece_tokenizer()
    assert byte_level(bl) and not byte_level(sp)
    assert token_keys(bl) == [
        ("special", "<|im_end|>"),
        ("bytes", b"a"),
        ("bytes", b" "),
        ("bytes", b"\n"),
        ("bytes", b" a"),
        ("bytes", "é".encode("latin-1")),  # the byte 0xE9 (a part of some UTF-8 character), not 'é'
        ("bytes", b"\xc3"),
        ("bytes", b"\xa9"),
    ]
    keys = token_keys(sp)
    assert keys[2:6] == [("bytes", b" "), ("bytes", b"\n"), ("bytes", b" a"), ("fallback", b" ")]  # '▁' wins over <0x20>
    assert keys[6] == ("bytes", "é".encode()) and keys[7] == ("fallback", b"a")  # 'a' has a regular token
    vocab = pair_vocab(bl, sp)
    pairs = dict(zip(vocab.student_ids.tolist(), vocab.teacher_ids.tolist()))
    assert pairs == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}  # end <-> end, a, space, newline, ' a'; no é (bytes differ)


# -- the completion IS the coarse divergence ------------------------------------------------------------


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("name", [n for n in DIVERGENCES if n != "jsd_legacy"])
def test_completion_is_the_coarse_divergence(name):
    """For every registered divergence: D(S || T') over the student's vocabulary has the value and
    the gradient of D(S_c || T_c) over the map's bins + one tail, at one-to-one positions; 0 elsewhere."""
    d = get_divergence(name)
    vocab = build_shared_vocab(["a", "b", "ab", "c", None, "d"], ["b", "a", "ba", "x", "c", "c"], pinned=[(5, 3)])
    g = torch.Generator().manual_seed(0)
    zs, lt = torch.randn(5, 6, generator=g).requires_grad_(), torch.randn(5, 6, generator=g).log_softmax(-1)
    shared, tail = project_teacher(lt, vocab)
    one = torch.tensor([True, True, False, True, False])
    got = d.full(zs, complete_teacher(zs, shared, tail, one, vocab))
    want = d.full(coarse_logprobs(zs.log_softmax(-1), vocab.student_ids, 6), torch.cat([shared, tail[:, None]], -1))
    torch.testing.assert_close(got[one], want[one], rtol=1e-12, atol=1e-14)
    assert got[~one].abs().max() < 1e-12
    (g1,) = torch.autograd.grad(got[one].sum(), zs, retain_graph=True)
    (g2,) = torch.autograd.grad(want[one].sum(), zs)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)
    (g0,) = torch.autograd.grad(got[~one].sum(), zs)
    assert g0.abs().max() < 1e-12


# -- what the estimators follow, exactly ------------------------------------------------------------------


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("pair", ["ab_vs_ba", "char_vs_ab"])
@pytest.mark.parametrize("divergence", ["rkl", "fkl", "jsd"])
def test_full_follows_the_prefix_frozen_shared_objective(pair, divergence):
    """estimator=full with loss=direct (the GKD form): the expected gradient is exactly
    E_{y~S}[sum over one-to-one positions i of grad D(S_c || T_c)(y_<i)], S(y) and which positions
    are one-to-one held constant, computed here from strings."""
    sv, tv = PAIRS[pair]
    student, teacher = Student(sv, 0), Teacher(tv, 10)
    vocab = build_shared_vocab(student.tokens, teacher.tokens)
    want = autograd(shared_objective(student, teacher, divergence, prefix_frozen=True), student)
    got = expected_gradient(student, teacher, config("full", "token", divergence), vocab)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("estimator", ["full", "topk"])
def test_sequence_credit_follows_the_shared_objective_without_lookahead(estimator):
    """With credit=sequence the estimators follow grad E_S[sum over one-to-one positions of D(S_c || T_c)]
    where whether a position is one-to-one is decided by the tokens before it (identical tokenizers).
    Across tokenizers it is decided by the token itself and the teacher's look-ahead, which no credit
    assignment sees: part of the measured bias (``test_bias_against_the_sequence_kl_is_measured``)."""
    student, teacher = Student(CHAR, 1), Teacher(CHAR, 11)
    vocab = build_shared_vocab(student.tokens, teacher.tokens)
    want = autograd(shared_objective(student, teacher), student)
    torch.testing.assert_close(expected_gradient(student, teacher, config(estimator), vocab), want, rtol=1e-9, atol=1e-11)
    # and that gradient is the sequence KL's (the per-token rkl of one tokenizer sums to it: the chain rule)
    torch.testing.assert_close(want, autograd(exact_sequence_kl(student, teacher), student), rtol=1e-9, atol=1e-11)


# -- (b) identical tokenizers: today's losses --------------------------------------------------------------


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("estimator", ["full", "topk"])
def test_identity_map_gives_todays_losses(estimator):
    """Identical character tokenizers: every chunk is one-to-one, the map is the identity, both tails
    empty, and every row's loss and advantages are today's dense ones (the teacher's logits over the
    same vocabulary) to float64 round-off."""
    student, teacher = Student(CHAR, 0), Teacher(CHAR, 10)
    vocab = build_shared_vocab(student.tokens, teacher.tokens)
    assert vocab.student_ids.tolist() == vocab.teacher_ids.tolist() == [0, 1, 2]
    for credit in ("sequence", "token"):
        obj = Objective(config(estimator, credit), teacher_k=None, vocab_size=3)
        for seq in student.sequences():
            z, ids = student_row(student, seq)
            m = torch.ones_like(ids, dtype=torch.bool)
            today = torch.stack([teacher_log_dist(teacher, seq[:i]) for i in range(len(seq))])[None]
            a = obj(z, TeacherScores(logits=today), ids, m, on_policy=True, normalizer=1.0)
            b = obj(z, shared_scores(seq, student, teacher, vocab), ids, m, on_policy=True, normalizer=1.0)
            torch.testing.assert_close(b.loss, a.loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(b.advantages, a.advantages, rtol=1e-12, atol=1e-14)
            assert b.sums.keys() == a.sums.keys()
            for key in a.sums:
                assert b.sums[key] == pytest.approx(a.sums[key], rel=1e-12, abs=1e-14), key


# -- (c) the bias against the sequence KL, measured --------------------------------------------------------


@pytest.mark.usefixtures("float64_default")
def test_bias_against_the_sequence_kl_is_measured():
    """The shared-vocabulary path is NOT an estimate of grad KL(S || T_canon) (the chunk payload's
    target, exact at placement=sequence). Measured over three seeds per pair: the cosine between its
    expected gradient (rkl; full and topk k=2; credit=sequence and the GKD form loss=direct) and autograd
    of the exact sequence KL, and their relative error; BOUNDS hold what was measured, with margin
    (docs/training.md quotes the numbers)."""
    rows = {}
    for pair in ("ab_vs_ba", "char_vs_ab", "char_vs_char"):
        sv, tv = PAIRS[pair]
        for seed in range(3):
            student, teacher = Student(sv, seed), Teacher(tv, seed + 10)
            vocab = build_shared_vocab(student.tokens, teacher.tokens)
            want = autograd(exact_sequence_kl(student, teacher), student)
            for est in ("full", "topk"):
                for credit in ("sequence", "token"):
                    got = expected_gradient(student, teacher, config(est, credit), vocab)
                    rows[pair, est, credit, seed] = (cos(got, want), rel(got, want))
    for key, (c, e) in sorted(rows.items()):
        print(f"{key}: cosine {c:.3f} relative error {e:.3f}")
    for (pair, est, credit), (least_cos, most_err) in BOUNDS.items():
        cs, es = zip(*(rows[pair, est, credit, seed] for seed in range(3)))
        assert min(cs) > least_cos and max(es) < most_err, (pair, est, credit, cs, es)
        if pair != "char_vs_char":
            assert min(es) > 0.05, (pair, est, credit, es)  # biased: far beyond round-off
    # one tokenizer, credit=sequence: exact (the bias above is the other tokenizer's)
    assert max(rows["char_vs_char", est, "sequence", seed][1] for est in ("full", "topk") for seed in range(3)) < 1e-9


# (least cosine, largest relative error) with the sequence KL's gradient, measured on seeds 0-2 with
# margin: full/sequence 0.85-1.00 / 0.11-0.59, topk/sequence 0.74-0.99 / 0.33-0.68, the GKD form
# (credit=token) -0.30-0.99 / 0.65-1.52 (one tokenizer's GKD form alone: -0.16-0.57 / 0.83-1.50)
BOUNDS = {
    ("ab_vs_ba", "full", "sequence"): (0.8, 0.7),
    ("char_vs_ab", "full", "sequence"): (0.8, 0.7),
    ("ab_vs_ba", "topk", "sequence"): (0.7, 0.8),
    ("char_vs_ab", "topk", "sequence"): (0.7, 0.8),
    ("ab_vs_ba", "full", "token"): (0.0, 1.5),
    ("char_vs_ab", "full", "token"): (0.2, 1.5),
    ("ab_vs_ba", "topk", "token"): (-0.5, 1.7),
    ("char_vs_ab", "topk", "token"): (0.2, 1.5),
    ("char_vs_char", "full", "token"): (-0.3, 1.7),
}


# -- (d) the checks have teeth --------------------------------------------------------------------------------


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("broken", ["map_swapped", "tail_from_student", "tail_on_shared"])
def test_changed_map_or_tail_fails(broken):
    """The exact match of ``test_full_follows_the_prefix_frozen_shared_objective`` stops when the map
    pairs a with b, when the teacher's tail bucket is replaced by the student's own tail mass, or when
    the teacher's tail mass is counted on a mapped id instead."""
    student, teacher = Student(AB, 0), Teacher(BA, 10)
    vocab = build_shared_vocab(student.tokens, teacher.tokens)
    want = autograd(shared_objective(student, teacher, prefix_frozen=True), student)
    cfg = config("full", "token")
    assert rel(expected_gradient(student, teacher, cfg, vocab), want) < 1e-9

    class TailFromStudent(SharedVocabScores):
        def against(self, student_z):
            z = super().against(student_z).logits.clone()
            unmapped = self.vocab.unmapped("student")
            z[..., unmapped] = student_z.detach().log_softmax(-1)[..., unmapped]
            return TeacherScores(logits=z)

    def scores(seq, student, teacher, vocab):
        out = shared_scores(seq, student, teacher, vocab)
        if broken == "tail_from_student":
            return TailFromStudent(**{f: getattr(out, f) for f in ("shared", "tail", "one_to_one", "vocab")})
        if broken == "tail_on_shared":  # the tail's mass added to the first mapped id, the student's tail given the rest
            shared = out.shared.clone()
            shared[..., 0] = torch.logaddexp(shared[..., 0], out.tail)
            return replace(out, shared=shared, tail=torch.full_like(out.tail, -60.0))
        return out

    if broken == "map_swapped":
        vocab = replace(vocab, teacher_ids=vocab.teacher_ids[[1, 0, 2]])
    assert rel(expected_gradient(student, teacher, cfg, vocab, scores=scores), want) > 1e-3


# -- through the trainer ---------------------------------------------------------------------------------------

GROUPS = dict(
    divergence=dict(name="rkl"),
    loss=dict(name="reinforce", credit="sequence", gamma=1.0),
    trainer=dict(max_steps=2),
    rollout=dict(max_new_tokens=6, max_prompt_tokens=8),
)


def _pair(tiny_dir, teacher=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    pair = SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(tiny_dir / "student"),
        teacher=AutoModelForCausalLM.from_pretrained(tiny_dir / "teacher"),
        tokenizer=tok,
        vocab_size=len(tok),
    )
    if teacher is not None:
        pair.teacher_tokenizer, pair.teacher = teacher
    return pair


def _run(tmp_path, pair, estimator, **teacher):
    from opd_exp.training.trainer import Trainer

    cfg = small_config(**GROUPS, estimator=dict(name=estimator, k=4), teacher=teacher)
    Trainer(cfg, tmp_path, pair=pair, task=AddTask()).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


@pytest.mark.parametrize("estimator", ["full", "topk"])
def test_same_tokenizer_through_shared_vocab_gives_todays_losses(tiny_dir, tmp_path, estimator):
    today = _run(tmp_path / "none", _pair(tiny_dir), estimator)
    shared = _run(tmp_path / "shared", _pair(tiny_dir), estimator, align="bytes", align_vocab="shared")
    assert len(today) == len(shared) == 2
    for a, b in zip(today, shared):
        for key in ("loss", "kl/reverse", "jsd/mean", "advantages/mean", "student/logprob_mean", "teacher/logprob_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
        assert b["align/one_to_one_rate"] == 1.0 and b["align/shared_vocab_mass"] == pytest.approx(1.0, abs=1e-6)
        assert "exact/kl_reverse" in a and "exact/kl_reverse" not in b  # one vocabulary's metrics: not logged


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory):
    from test_teacher_align import build_teacher_tokenizer

    from helpers.tiny import build_model

    root = tmp_path_factory.mktemp("shared_vocab_teacher")
    tok = build_teacher_tokenizer(root / "tokenizer")
    return tok, build_model(root / "teacher", len(tok), hidden=32, layers=2, seed=5)


@pytest.mark.parametrize("estimator", ["full", "topk"])
def test_other_tokenizer_trains_two_steps(tiny_dir, other_teacher, tmp_path, estimator):
    rows = _run(tmp_path, _pair(tiny_dir, other_teacher), estimator, align="bytes", align_vocab="shared")
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and 0.0 < r["align/one_to_one_rate"] <= 1.0
        assert 0.0 < r["align/shared_vocab_mass"] < 1.0  # the teacher's merges (12, 34, ...) are its tail


def test_scores_are_the_teachers_distribution_at_one_to_one_chunks(tiny_dir, other_teacher):
    """The scorer on a teacher with its own BPE tokenizer: at each one-to-one chunk the teacher's
    distribution at its own token's position (one unpadded forward of its canonical tokens here), projected
    on the map; no other position is marked; the pair's map: every character, the pad token, and the
    student's end pinned to the teacher's <|im_end|>, the teacher's seven merges its tail."""
    from test_teacher_align import _batch
    from transformers import AutoTokenizer

    from opd_exp.training.shared_vocab import SharedVocabTeacher

    s_tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    t_tok, t_model = other_teacher
    scorer = SharedVocabTeacher(t_model, s_tok, t_tok, temperature=1.0, device="cpu")
    v = scorer.vocab
    assert v.size == len(s_tok) and int(v.unmapped("teacher").sum()) == 7
    assert dict(zip(v.student_ids.tolist(), v.teacher_ids.tolist()))[s_tok.eos_token_id] == t_tok.convert_tokens_to_ids("<|im_end|>")
    prompts, texts = ["3+4=", "9+1=", "5+6="], ["7890", "12+1;", "3;5+"]
    batch = _batch(s_tok, prompts, texts)
    out = scorer.score(batch)
    _, rows = scorer.teacher_rows(batch)
    end = t_tok.convert_tokens_to_ids("<|im_end|>")
    marked = 0
    for i, (prompt, row_text) in enumerate(zip(prompts, texts)):
        p = t_tok(prompt, add_special_tokens=False)["input_ids"]
        r = t_tok(row_text, add_special_tokens=False)["input_ids"] + [end]
        with torch.no_grad():
            lt = t_model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1, : len(t_tok)].float().log_softmax(-1)
        cols = batch.response_mask[i].nonzero().squeeze(-1).tolist()
        want = torch.zeros(batch.response_ids.shape[1], dtype=torch.bool)
        for c in rows[i][1]:
            if c.one_to_one:
                col = cols[c.student[0]]
                want[col] = True
                sh, tl = project_teacher(lt[c.teacher[0]], v)
                got = torch.cat([out.shared[i, col], out.tail[i, col, None]]).log_softmax(-1)
                torch.testing.assert_close(got, torch.cat([sh, tl[None]]).log_softmax(-1), rtol=1e-5, atol=1e-5)
        assert torch.equal(out.one_to_one[i], want)
        marked += int(want.sum())
    assert marked == 1 + 2 + 5  # 78|90|end: the end; 12|+1|;|end: ';' and the end; 3|;|5|+|end: all five
    mass = scorer.metrics()["align/shared_vocab_mass"]
    assert 0.0 < mass < 1.0


@pytest.mark.parametrize(
    "groups,message",
    [
        (
            dict(estimator=dict(name="sampled")),
            "estimator.name='sampled' is not allowed; allowed: full | topk with teacher.align_vocab=shared",
        ),
        (dict(estimator=dict(name="topk_renorm")), "estimator.name='topk_renorm' is not allowed; allowed: full | topk"),
        (dict(teacher=dict(align="none", align_vocab="shared")), "teacher.align_vocab='shared' is not allowed; allowed: none with"),
        (dict(teacher=dict(align="bytes", align_vocab="dense")), "teacher.align_vocab='dense' is not allowed; allowed: none | shared"),
        (dict(positions=dict(name="entropy_gate")), "positions.name='entropy_gate' is not allowed"),
        (dict(rollout=dict(top_k=5)), "rollout.top_k=5 is not allowed"),
    ],
)
def test_refused_in_one_line(groups, message):
    merged = {**GROUPS, "estimator": dict(name="full"), "teacher": dict(align="bytes", align_vocab="shared")}
    for key, value in groups.items():
        merged[key] = {**merged.get(key, {}), **value}
    with pytest.raises(ConfigError) as err:
        small_config(**merged)
    assert message in str(err.value) and "\n" not in str(err.value)
