"""Position weighting (the ``positions`` group): each option's gradient against autograd of the
exact weighted divergence sum, the vocabulary enumerated by hand in float64, on the materialised
path (``Objective``) and the fused one (``fused_accumulate``); the sampled estimator's expected
gradient by enumerating every response of a tabular model; the weights by hand; the config group,
its refusals and the old ``loss.positions`` keys; early-stopped rollouts; the metrics."""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import pytest
import torch

from helpers.tiny import AddTask, small_config
from opd_exp.config.positions import PositionsName
from opd_exp.config.schema import DivergenceName, validate
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.fused import fused_accumulate
from opd_exp.training.monitors import TOKEN_METRICS, Monitors, Tally, token_metric_names
from opd_exp.training.objective import Objective
from opd_exp.training.positions import first_n_mask, iw_opd_weights, position_mask
from opd_exp.training.rollout import generate
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import InProcessTeacher, student_logits, teacher_logits, token_logprobs

# --- the exact divergences, by hand over the vocabulary ---------------------------------------


def _kl(lp, lq):
    return (lp.exp() * (lp - lq)).sum(-1)


def _mix(a, lp, lq):  # log(a P + (1 - a) Q)
    return torch.logsumexp(torch.stack([lp + math.log(a), lq + math.log(1 - a)]), 0)


EXACT = {  # D(S, T) per position from the log-probs s, t [..., V]
    "rkl": lambda s, t: _kl(s, t),
    "fkl": lambda s, t: _kl(t, s),
    "jsd": lambda s, t: 0.3 * _kl(t, _mix(0.3, t, s)) + 0.7 * _kl(s, _mix(0.3, t, s)),
    "skl": lambda s, t: _kl(t, _mix(0.2, t, s)),
    "srkl": lambda s, t: _kl(s, _mix(0.2, s, t)),
    "tvd": lambda s, t: 0.5 * (s.exp() - t.exp()).abs().sum(-1),
}
PARAMS = {"jsd": {"beta": 0.3}, "skl": {"alpha": 0.2}, "srkl": {"alpha": 0.2}}
# every registered divergence the full estimator takes (jsd_legacy differs only in its sampled cost)
DIVERGENCES = [d.value for d in DivergenceName if d.value in EXACT]
KL_COEF = 0.7


def test_every_builtin_divergence_has_a_reference():
    assert set(DIVERGENCES) == set(EXACT)


# --- the weights, by hand (loops over each row) ------------------------------------------------


def _weights_by_hand(name, mask, s, t, teacher_lp, **kw):
    """(weight on the run's term, gate) per position, a row at a time."""
    N, R = mask.shape
    w, gate = torch.zeros(N, R, dtype=torch.float64), torch.zeros(N, R, dtype=torch.bool)
    for i in range(N):
        idx = [j for j in range(R) if mask[i, j]]
        L = len(idx)
        for rank, j in enumerate(idx):
            if name == "all":
                w[i, j] = 1.0
            elif name == "first":
                w[i, j] = float(rank < math.ceil(kw["fraction"] * L))
            elif name == "last":
                w[i, j] = float(rank >= L - math.ceil(kw["fraction"] * L))
            elif name == "first_n":
                w[i, j] = float(rank < kw["tokens"])
            elif name == "iw_opd":
                a = [abs(float(t[i, k]) - float(s[i, k])) for k in idx]
                w[i, j] = 1 + kw["gamma"] * (1 - sum(a[:rank]) / max(sum(a), 1e-8))
            elif name == "entropy_gate":
                ent = -float((teacher_lp[i, j].exp() * teacher_lp[i, j]).sum())
                gate[i, j] = ent > kw["threshold"]
                w[i, j] = 0.0 if (kw["gate"] == "replace" and gate[i, j]) else 1.0
    return w, gate


