"""The fused LM-head path equals the materialised one: loss, every metric sum and the gradient
of every student parameter, in fp64, for every divergence x estimator x loss x credit the
config allows (each with positions all/first/last; the others: tests/test_positions.py), student- and teacher-sampled batches, with
sampling filters and temperatures."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from helpers.tiny import AddTask, small_config
from opd_exp.config.positions import PositionsName as Positions
from opd_exp.config.schema import Credit, DivergenceName, EstimatorName, FusedLmHead, LossName, ParamDtype, Precision, validate
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.fused import FusedHead, fused_accumulate, unsupported_reason
from opd_exp.training.monitors import Monitors, Tally
from opd_exp.training.objective import Objective
from opd_exp.training.rollout import generate
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import InProcessTeacher, student_logits, teacher_logits


def _combos():
    for d, e, lo, c in itertools.product(DivergenceName, EstimatorName, LossName, Credit):
        try:
            validate(small_config(divergence=dict(name=d), estimator=dict(name=e, k=4), loss=dict(name=lo, credit=c)))
        except ConfigError:
            continue
        yield d.value, e.value, lo.value, c.value


COMBOS = list(_combos())


def _both_paths(pair, cfg, batch, on_policy, chunk):
    ro, V = cfg.rollout, pair.vocab_size
    objective, monitors = Objective(cfg), Monitors(cfg)
    student = pair.student
    n = batch.num_response_tokens + 3  # a global count larger than this micro-batch's

    student.zero_grad(set_to_none=True)
    zs = student_logits(student, batch, V, SamplingSpec.from_rollout(ro))
    zt = teacher_logits(pair.teacher, batch, V, temperature=cfg.divergence.temperature)
    ref = objective(zs, zt, batch.response_ids, batch.response_mask, on_policy=on_policy, normalizer=n)
    tally = Tally()
    tally.add(ref)
    tally.add(monitors(zs, zt, ref, engine_logprobs=batch.sampling_logprobs))
    ref.sums, ref.maxes = dict(tally), tally.maxes
    ref.loss.backward()
    ref_grads = {k: p.grad.clone() for k, p in student.named_parameters()}

    student.zero_grad(set_to_none=True)
    teacher = InProcessTeacher(pair.teacher, V, temperature=cfg.divergence.temperature, device="cpu")
    out = fused_accumulate(
        objective,
        monitors,
        student,
        teacher,
        batch,
        vocab_size=V,
        sampling=SamplingSpec.from_rollout(ro),
        on_policy=on_policy,
        normalizer=n,
        chunk_positions=chunk,
    )
    grads = {k: p.grad.clone() for k, p in student.named_parameters()}
    return ref, ref_grads, out, grads


def _assert_equal(ref, ref_grads, out, grads):
    assert float(out.loss) == pytest.approx(float(ref.loss), rel=1e-6, abs=1e-9)
    assert sorted(out.sums) == sorted(ref.sums)
    for k, v in ref.sums.items():
        assert out.sums[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert out.counts == pytest.approx(ref.counts) and sorted(out.maxes) == sorted(ref.maxes)
    for k, v in ref.maxes.items():
        assert out.maxes[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert sorted(grads) == sorted(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-6, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture
def pair64(tiny_pair, float64_default):
    tiny_pair.student.double()
    tiny_pair.teacher.double()
    return tiny_pair


def _batch(pair, ro):
    torch.manual_seed(5)
    return generate(
        pair.student,
        pair.tokenizer,
        ["1+2=", "34+5=", "7=", "12+"],
        n_samples=2,
        max_new_tokens=6,
        sampling=SamplingSpec(ro["temperature"], ro["top_k"], ro["top_p"]),
        vocab_size=pair.vocab_size,
    )


# positions (given by their old loss.* keys) with the fraction: a chunk of per-token positions spans several rows, and the
# first/last share is of each row's response, never of the chunk
POSITIONS = [(Positions.all, 0.3), (Positions.first, 0.3), (Positions.last, 0.45)]


@pytest.mark.parametrize("positions,fraction", POSITIONS)
@pytest.mark.parametrize("div,est,loss,credit", COMBOS)
def test_fused_equals_materialised_for_every_objective(pair64, div, est, loss, credit, positions, fraction):
    ro = dict(temperature=0.9, top_k=0, top_p=1.0, max_new_tokens=6, max_prompt_tokens=8)
    lo = dict(name=loss, credit=credit, positions=positions, position_fraction=fraction)
    cfg = small_config(divergence=dict(name=div, temperature=1.3), estimator=dict(name=est, k=4), loss=lo, rollout=ro)
    batch = _batch(pair64, ro)
    assert not batch.response_mask.all()  # some rows ended early: masks matter
    _assert_equal(*_both_paths(pair64, cfg, batch, on_policy=True, chunk=5))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 5, 1.0), (0.8, 6, 0.9)])
@pytest.mark.parametrize("on_policy", [True, False])
def test_fused_equals_materialised_with_filters_and_teacher_batches(pair64, temperature, top_k, top_p, on_policy):
    ro = dict(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=6, max_prompt_tokens=8)
    for div, est, loss, credit, positions in [
        ("jsd", "full", "direct", "token", Positions.first),
        ("rkl", "sampled", "ppo", "sequence", Positions.last),
    ]:
        lo = dict(name=loss, credit=credit, positions=positions, position_fraction=0.4)
        cfg = small_config(divergence=dict(name=div), estimator=dict(name=est), loss=lo, rollout=ro)
        batch = _batch(pair64, ro)
        for chunk in (1, 7, 10_000):  # one position, ragged chunks, everything at once
            _assert_equal(*_both_paths(pair64, cfg, batch, on_policy=on_policy, chunk=chunk))


def test_fused_with_an_untied_padded_student_head(pair64, tmp_path):
    """A student whose LM head is its own matrix with more rows than the tokenizer."""
    from helpers.tiny import build_model

    V = pair64.vocab_size
    student = build_model(tmp_path / "s", V + 8, hidden=32, layers=1, seed=3)
    student.config.tie_word_embeddings = False
    student.lm_head.weight = torch.nn.Parameter(student.lm_head.weight.detach().clone())
    pair64.student = student.double()
    assert student.lm_head.weight.data_ptr() != student.get_input_embeddings().weight.data_ptr()
    ro = dict(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=6, max_prompt_tokens=8)
    cfg = small_config(divergence=dict(name="fkl"), estimator=dict(name="full"), loss=dict(name="direct"), rollout=ro)
    ref, ref_grads, *rest = _both_paths(pair64, cfg, _batch(pair64, ro), on_policy=True, chunk=4)
    assert ref_grads["lm_head.weight"][V:].abs().max() == 0  # padded rows get no gradient
    _assert_equal(ref, ref_grads, *rest)


def test_fused_training_steps_equal_materialised_steps(tiny_pair, tmp_path):
    """Trainer steps with fused_lm_head=on give the loss, metrics and gradient norm of =off
    (micro-batches, the global normaliser). lr=0: in fp32, Adam turns 1e-7 differences in
    near-zero gradient entries into lr-sized steps, which the fp64 tests above rule out."""
    from opd_exp.training.trainer import Trainer

    runs = {}
    for mode in (FusedLmHead.off, FusedLmHead.on):
        pair = copy.deepcopy(tiny_pair)
        cfg = small_config(trainer=dict(max_steps=3, fused_lm_head=mode, micro_batch_size=2, lr=0.0), estimator=dict(chunk_size=3))
        tr = Trainer(cfg, tmp_path / mode.value, pair=pair, task=AddTask())
        assert isinstance(tr.head, FusedHead) == (mode is FusedLmHead.on)
        metrics = [tr.train_step() for _ in range(3)]
        runs[mode] = metrics
    for a, b in zip(runs[FusedLmHead.off], runs[FusedLmHead.on]):
        assert sorted(a) == sorted(b)
        for k in ("loss", "jsd/mean", "kl/forward", "kl/reverse", "grad/norm", "student/entropy", "advantages/mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize(
    "trainer",
    [dict(precision=Precision.bf16), dict(param_dtype=ParamDtype.bf16, teacher_dtype=ParamDtype.bf16)],
    ids=["autocast", "bf16_weights"],
)
def test_fused_steps_in_bf16_agree_with_materialised_to_bf16_rounding(tiny_pair, tmp_path, trainer):
    """bf16 autocast (and bf16 weights) through the fused head: the chunks' logits are rounded
    like the materialised head's, the objective still runs in fp32, so the two paths agree to
    bf16 rounding (a few 1e-3 relative), every metric finite."""
    from opd_exp.training.trainer import Trainer

    runs = {}
    for mode in (FusedLmHead.off, FusedLmHead.on):
        cfg = small_config(trainer=dict(max_steps=2, fused_lm_head=mode, lr=0.0, **trainer), estimator=dict(chunk_size=3))
        tr = Trainer(cfg, tmp_path / mode.value, pair=copy.deepcopy(tiny_pair), task=AddTask())
        assert isinstance(tr.head, FusedHead) == (mode is FusedLmHead.on)
        runs[mode] = [tr.train_step() for _ in range(2)]
    for a, b in zip(runs[FusedLmHead.off], runs[FusedLmHead.on]):
        assert sorted(a) == sorted(b)
        assert all(torch.isfinite(torch.tensor(v)) for v in b.values())
        for k in ("loss", "jsd/mean", "kl/forward", "kl/reverse", "grad/norm", "student/entropy", "exact/jsd"):
            assert b[k] == pytest.approx(a[k], rel=2e-2, abs=1e-4), k


@pytest.mark.parametrize("rollout", [{}, {"temperature": 0.7, "top_k": 5}], ids=["plain", "filtered"])
def test_eval_through_the_fused_path_equals_materialised_eval(tiny_pair, tmp_path, monkeypatch, rollout):
    """Eval (greedy responses: exact divergences; k samples: entropy) takes the fused path when
    training does, never holding [N, R, V] logits, and gives the materialised eval's numbers."""
    from opd_exp.training import scoring
    from opd_exp.training.trainer import Trainer

    results = {}
    for mode in (FusedLmHead.off, FusedLmHead.on):
        cfg = small_config(
            divergence={"name": "rkl"},
            rollout=rollout,
            trainer=dict(fused_lm_head=mode, eval_samples=3, eval_batch_size=4),
            estimator=dict(chunk_size=5),
        )
        tr = Trainer(cfg, tmp_path / mode.value, pair=copy.deepcopy(tiny_pair), task=AddTask())
        calls = []
        inner = scoring.response_logits

        def counted(*args, calls=calls, inner=inner, **kw):
            calls.append(1)
            return inner(*args, **kw)

        monkeypatch.setattr(scoring, "response_logits", counted)
        results[mode] = tr.evaluate()
        monkeypatch.setattr(scoring, "response_logits", inner)
        assert bool(calls) == (mode is FusedLmHead.off)  # the fused eval never runs an LM head over [N, R]
    off, on = results[FusedLmHead.off], results[FusedLmHead.on]
    assert sorted(off) == sorted(on)
    for k in off:
        assert on[k] == pytest.approx(off[k], rel=1e-5, abs=1e-7), k
    assert "eval/kl_reverse" in on and "eval/entropy" in on and ("eval/kl_forward" in on) == (not rollout)


