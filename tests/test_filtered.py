"""Filtered sampling (top-k / top-p): values stay unbiased with the exact filtered-mass term,
sequence credit follows the exact gradient, out-of-filter tokens are caught, and what cannot be
defined under a filter is refused. Exact by enumeration (float64)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from helpers.tiny import small_config
from opd_exp.config.schema import validate
from opd_exp.divergences import DIVERGENCES, filtered_value, get_divergence, sequence_returns
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.monitors import Monitors
from opd_exp.training.objective import Objective
from opd_exp.training.rollout import sampling_logits

pytestmark = pytest.mark.usefixtures("float64_default")

V = 6
FILTERS = [dict(top_k=3), dict(top_p=0.7), dict(top_k=4, top_p=0.8, temperature=0.7)]
PARAMS = {"jsd": [{"beta": 0.1}, {"beta": 0.5}, {"beta": 0.9}], "skl": [{"alpha": 0.1}, {"alpha": 0.6}], "srkl": [{"alpha": 0.3}]}


def every_divergence():
    for name in DIVERGENCES:  # whatever is registered
        for params in PARAMS.get(name, [{}]):
            yield name, params


def exact_filtered(d, zf, zt):
    """D(S, T) with S = softmax(zf) and log S = -inf exactly on the filtered entries."""
    S = torch.softmax(zf, -1)
    s = torch.where(S > 0, torch.log_softmax(zf, -1), torch.tensor(float("-inf")))
    return d.pointwise(s, torch.log_softmax(zt, -1)).sum(-1)


@pytest.mark.parametrize("filt", FILTERS, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
@pytest.mark.parametrize("spec", list(every_divergence()), ids=lambda s: s[0] + "".join(str(v) for v in s[1].values()))
def test_token_value_plus_filtered_mass_is_unbiased(spec, filt):
    d = get_divergence(spec[0], **spec[1])
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        zs, zt = 2 * torch.randn(1, V, generator=g), 2 * torch.randn(1, V, generator=g)
        zf = sampling_logits(zs, **filt).double()
        S = torch.softmax(zf, -1)[0]
        assert (S == 0).any()  # the filter removed something
        s, t = torch.log_softmax(zf, -1)[0], torch.log_softmax(zt, -1)[0]
        F = filtered_value(d, zf, zt)[0]
        support = S > 0
        expected = (S[support] * d.token_value(s[support], t[support])).sum() + F
        want = exact_filtered(d, zf, zt)[0]
        if spec[0] == "fkl":  # KL(T||S) is infinite: the teacher has mass where S has none
            assert math.isinf(float(F)) and math.isinf(float(want))
            continue
        torch.testing.assert_close(expected, want, rtol=1e-10, atol=1e-12)
        # full() on the filtered logits (FILTERED_LOGIT, not -inf) is exact too
        torch.testing.assert_close(d.full(zf, zt)[0], want, rtol=1e-8, atol=1e-10)


def test_without_the_filtered_mass_jsd_and_skl_are_biased():
    """What the term fixes: top_k=3 of 6 (the values a sampled token sees alone); tvd's
    one-sided value needs none."""
    g = torch.Generator().manual_seed(0)
    zs, zt = 2 * torch.randn(1, V, generator=g), 2 * torch.randn(1, V, generator=g)
    zf = sampling_logits(zs, top_k=3).double()
    S = torch.softmax(zf, -1)[0]
    s, t = torch.log_softmax(zf, -1)[0], torch.log_softmax(zt, -1)[0]
    for name, params in (("jsd", {"beta": 0.5}), ("skl", {"alpha": 0.1}), ("tvd", {})):
        d = get_divergence(name, **params)
        naive = float((S[S > 0] * d.token_value(s[S > 0], t[S > 0])).sum())
        bias = abs(naive - float(exact_filtered(d, zf, zt)[0]))
        assert bias < 1e-12 if name == "tvd" else bias > 0.05, name


def test_filtered_value_excludes_the_given_ids_and_respects_the_mask():
    d = get_divergence("skl", alpha=0.5)  # phi(-inf, t) = T log 2
    zs = torch.tensor([[[3.0, 2.0, 1.0, 0.0, -1.0]] * 2])
    zt = torch.zeros(1, 2, 5)  # uniform teacher: T = 0.2 each
    zf = sampling_logits(zs, top_k=2)
    F = filtered_value(d, zf, zt, mask=torch.tensor([[True, False]]))
    torch.testing.assert_close(F, torch.tensor([[0.6 * math.log(2), 0.0]]))
    F = filtered_value(d, zf, zt, exclude_ids=torch.tensor([[[4], [4]]]))
    torch.testing.assert_close(F, torch.tensor([[0.4 * math.log(2)] * 2]))


# -- sequence credit under filtering (tabular model, enumerated) ------------------------

VT, L = 4, 3
PREFIXES = [p for n in range(L) for p in itertools.product(range(VT), repeat=n)]
INDEX = {p: i for i, p in enumerate(PREFIXES)}


def _exact_objective(d, zf, zt):
    """J = sum_t E_{y<t ~ S}[D_t(y<t)] over the filtered S, prefixes enumerated."""
    logS = zf.log_softmax(-1)
    D = d.full(zf, zt)
    J = torch.zeros(())
    for p in PREFIXES:
        prob = torch.ones(())
        for i in range(len(p)):
            prob = prob * logS[INDEX[p[:i]], p[i]].exp()
        J = J + prob * D[INDEX[p]]
    return J


def _expected_reinforce(d, zs, zt, filt, gamma):
    zf = sampling_logits(zs, **filt)
    seqs = list(itertools.product(range(VT), repeat=L))
    rows = torch.tensor([[INDEX[y[:i]] for i in range(L)] for y in seqs])
    ys = torch.tensor(seqs)
    logS = zf.log_softmax(-1)
    s = logS[rows, ys]
    t = zt.log_softmax(-1)[rows, ys]
    prob = s.sum(-1).exp().detach()
    live = prob > 0  # sequences the filtered student can sample
    s, t, rows, prob = s[live], t[live], rows[live], prob[live]
    mask = torch.ones_like(s, dtype=torch.bool)
    F = filtered_value(d, zf, zt)[rows]  # the exact filtered mass at every visited prefix
    R = sequence_returns(d.token_cost(s.detach(), t), d.token_value(s.detach(), t) + F, mask, gamma)
    (grad,) = torch.autograd.grad((prob[:, None] * R.detach() * s).sum(), zs)
    return grad


@pytest.mark.parametrize("filt", [dict(top_k=2), dict(top_p=0.75)], ids=["top_k2", "top_p0.75"])
@pytest.mark.parametrize(
    "spec",
    [s for s in every_divergence() if s[0] != "fkl" and get_divergence(s[0], **s[1]).exact_cost],
    ids=lambda s: s[0] + "".join(str(v) for v in s[1].values()),
)
def test_sequence_credit_under_filtering_follows_the_exact_gradient(spec, filt):
    d = get_divergence(spec[0], **spec[1])
    g = torch.Generator().manual_seed(5)
    zs = (1.5 * torch.randn(len(PREFIXES), VT, generator=g)).requires_grad_(True)
    zt = 1.5 * torch.randn(len(PREFIXES), VT, generator=g)
    got = _expected_reinforce(d, zs, zt, filt, gamma=1.0)
    (want,) = torch.autograd.grad(_exact_objective(d, sampling_logits(zs, **filt), zt), zs)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10)


# -- the objective under a filter -------------------------------------------------------


def _enumerated(cfg, zs, zt):
    """E_{y~S} of the objective's and the monitors' per-token sums, S the filtered distribution
    (one position)."""
    obj, monitors = Objective(cfg), Monitors(cfg)
    zf = sampling_logits(zs, cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
    probs = torch.softmax(zf, -1)[0, 0]
    mean: dict[str, float] = {}
    for y in range(V):
        if probs[y] == 0:
            continue
        out = obj(zf, zt, torch.tensor([[y]]), torch.ones(1, 1, dtype=torch.bool), on_policy=True, normalizer=1)
        for k, v in {**out.sums, **monitors(zf, zt, out).sums}.items():
            mean[k] = mean.get(k, 0.0) + float(probs[y]) * v
    return mean, zf


@pytest.mark.parametrize("estimator", [{"name": "sampled"}, {"name": "topk", "k": 2}])
@pytest.mark.parametrize("rollout", [{"top_k": 3}, {"top_p": 0.7}])
def test_objective_values_are_unbiased_under_a_filter(estimator, rollout):
    loss = {"name": "reinforce"}
    cfg = small_config(divergence={"name": "jsd", "beta": 0.5}, estimator=estimator, loss=loss, rollout=rollout)
    g = torch.Generator().manual_seed(2)
    zs, zt = 2 * torch.randn(1, 1, V, generator=g), 2 * torch.randn(1, 1, V, generator=g)
    mean, zf = _enumerated(cfg, zs, zt)
    jsd = float(get_divergence("jsd", beta=0.5).full(zf, zt))
    assert mean["jsd/mean"] == pytest.approx(jsd, rel=1e-9)
    if estimator["name"] == "topk":  # its advantage is minus the value (sequence credit's input)
        assert -mean["advantages/mean"] == pytest.approx(jsd, rel=1e-9)
    assert mean["kl/reverse"] == pytest.approx(float(get_divergence("rkl").full(zf, zt)), rel=1e-9)
    assert mean["exact/jsd"] == pytest.approx(jsd, rel=1e-9)
    assert "kl/forward" not in mean and "exact/kl_forward" not in mean  # infinite: not logged


def test_a_sampled_token_outside_the_filter_is_kept_out_and_counted():
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "sampled"}, loss={"name": "reinforce"}, rollout={"top_k": 2})
    obj = Objective(cfg)
    g = torch.Generator().manual_seed(1)
    zs = sampling_logits(2 * torch.randn(1, 3, V, generator=g), top_k=2).requires_grad_(True)
    zt = 2 * torch.randn(1, 3, V, generator=g)
    kept = zs.detach()[0].argmax(-1)
    outside = zs.detach()[0, 1].argmin()  # filtered out at position 1
    y = torch.stack([kept[0], outside, kept[2]])[None]
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = obj(zs, zt, y, mask, on_policy=True, normalizer=3)
    ref = obj(zs, zt, y, torch.tensor([[True, False, True]]), on_policy=True, normalizer=3)
    assert out.counts == {"rollout/outside_filter_tokens": 1.0}
    assert ref.counts == {"rollout/outside_filter_tokens": 0.0}
    assert float(out.loss.detach()) == float(ref.loss.detach()) and out.sums == ref.sums
    assert all(math.isfinite(v) for v in out.sums.values())


# -- refusals and what clipping reports ---------------------------------------------------


@pytest.mark.parametrize(
    "groups,message",
    [
        (
            dict(divergence={"name": "fkl"}, rollout={"top_k": 5}),
            "rollout.top_k=5 is not allowed; allowed: 0 (off) with divergence=fkl: KL(T||S) is infinite where the teacher "
            "has mass the filter removes; use rkl, jsd (beta > 0), skl, srkl or tvd with a filter",
        ),
        (
            dict(divergence={"name": "jsd", "beta": 0.0}, rollout={"top_p": 0.9}),
            "rollout.top_p=0.9 is not allowed; allowed: 1.0 (off) with divergence=jsd with beta=0: KL(T||S) is infinite "
            "where the teacher has mass the filter removes; use rkl, jsd (beta > 0), skl, srkl or tvd with a filter",
        ),
        (
            dict(divergence={"name": "fkl", "clip": 5.0}, estimator={"name": "full"}, loss={"name": "direct"}),
            "divergence.clip=5.0 is not allowed; allowed: null with estimator=full (the clip caps the sampled cost; "
            "estimator=full uses none)",
        ),
        (
            dict(divergence={"name": "fkl", "clip": 5.0}, estimator={"name": "topk_renorm"}, loss={"name": "direct"}),
            "divergence.clip=5.0 is not allowed; allowed: null with estimator=topk_renorm (the clip caps the sampled cost; "
            "estimator=topk_renorm uses none)",
        ),
    ],
)
def test_what_a_filter_or_estimator_cannot_define_is_refused(groups, message):
    with pytest.raises(ConfigError) as err:
        small_config(**groups)
    assert str(err.value) == message


def test_clipped_frac_counts_only_clipped_tail_tokens():
    """topk: the clip bites only in the sampled tail (y outside the teacher's top-k)."""
    cfg = small_config(divergence={"name": "fkl", "clip": 0.5}, estimator={"name": "topk", "k": 2}, loss={"name": "reinforce"})
    validate(cfg)
    obj = Objective(cfg)
    zs = torch.zeros(1, 1, V)  # S uniform
    zt = torch.tensor([[[5.0, 4.0, 3.0, -5.0, -5.0, -5.0]]])  # r = 6 T > 0.5 on ids 0, 1 (top-2) and 2
    one = torch.ones(1, 1, dtype=torch.bool)
    frac = [obj(zs, zt, torch.tensor([[y]]), one, on_policy=True, normalizer=1).sums["cost/clipped_frac"] for y in range(V)]
    assert frac == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_skl_full_gradient_is_finite_where_both_have_no_mass():
    d = get_divergence("skl", alpha=0.2)
    inf = float("-inf")
    zs = torch.tensor([[0.5, -0.3, 1.0, inf]], requires_grad=True)
    zt = torch.tensor([[0.1, 0.7, -0.2, inf]])
    d.full(zs, zt).sum().backward()
    z3 = zs.detach()[:, :3].clone().requires_grad_(True)
    d.full(z3, zt[:, :3]).sum().backward()
    assert torch.isfinite(zs.grad).all()
    torch.testing.assert_close(zs.grad[:, :3], z3.grad)
    assert zs.grad[0, 3] == 0


def test_objective_sequence_returns_use_the_filtered_values():
    """sampled + credit=sequence under top_k: enumerated over (y0, y1), the summed advantage is
    -(E c_0 + E c_1 + D_1): the future part is the exact D_1, filtered mass included."""
    cfg = small_config(
        divergence={"name": "jsd", "beta": 0.5},
        estimator={"name": "sampled"},
        loss={"name": "reinforce", "credit": "sequence"},
        rollout={"top_k": 3},
    )
    obj, d = Objective(cfg), get_divergence("jsd", beta=0.5)
    g = torch.Generator().manual_seed(4)
    zf = sampling_logits(2 * torch.randn(1, 2, V, generator=g), top_k=3)
    zt = 2 * torch.randn(1, 2, V, generator=g)
    S = torch.softmax(zf, -1)[0]
    s, t = torch.log_softmax(zf, -1)[0], torch.log_softmax(zt, -1)[0]
    mean = 0.0
    for y0, y1 in itertools.product(range(V), repeat=2):
        p = float(S[0, y0] * S[1, y1])
        if p == 0:
            continue
        out = obj(zf, zt, torch.tensor([[y0, y1]]), torch.ones(1, 2, dtype=torch.bool), on_policy=True, normalizer=1)
        mean += p * out.sums["advantages/mean"]
    live = S > 0
    expected_cost = sum(float((S[i][live[i]] * d.token_cost(s[i][live[i]], t[i][live[i]])).sum()) for i in range(2))
    assert mean == pytest.approx(-(expected_cost + float(d.full(zf, zt)[0, 1])), rel=1e-9)


def test_the_public_check_covers_every_registered_divergence():
    from opd_exp.divergences.check import filtered_value_error, random_pair

    for name, params in every_divergence():
        zs, zt = random_pair(3, vocab=8)
        err = filtered_value_error(get_divergence(name, **params), zs, zt, top_k=3)
        assert math.isnan(err) if name == "fkl" else abs(err) < 1e-12, (name, err)


# -- the top-k estimator under a filter (through the objective, enumerated) ----------------

TOPK_SPECS = [s for s in every_divergence() if s[0] != "fkl" and get_divergence(s[0], **s[1]).exact_cost]


def _topk_cfg(spec, credit, filt):
    div = {"name": spec[0], **spec[1]}
    loss = {"name": "reinforce", "credit": credit, "gamma": 1.0}
    return small_config(divergence=div, estimator={"name": "topk", "k": 2}, loss=loss, rollout=filt)


@pytest.mark.parametrize("filt", [dict(top_k=3), dict(top_p=0.7)], ids=["top_k3", "top_p0.7"])
@pytest.mark.parametrize("spec", TOPK_SPECS, ids=lambda s: s[0] + "".join(str(v) for v in s[1].values()))
def test_topk_estimator_under_a_filter_is_exact_in_expectation(spec, filt):
    """One position, y ~ the filtered S enumerated: E[-advantage] (the value sequence credit
    sums) is the exact filtered D and E[grad loss] its autograd gradient, for every divergence
    (tvd's tail counts 0.5 T on filtered entries: its one-sided ``token_value`` is not used)."""
    obj, d = Objective(_topk_cfg(spec, "token", filt)), get_divergence(spec[0], **spec[1])
    one = torch.ones(1, 1, dtype=torch.bool)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        zs = (2 * torch.randn(1, 1, V, generator=g)).requires_grad_(True)
        zt = 2 * torch.randn(1, 1, V, generator=g)
        zf = sampling_logits(zs, **filt)
        S = torch.softmax(zf.detach(), -1)[0, 0]
        value, loss = 0.0, torch.zeros(())
        for y in range(V):
            if S[y] > 0:
                out = obj(zf, zt, torch.tensor([[y]]), one, on_policy=True, normalizer=1)
                value, loss = value - float(S[y]) * out.sums["advantages/mean"], loss + S[y] * out.loss
        want = exact_filtered(d, zf, zt)[0, 0]
        (want_grad,) = torch.autograd.grad(want, zs, retain_graph=True)
        (grad,) = torch.autograd.grad(loss, zs)
        assert value == pytest.approx(float(want.detach()), rel=1e-10, abs=1e-12), seed
        torch.testing.assert_close(grad, want_grad, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("spec", TOPK_SPECS, ids=lambda s: s[0] + "".join(str(v) for v in s[1].values()))
def test_topk_estimator_with_sequence_credit_under_a_filter_follows_the_exact_gradient(spec):
    """The tabular model (vocabulary 4, length 3) under top_k=3: the objective's expected
    gradient, every sequence enumerated, is the gradient of J = sum_t E[D_t]; the future values
    include the filtered entries outside the teacher's top-k."""
    filt = dict(top_k=3)
    obj, d = Objective(_topk_cfg(spec, "sequence", filt)), get_divergence(spec[0], **spec[1])
    g = torch.Generator().manual_seed(5)
    zs = (1.5 * torch.randn(len(PREFIXES), VT, generator=g)).requires_grad_(True)
    zt = 1.5 * torch.randn(len(PREFIXES), VT, generator=g)
    zf = sampling_logits(zs, **filt)
    logS = zf.detach().log_softmax(-1)
    total = torch.zeros(())
    for y in itertools.product(range(VT), repeat=L):
        rows = [INDEX[y[:i]] for i in range(L)]
        prob = logS[rows, list(y)].sum().exp()
        if prob > 0:
            out = obj(zf[rows][None], zt[rows][None], torch.tensor([y]), torch.ones(1, L, dtype=torch.bool), on_policy=True, normalizer=1)
            total = total + prob * out.loss
    (got,) = torch.autograd.grad(total, zs)
    (want,) = torch.autograd.grad(_exact_objective(d, sampling_logits(zs, **filt), zt), zs)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10)