def _reference_loss(name, div, zs, zt, y, mask, N, t=None, **kw):
    """(1/N) sum_t [w_t kl_coef D_t + g_t kl_coef KL(T_t||S_t)], every term by hand (``t``: the
    sampled tokens' teacher log-probs the weights read, if not those of ``zt``)."""
    s_all, t_all = zs.log_softmax(-1), zt.log_softmax(-1)
    s = s_all.gather(-1, y[..., None])[..., 0]
    t = t_all.gather(-1, y[..., None])[..., 0] if t is None else t
    w, gate = _weights_by_hand(name, mask, s.detach(), t, t_all, **kw)
    d = EXACT[div](s_all, t_all)
    f = EXACT["fkl"](s_all, t_all)
    return (w * KL_COEF * d + gate.to(d.dtype) * KL_COEF * f)[mask].sum() / N, w, gate


OPTIONS = [
    ("all", {}),
    ("first", {"fraction": 0.3}),
    ("last", {"fraction": 0.45}),
    ("first_n", {"tokens": 2}),
    ("iw_opd", {"gamma": 0.5}),
    ("iw_opd", {"gamma": 2.0}),
    ("entropy_gate", {"gate": "add"}),
    ("entropy_gate", {"gate": "replace"}),
]


def _config(name, kw, **groups):
    return small_config(positions={"name": name, **kw}, **groups)


def _ragged(g, N=3, R=7, V=6):
    zs = (2 * torch.randn(N, R, V, generator=g, dtype=torch.float64)).requires_grad_(True)
    zt = 2 * torch.randn(N, R, V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (N, R), generator=g)
    mask = torch.zeros(N, R, dtype=torch.bool)
    for i, n in enumerate((7, 4, 1)[:N]):
        mask[i, :n] = True
    return zs, zt, y, mask


def _gate_threshold(zt, mask):
    """Halfway between the two middle teacher entropies over the response tokens: some gates
    open, some shut, and no entropy near enough the threshold for rounding to decide."""
    lp = zt.log_softmax(-1)
    h = (-(lp.exp() * lp).sum(-1))[mask].sort().values
    k = (h.numel() - 1) // 2
    return float(h[k] + h[k + 1]) / 2


@pytest.mark.parametrize("name,kw", OPTIONS, ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in OPTIONS])
@pytest.mark.parametrize("div", DIVERGENCES)
def test_materialised_gradient_is_autograd_of_the_exact_weighted_sum(name, kw, div):
    g = torch.Generator().manual_seed(11)
    zs, zt, y, mask = _ragged(g)
    kw = dict(kw, threshold=_gate_threshold(zt, mask)) if name == "entropy_gate" else kw
    cfg = _config(name, kw, divergence={"name": div, **PARAMS.get(div, {})}, loss={"kl_coef": KL_COEF})
    N = int(mask.sum()) + 3  # the step's global count: larger than this micro-batch's
    out = Objective(cfg)(zs, zt, y, mask, on_policy=True, normalizer=N)
    (got,) = torch.autograd.grad(out.loss, zs)
    want_loss, w, gate = _reference_loss(name, div, zs, zt, y, mask, N, **kw)
    (want,) = torch.autograd.grad(want_loss, zs)
    assert float(out.loss) == pytest.approx(float(want_loss), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-14)
    if name == "entropy_gate":
        assert 0 < int(gate[mask].sum()) < int(mask.sum())  # both branches exercised
        assert out.sums["positions/gate_rate"] == pytest.approx(float(gate[mask].sum()))
    if name != "all":
        assert out.sums["positions/weight_mean"] == pytest.approx(float(w[mask].sum()), rel=1e-12)
    else:
        assert not any(k.startswith("positions/") for k in out.sums)


@pytest.mark.parametrize("name,kw", OPTIONS[:4])
def test_mask_options_are_bit_identical_to_the_plain_masked_sum(name, kw):
    """all/first/last/first_n: the loss is exactly sum over the counted positions of the
    unweighted term (no multiplication by a weight anywhere)."""
    g = torch.Generator().manual_seed(12)
    zs, zt, y, mask = _ragged(g)
    zs, zt = zs.float().detach(), zt.float()  # fp32: where a multiplication by 1.0 could not hide
    cfg = _config(name, kw, divergence={"name": "jsd"}, loss={"kl_coef": KL_COEF})
    out = Objective(cfg)(zs, zt, y, mask, on_policy=True, normalizer=17)
    from opd_exp.divergences import get_divergence

    per_token = KL_COEF * get_divergence("jsd", beta=0.5).full(zs, zt, mask=mask)
    counted = first_n_mask(mask, kw["tokens"]) if name == "first_n" else position_mask(mask, name, kw.get("fraction", 0.3))
    assert torch.equal(out.loss, torch.where(counted, per_token, torch.zeros(())).sum() / 17.0)