def test_auto_keeps_small_vocabularies_materialised_and_on_refuses_what_it_cannot_cover(tiny_pair, tmp_path):
    from opd_exp.training.fused import use_fused_lm_head
    from opd_exp.training.trainer import Trainer

    assert not use_fused_lm_head(small_config(), tiny_pair.student, tiny_pair.teacher, tiny_pair.vocab_size)  # V=18
    assert use_fused_lm_head(small_config(), tiny_pair.student, tiny_pair.teacher, 65536)
    assert unsupported_reason(tiny_pair.student) is None
    tiny_pair.teacher.config.final_logit_softcapping = 30.0
    assert not use_fused_lm_head(small_config(), tiny_pair.student, tiny_pair.teacher, 65536)
    cfg = small_config(trainer=dict(fused_lm_head=FusedLmHead.on))
    with pytest.raises(
        ConfigError,
        match=r"scale.fused_lm_head='on' is not allowed; allowed: auto or off here \(the teacher its config sets final_logit_softcapping=30.0",
    ):
        Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())


def test_fused_step_with_nonfinite_teacher_logits_is_skipped(tiny_pair, tmp_path):
    from opd_exp.training.trainer import Trainer

    with torch.no_grad():
        tiny_pair.teacher.lm_head.weight[3, 0] = float("nan")  # one logit of every position
    cfg = small_config(trainer=dict(max_steps=2, fused_lm_head=FusedLmHead.on))
    tr = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    before = [p.detach().clone() for p in tiny_pair.student.parameters()]
    metrics = tr.train_step()
    assert metrics["grad/skipped"] == 1.0 and metrics["guard/skipped_steps"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_pair.student.parameters()))


@pytest.mark.parametrize(
    "trainer,message",
    [
        (dict(parallel="ddp"), "scale.fused_lm_head='on' is not allowed; allowed: auto or off with scale.parallel=ddp"),
        (dict(lora_rank=4), "scale.fused_lm_head='on' is not allowed; allowed: auto or off with scale.lora_rank > 0"),
    ],
)
def test_fused_on_refuses_what_it_cannot_do_before_any_model_loads(trainer, message):
    from opd_exp.config.schema import Parallel

    if "parallel" in trainer:
        trainer = dict(parallel=Parallel(trainer["parallel"]))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(small_config(trainer=dict(fused_lm_head=FusedLmHead.on, **trainer)))