def test_objective_position_mask_is_still_importable():
    from opd_exp.training import objective, positions

    assert objective.position_mask is positions.position_mask


# --- the sampled estimator: the expected gradient, every response of a tabular model enumerated --


def _expected_gradient(cfg, zs, zt, mask, N):
    """E_{y~S}[grad loss(y)] over all V^R responses; S's logits at each position are fixed (a
    tabular model whose conditionals do not depend on the prefix)."""
    obj, (_, R, V) = Objective(cfg), zs.shape
    probs = zs.detach().softmax(-1)[0]
    total = torch.zeros_like(zs)
    for ys in itertools.product(range(V), repeat=R):
        p = math.prod(float(probs[j, v]) for j, v in enumerate(ys))
        z = zs.detach().clone().requires_grad_(True)
        out = obj(z, zt, torch.tensor([ys]), mask, on_policy=True, normalizer=N)
        (g,) = torch.autograd.grad(out.loss, z)
        total += p * g
    return total


@pytest.mark.parametrize(
    "name,kw",
    [("all", {}), ("first", {"fraction": 0.5}), ("last", {"fraction": 0.5}), ("first_n", {"tokens": 1})]
    + [("entropy_gate", {"gate": "add"}), ("entropy_gate", {"gate": "replace"})],
)
@pytest.mark.parametrize("div,loss", [("rkl", "reinforce"), ("jsd", "ppo"), ("tvd", "reinforce")])
def test_sampled_expected_gradient_is_the_exact_weighted_gradient(name, kw, div, loss):
    g = torch.Generator().manual_seed(13)
    V, R = 4, 3
    zs = (1.5 * torch.randn(1, R, V, generator=g, dtype=torch.float64)).requires_grad_(True)
    zt = 1.5 * torch.randn(1, R, V, generator=g, dtype=torch.float64)
    zt[0, 1] = zt[0, 1] / 10  # a flat teacher at position 1: the highest entropy
    mask = torch.ones(1, R, dtype=torch.bool)
    kw = dict(kw, threshold=_gate_threshold(zt, mask)) if name == "entropy_gate" else kw
    cfg = _config(
        name, kw, divergence={"name": div, **PARAMS.get(div, {})}, estimator={"name": "sampled"}, loss={"name": loss, "kl_coef": KL_COEF}
    )
    want_loss, _, gate = _reference_loss(name, div, zs, zt, torch.zeros(1, R, dtype=torch.long), mask, R, **kw)
    (want,) = torch.autograd.grad(want_loss, zs)
    got = _expected_gradient(cfg, zs, zt, mask, R)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    if name == "entropy_gate":
        assert 0 < int(gate.sum()) < R  # both branches exercised


def test_iw_opd_weights_a_sampled_rollout_per_sample():
    """estimator=sampled, rkl, reinforce: the gradient of one sampled rollout's loss is
    (1/N) sum_t w_t kl_coef (s_t - t_t) grad s_t, the weights from that rollout (stop-gradient)."""
    g = torch.Generator().manual_seed(14)
    zs, zt, y, mask = _ragged(g)
    cfg = _config("iw_opd", {"gamma": 0.5}, divergence={"name": "rkl"}, estimator={"name": "sampled"}, loss={"name": "reinforce"})
    out = Objective(cfg)(zs, zt, y, mask, on_policy=True, normalizer=13)
    (got,) = torch.autograd.grad(out.loss, zs)
    s = zs.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    t = zt.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    w, _ = _weights_by_hand("iw_opd", mask, s.detach(), t, None, gamma=0.5)
    (want,) = torch.autograd.grad(((w * (s - t).detach() * s)[mask]).sum() / 13, zs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_a_reward_term_is_added_after_the_weights_unweighted():
    """reward.coef > 0: the reward's REINFORCE term -A_r log S(y_t) joins on the counted
    positions after IW-OPD's weights (and the entropy gate) acted on the distillation term."""
    g = torch.Generator().manual_seed(15)
    zs, zt, y, mask = _ragged(g)
    reward = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    cfg = _config("iw_opd", {"gamma": 0.5}, divergence={"name": "rkl"}, estimator={"name": "sampled"}, loss={"name": "reinforce"})
    out = Objective(cfg)(zs, zt, y, mask, on_policy=True, normalizer=13, reward_advantages=reward)
    (got,) = torch.autograd.grad(out.loss, zs)
    s = zs.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    t = zt.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    w, _ = _weights_by_hand("iw_opd", mask, s.detach(), t, None, gamma=0.5)
    (want,) = torch.autograd.grad(((w * (s - t).detach() * s - reward * s)[mask]).sum() / 13, zs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


# --- the weights by hand -------------------------------------------------------------------------


def test_iw_opd_weights_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    s = torch.tensor([[-1.0, -2.0, -0.5, -1e9], [-1.0, -1.0, 0.0, 0.0], [0.0] * 4], dtype=torch.float64)
    t = torch.tensor([[-2.0, -1.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0], [0.0] * 4], dtype=torch.float64)
    w = iw_opd_weights(mask, s, t, gamma=0.5)
    # row 0: |a| = 1, 1, 0 (P = 2): 1 + 0.5 (1 - 0/2), 1 + 0.5 (1 - 1/2), 1 + 0.5 (1 - 2/2)
    assert w[0].tolist() == [1.5, 1.25, 1.0, 0.0]
    assert w[1].tolist() == [1.5, 1.5, 0.0, 0.0]  # no discrepancy at all: P floored, every weight 1 + gamma
    assert w[2].tolist() == [0.0] * 4
    assert torch.equal(iw_opd_weights(mask, s, t, gamma=0.0), mask.double())  # gamma 0: plain OPD


def test_first_n_and_fraction_masks_by_hand():
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, :10], mask[1, :3] = True, True
    assert first_n_mask(mask, 4)[0].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert first_n_mask(mask, 4)[1].nonzero().flatten().tolist() == [0, 1, 2]
    assert not first_n_mask(mask, 4)[2].any()
    assert position_mask(mask, "first", 0.3)[0].nonzero().flatten().tolist() == [0, 1, 2]
    assert position_mask(mask, "last", 0.3)[0].nonzero().flatten().tolist() == [7, 8, 9]


# --- the fused path ------------------------------------------------------------------------------


@pytest.fixture
def pair64(tiny_pair, float64_default):
    tiny_pair.student.double()
    tiny_pair.teacher.double()
    return tiny_pair


def _batch(pair, temperature=0.9):
    torch.manual_seed(5)
    return generate(
        pair.student,
        pair.tokenizer,
        ["1+2=", "34+5=", "7=", "12+"],
        n_samples=2,
        max_new_tokens=6,
        sampling=SamplingSpec(temperature),
        vocab_size=pair.vocab_size,
    )


def _fused(pair, cfg, batch, *, on_policy, chunk, n):
    pair.student.zero_grad(set_to_none=True)
    teacher = InProcessTeacher(pair.teacher, pair.vocab_size, temperature=cfg.divergence.temperature, device="cpu")
    out = fused_accumulate(
        Objective(cfg),
        Monitors(cfg),
        pair.student,
        teacher,
        batch,
        vocab_size=pair.vocab_size,
        sampling=SamplingSpec.from_rollout(cfg.rollout),
        on_policy=on_policy,
        normalizer=n,
        chunk_positions=chunk,
    )
    return out, {k: p.grad.clone() for k, p in pair.student.named_parameters()}


def _materialised(pair, cfg, batch, *, on_policy, n):
    pair.student.zero_grad(set_to_none=True)
    ro, V = cfg.rollout, pair.vocab_size
    zs = student_logits(pair.student, batch, V, SamplingSpec.from_rollout(ro))
    zt = teacher_logits(pair.teacher, batch, V, temperature=cfg.divergence.temperature)
    out = Objective(cfg)(zs, zt, batch.response_ids, batch.response_mask, on_policy=on_policy, normalizer=n)
    tally = Tally()
    tally.add(out)
    tally.add(Monitors(cfg)(zs, zt, out, engine_logprobs=batch.sampling_logprobs))
    out.loss.backward()
    return out, dict(tally), {k: p.grad.clone() for k, p in pair.student.named_parameters()}


@pytest.mark.parametrize("name,kw", OPTIONS, ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in OPTIONS])
def test_fused_gradient_is_autograd_of_the_exact_weighted_sum(pair64, name, kw):
    """The fused head's parameter gradient (chunks of 5 positions, or whole rows for iw_opd)
    equals autograd, through the student, of the exact weighted divergence sum by hand."""
    batch = _batch(pair64)
    mask, y, V = batch.response_mask.bool(), batch.response_ids, pair64.vocab_size
    assert not mask.all()  # ragged rows
    zt32 = teacher_logits(pair64.teacher, batch, V, temperature=1.3)  # fp32, as both heads hand it on
    zt = zt32.double()
    kw = dict(kw, threshold=_gate_threshold(zt, mask)) if name == "entropy_gate" else kw
    ro = dict(temperature=0.9, max_new_tokens=6, max_prompt_tokens=8)
    cfg = _config(name, kw, divergence={"name": "rkl", "temperature": 1.3}, loss={"kl_coef": KL_COEF}, rollout=ro)
    n = int(mask.sum()) + 3
    out, grads = _fused(pair64, cfg, batch, on_policy=True, chunk=5, n=n)

    pair64.student.zero_grad(set_to_none=True)
    zs = student_logits(pair64.student, batch, V, SamplingSpec(temperature=0.9))
    # IW-OPD's weights read the teacher's log-prob of each token as the objective has it: from fp32 logits
    t = token_logprobs(zt32, y).double()
    want_loss, w, _ = _reference_loss(name, "rkl", zs, zt, y, mask, n, t=t, **kw)
    want_loss.backward()
    assert float(out.loss) == pytest.approx(float(want_loss), rel=1e-7)  # the fused head returns its loss in fp32
    for k, p in pair64.student.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
    if name != "all":
        assert out.sums["positions/weight_mean"] == pytest.approx(float(w[mask].sum()), rel=1e-10)


FUSED_COMBOS = [  # divergence, estimator, loss, credit
    ("jsd", "full", "direct", "token"),
    ("rkl", "sampled", "ppo", "sequence"),
    ("fkl", "topk", "reinforce", "sequence"),
    ("skl", "sampled", "reinforce", "token"),
]


@pytest.mark.parametrize("name,kw", OPTIONS[1:], ids=[f"{n}-{'-'.join(map(str, k.values()))}" for n, k in OPTIONS[1:]])
@pytest.mark.parametrize("on_policy", [True, False])
def test_fused_equals_materialised_for_every_option(pair64, name, kw, on_policy):
    """Loss, every metric sum (positions/* included) and every parameter's gradient, for chunks of
    one position, ragged chunks and everything at once, student- and teacher-sampled."""
    batch = _batch(pair64)
    ro = dict(temperature=0.9, max_new_tokens=6, max_prompt_tokens=8)
    for div, est, loss, credit in FUSED_COMBOS:
        kw2 = dict(kw, threshold=1.0) if name == "entropy_gate" else kw
        cfg = _config(
            name, kw2, divergence={"name": div}, estimator={"name": est, "k": 4}, loss={"name": loss, "credit": credit}, rollout=ro
        )
        n = batch.num_response_tokens + 3
        ref, ref_sums, ref_grads = _materialised(pair64, cfg, batch, on_policy=on_policy, n=n)
        for chunk in (1, 7, 10_000):
            out, grads = _fused(pair64, cfg, batch, on_policy=on_policy, chunk=chunk, n=n)
            assert float(out.loss) == pytest.approx(float(ref.loss), rel=1e-7)  # returned in fp32
            assert sorted(out.sums) == sorted(ref_sums)
            for k, v in ref_sums.items():
                assert out.sums[k] == pytest.approx(v, rel=1e-9, abs=1e-12), (div, est, chunk, k)
            for k, gr in ref_grads.items():
                torch.testing.assert_close(
                    grads[k], gr, rtol=1e-9, atol=1e-12, msg=lambda m, k=k, where=(div, est, chunk): f"{where} {k}: {m}"
                )


# --- the config group --------------------------------------------------------------------------


def _compose(*overrides):
    from opd_exp.cli.compose import compose_config

    return compose_config(*overrides)


@pytest.mark.parametrize("name", [p.value for p in PositionsName])
def test_every_option_has_a_group_file_that_composes(name):
    cfg = _compose(f"positions={name}")
    assert cfg.positions.name is PositionsName(name)
    assert (cfg.positions.fraction, cfg.positions.tokens, cfg.positions.gamma, cfg.positions.threshold) == (0.3, 16, 0.5, 0.5)


def test_default_is_all_and_logs_no_positions_metric():
    cfg = _compose()
    assert cfg.positions.name is PositionsName.all
    assert not any(n.startswith("positions/") for n in token_metric_names(cfg))
    assert set(token_metric_names(_compose("positions=iw_opd"))) - set(token_metric_names(cfg)) == {"positions/weight_mean"}
    gate = set(token_metric_names(_compose("positions=entropy_gate"))) - set(token_metric_names(cfg))
    assert gate == {"positions/weight_mean", "positions/gate_rate"}
    assert {"positions/weight_mean", "positions/gate_rate"} <= set(TOKEN_METRICS)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["positions=first", "positions.fraction=0"], "positions.fraction=0.0 is not allowed; allowed: 0 < fraction <= 1"),
        (["positions=first_n", "positions.tokens=0"], "positions.tokens=0 is not allowed; allowed: integer >= 1"),
        (["positions=iw_opd", "positions.gamma=-1"], "positions.gamma=-1.0 is not allowed; allowed: 0 <= gamma <= 1000 (0: every weight 1"),
        (["positions=iw_opd", "positions.gamma=1e300"], r"positions.gamma=1e\+300 is not allowed; allowed: 0 <= gamma <= 1000 (0: every"),
        (["positions=entropy_gate", "positions.threshold=-0.5"], "positions.threshold=-0.5 is not allowed; allowed: >= 0 (nats)"),
        (
            ["positions=iw_opd", "estimator=sampled", "loss=ppo", "loss.ppo_epochs=2"],
            "loss.ppo_epochs=2 is not allowed; allowed: 1 with positions=iw_opd (later PPO updates reuse",
        ),
        (
            ["positions=entropy_gate", "divergence=rkl", "rollout.top_k=5"],
            "rollout.top_k=5 is not allowed; allowed: 0 (off) with positions=entropy_gate: its forward KL(T||S) is infinite",
        ),
    ],
)
def test_refusals_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")) as ex:
        _compose(*overrides)
    assert "\n" not in str(ex.value)


def test_an_unknown_option_lists_the_valid_ones():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="entropy_gate"):
        _compose("positions=frist")


def test_a_sparse_teacher_refuses_the_entropy_gate():
    cfg = small_config(positions={"name": "entropy_gate"}, estimator={"name": "topk", "k": 4})
    with pytest.raises(ConfigError, match=r"positions.name='entropy_gate' is not allowed with a served teacher whose top-k"):
        Objective(cfg, teacher_k=4, vocab_size=18)


def test_the_old_loss_keys_still_work_with_a_notice(capsys):
    cfg = _compose("loss.positions=last", "loss.position_fraction=0.45")
    assert cfg.positions.name is PositionsName.last and cfg.positions.fraction == 0.45
    err = capsys.readouterr().err
    assert "opd-train: loss.positions is deprecated" in err and "use positions.name" in err
    assert "opd-train: loss.position_fraction is deprecated" in err and "use positions.fraction" in err


def test_an_old_fingerprint_resumes_under_the_new_keys():
    """A checkpoint written before the group (loss.positions, loss.position_fraction) compares
    equal to today's default config once its keys are upgraded."""
    from opd_exp.config.deprecated import upgrade_flat
    from opd_exp.runtime.fingerprint import config_fingerprint, differences, schema_defaults

    cfg = _compose()
    now = config_fingerprint(cfg)
    old = {k: v for k, v in now.items() if not k.startswith("positions.")}
    old.update({"loss.positions": "all", "loss.position_fraction": 0.3})
    assert differences(upgrade_flat(old), now, schema_defaults(cfg)) == {}
    old["loss.positions"] = "first"
    assert differences(upgrade_flat(old), now, schema_defaults(cfg)) == {"positions.name": ("first", "all")}


def test_wandb_gets_only_the_chosen_options_keys():
    from opd_exp.sinks.tracking import chosen_options

    group = {"name": "first", "fraction": 0.3, "tokens": 16, "gamma": 0.5, "threshold": 0.5, "gate": "add"}
    assert chosen_options({"positions": group})["positions"] == {"name": "first", "fraction": 0.3}
    assert chosen_options({"positions": {**group, "name": "all"}})["positions"] == {"name": "all"}
    gate = chosen_options({"positions": {**group, "name": "entropy_gate"}})["positions"]
    assert gate == {"name": "entropy_gate", "threshold": 0.5, "gate": "add"}


def test_validate_accepts_every_option_with_the_defaults():
    for p in PositionsName:
        validate(small_config(positions={"name": p.value}))


# --- early-stopped rollouts and the trainer ------------------------------------------------------


def test_first_n_stops_training_rollouts_and_evaluates_at_full_length(tiny_pair, tmp_path):
    from opd_exp.training.trainer import Trainer

    cfg = small_config(positions={"name": "first_n", "tokens": 2}, rollout={"max_new_tokens": 5, "on_policy_fraction": 0.5})
    tr = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    for engine in (tr.engines.student, tr.engines.teacher):
        assert engine.cfg.max_new_tokens == 2
    for engine in (tr.engines.eval_student, tr.engines.eval_teacher):
        assert engine.cfg.max_new_tokens == 5
    batch = tr.sample(0)
    assert batch.response_ids.shape[1] <= 2 and batch.num_response_tokens > 0
    metrics = tr.train_step()
    assert metrics["response/length_mean"] <= 2.0
    assert metrics["positions/weight_mean"] == 1.0  # every token of a stopped rollout counts


@pytest.mark.parametrize("name", ["iw_opd", "entropy_gate", "first"])
def test_trainer_steps_log_the_positions_metrics(tiny_pair, tmp_path, name):
    from opd_exp.training.trainer import Trainer

    cfg = small_config(positions={"name": name, "threshold": 1.0}, divergence={"name": "rkl"})
    tr = Trainer(cfg, tmp_path, pair=copy.deepcopy(tiny_pair), task=AddTask())
    m = tr.train_step()
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad/norm"])
    if name == "iw_opd":
        assert 1.0 <= m["positions/weight_mean"] <= 1.5
    elif name == "first":
        assert 0.3 <= m["positions/weight_mean"] <= 1.0
    else:
        assert m["positions/weight_mean"] == 1.0 and 0.0 <= m["positions/gate_rate"] <= 1.0


PLUGIN_RULE = r'''
import sys, torch
sys.path.insert(0, sys.argv[1])
from helpers.tiny import small_config
from opd_exp.training.objective import Objective
from opd_exp.training.positions import PositionRule, register_position_rule

@register_position_rule
class SecondHalf(PositionRule):
    """Each row's response tokens from the middle on, weight 2."""
    name, keys, float_weights = "second_half", (), True

    def counted(self, mask):
        m = mask.bool()
        index = torch.cumsum(m.long(), -1) - 1
        return m & (2 * index >= m.sum(-1, keepdim=True))

    def terms(self, per_token, counted, **kw):
        return 2 * per_token, {"positions/weight_mean": 2.0 * counted.to(kw["s"].dtype)}

g = torch.Generator().manual_seed(5)
zs = torch.randn(2, 4, 6, generator=g, dtype=torch.float64).requires_grad_(True)
zt = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
y = torch.randint(0, 6, (2, 4), generator=g)
mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
cfg = small_config(positions={"name": "second_half"}, estimator={"name": "full"}, loss={"name": "direct"}, divergence={"name": "rkl"})
out = Objective(cfg)(zs, zt, y, mask, on_policy=True, normalizer=6)
lp, lq = zs.log_softmax(-1), zt.log_softmax(-1)
d = (lp.exp() * (lp - lq)).sum(-1)
want = 2 * (d[0, 2] + d[0, 3] + d[1, 1]) / 6
print(float(out.loss), float(want), out.sums["positions/weight_mean"])
'''


def test_a_registered_position_rule_is_a_positions_option_and_trains_exactly(tmp_path):
    """A rule registered from one file becomes positions.name=<name> and its loss is its own counted,
    weighted sum (rkl, full vocabulary, by hand), through the same objective as the built-ins."""
    import subprocess
    import sys

    script = tmp_path / "rule.py"
    script.write_text(PLUGIN_RULE)
    res = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    got, want, weight_sum = map(float, res.stdout.split())
    assert got == pytest.approx(want, rel=1e-12) and weight_sum == 6.0


def test_every_built_in_option_is_a_registered_rule_with_its_keys():
    from opd_exp.config.positions import FLOAT_WEIGHTS, OPTION_KEYS
    from opd_exp.training.positions import POSITION_RULES, PositionRule, register_position_rule

    assert set(POSITION_RULES) >= {p.value for p in PositionsName}
    for name, rule in POSITION_RULES.items():
        assert OPTION_KEYS[name] == rule.keys and (name in FLOAT_WEIGHTS) == rule.float_weights

    class Typo(PositionRule):
        name, keys = "typo_rule", ("fractoin",)

    with pytest.raises(ValueError, match=r"register_position_rule: Typo reads fractoin, which the config cannot set; allowed: "):
        register_position_rule(Typo)
    assert "typo_rule" not in POSITION_RULES


@pytest.mark.parametrize(
    "overrides,lines",
    [
        ([], []),
        (["positions=first_n", "positions.tokens=8"], []),
        (
            ["positions.tokens=8"],
            ["opd-train: notice: positions.tokens=8 is not read by positions=all (only by first_n); it changes nothing"],
        ),
        (
            ["positions=iw_opd", "positions.fraction=0.5", "positions.gate=replace"],
            [
                "opd-train: notice: positions.fraction=0.5 is not read by positions=iw_opd (only by first, last); it changes nothing",
                "opd-train: notice: positions.gate=replace is not read by positions=iw_opd (only by entropy_gate); it changes nothing",
            ],
        ),
        (
            ["positions=first_n", "positions.tokens=40", "rollout.max_new_tokens=40"],
            [
                "opd-train: notice: positions.tokens=40 >= rollout.max_new_tokens=40: positions=first_n cuts no rollout "
                "(the same run as positions=all)"
            ],
        ),
    ],
)
def test_settings_that_change_nothing_are_said(overrides, lines):
    from opd_exp.config.positions import positions_notices

    assert positions_notices(_compose(*overrides)) == lines


def test_a_run_says_an_ignored_positions_key_on_its_console(tiny_pair, tmp_path, capsys):
    from opd_exp.training.trainer import Trainer

    Trainer(small_config(positions={"tokens": 5}), tmp_path, pair=copy.deepcopy(tiny_pair), task=AddTask())
    err = capsys.readouterr().err
    assert "opd-train: notice: positions.tokens=5 is not read by positions=all (only by first_n); it changes nothing" in err
