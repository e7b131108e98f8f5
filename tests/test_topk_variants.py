"""The top-k estimator zoo, each proved unbiased by enumerating the vocabulary or its bias measured.

Every registered divergence is tested (a new one with its defaults). Enumeration: one row per
possible sampled token y, weighted by S(y), in float64; the exact divergence and its gradient
come from ``Divergence.full`` and autograd.
"""

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from opd_exp.divergences import (
    DIVERGENCES,
    TOPK_ESTIMATORS,
    DivergenceCheckError,
    check_topk_estimators,
    generalized_kl_topk,
    get_divergence,
    set_estimate,
    student_topk_estimate,
    teacher_topk_estimate,
    topk_estimate,
    topk_estimator,
    truncation_masses,
    union_topk_estimate,
    verl_topk,
)
from opd_exp.divergences.check import format_rows, random_pair, topk_bias_table

pytestmark = pytest.mark.usefixtures("float64_default")

PARAM_GRIDS = {
    "jsd": [{"beta": b} for b in (0.0, 0.3, 0.5, 1.0)],
    "jsd_legacy": [{"beta": 0.5}],
    "skl": [{"alpha": 0.1}],
    "srkl": [{"alpha": 0.1}],
}
SPECS = [(name, params) for name in DIVERGENCES for params in PARAM_GRIDS.get(name, [{}])]
EXACT_SPECS = [spec for spec in SPECS if get_divergence(spec[0], **spec[1]).exact_cost]
UNBIASED = [name for name, e in TOPK_ESTIMATORS.items() if e.unbiased]
REGIMES = ("peaked-near", "peaked-far", "flat-near", "flat-far")


def spec_id(spec):
    name, params = spec
    return name + "".join(f"-{k}{v}" for k, v in params.items())


def make_pair(seed: int, regime: str, vocab: int, rows: int = 3):
    g = torch.Generator().manual_seed(seed)
    scale = 4.0 if regime.startswith("peaked") else 0.5
    zs = scale * torch.randn(rows, vocab, generator=g)
    noise = 0.2 * torch.randn(rows, vocab, generator=g)
    zt = zs + noise if regime.endswith("near") else scale * torch.randn(rows, vocab, generator=g)
    return zs, zt


def exact(d, zs, zt):
    """(D per row, grad_z of sum D)."""
    z = zs.clone().requires_grad_(True)
    D = d.full(z, zt)
    D.sum().backward()
    return D.detach(), z.grad


def enumerate_y(estimate, zs, zt):
    """E_{y~S}[grad surrogate], E_{y~S}[value], E_{y~S}[clamped] per row; ``estimate(z, t, y)``
    is called once per sampled token y (its own graph each time)."""
    t_all = zt.log_softmax(-1)
    S = zs.softmax(-1)
    grad, value, clamped = torch.zeros_like(zs), torch.zeros(zs.shape[0]), torch.zeros(zs.shape[0])
    for y in range(zs.shape[-1]):
        z = zs.clone().requires_grad_(True)
        out = estimate(z, t_all, torch.full(zs.shape[:-1], y))
        (S[:, y] * out.surrogate).sum().backward()
        grad += z.grad
        value += S[:, y] * out.value
        clamped += S[:, y] * out.clamped
    return grad, value, clamped


def rel(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-300))


# --- the unbiased ones: value and gradient, every divergence, k from 1 to V ---------------------


@pytest.mark.parametrize("vocab", [6, 8])
@pytest.mark.parametrize("name", UNBIASED)
@pytest.mark.parametrize("spec", EXACT_SPECS, ids=spec_id)
def test_unbiased_topk_estimators_by_enumeration(spec, name, vocab):
    d = get_divergence(spec[0], **spec[1])
    est = topk_estimator(name)
    sets_differ = 0
    for regime in REGIMES:
        for seed in range(3):
            zs, zt = make_pair(seed, regime, vocab)
            D, grad_D = exact(d, zs, zt)
            for k in (1, 2, 3, vocab):
                grad, value, _ = enumerate_y(lambda z, t, y, k=k: est.estimate(d, z, t, y, k=k), zs, zt)
                assert rel(value, D) <= 1e-10, (regime, seed, k)
                assert rel(grad, grad_D) <= 1e-9, (regime, seed, k)
                s_ids, t_ids = zs.topk(k).indices.sort().values, zt.topk(k).indices.sort().values
                sets_differ += int((s_ids != t_ids).any())
    assert sets_differ >= 10  # the student's set is not the teacher's in the cases tested


def test_student_topk_stays_unbiased_where_its_set_changes():
    """The student's top-k set is a function of its logits; across a tie it jumps, and the expected
    gradient on both sides is grad D (continuous there): the set itself is never differentiated."""
    d = get_divergence("jsd", beta=0.5)
    zt = torch.tensor([[0.3, -1.0, 1.2, 0.1, -0.4, 0.8]])
    D_sides, grads, sets = [], [], []
    for eps in (-1e-7, 1e-7):  # entries 1 and 3 swap ranks 3 and 4 of the student
        zs = torch.tensor([[2.0, 0.5 + eps, 1.5, 0.5, -1.0, -2.0]])
        sets.append(set(zs.topk(3).indices[0].tolist()))
        D, grad_D = exact(d, zs, zt)
        grad, value, _ = enumerate_y(lambda z, t, y: student_topk_estimate(d, z, t, y, k=3), zs, zt)
        assert rel(value, D) <= 1e-12 and rel(grad, grad_D) <= 1e-12
        D_sides.append(D)
        grads.append(grad)
    assert sets[0] == {0, 2, 3} and sets[1] == {0, 1, 2}
    assert rel(grads[0], grads[1]) <= 1e-6 and rel(D_sides[0], D_sides[1]) <= 1e-6


def test_a_set_that_looks_at_the_sampled_token_is_biased():
    """What the unbiasedness needs: K must not depend on y. Putting y into K (so the tail is never
    used) drops the tail's share of D."""
    d = get_divergence("rkl")
    zs, zt = make_pair(0, "flat-far", 6)
    D, _ = exact(d, zs, zt)

    def with_y(z, t, y):
        ids = torch.cat([z.detach().topk(2).indices, y.unsqueeze(-1)], -1)
        valid = torch.cat([torch.ones_like(ids[..., :2], dtype=torch.bool), ~(ids[..., :2] == y.unsqueeze(-1)).any(-1, keepdim=True)], -1)
        return set_estimate(d, z, ids, t.gather(-1, ids), y, t.gather(-1, y.unsqueeze(-1)).squeeze(-1), set_valid=valid)

    _, value, _ = enumerate_y(with_y, zs, zt)
    assert rel(value, D) > 0.05


def test_union_sums_each_id_once_and_equals_the_definition():
    d = get_divergence("fkl")
    zs = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0, 0.5]])
    zt = torch.tensor([[2.0, -2.0, 1.5, -1.0, -3.0, 0.0]])  # top-3: student {0, 1, 5}, teacher {0, 2, 5}
    t_all = zt.log_softmax(-1)
    y = torch.tensor([1])  # inside the union: no tail term
    out = union_topk_estimate(d, zs, t_all, y, k=3)
    S, T = zs.softmax(-1), zt.softmax(-1)
    K = [0, 1, 2, 5]
    want = (T[0, K] * (T[0, K] / S[0, K]).log()).sum()
    torch.testing.assert_close(out.value[0], want, rtol=1e-14, atol=0)
    torch.testing.assert_close(out.teacher_mass[0], T[0, K].sum(), rtol=1e-14, atol=0)
    torch.testing.assert_close(out.student_mass[0], S[0, K].sum(), rtol=1e-14, atol=0)


# --- truncation diagnostics ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(TOPK_ESTIMATORS))
def test_truncation_masses_are_the_masses_of_the_summed_set(name):
    d = get_divergence("rkl")
    zs, zt = make_pair(1, "peaked-far", 8, rows=4)
    t_all = zt.log_softmax(-1)
    S, T = zs.softmax(-1), t_all.exp()
    y = torch.zeros(4, dtype=torch.long)
    for k in (1, 3, 8):
        out = topk_estimator(name).estimate(d, zs, t_all, y, k=k)
        s_set = torch.zeros_like(S, dtype=torch.bool).scatter_(-1, zs.topk(k).indices, True)
        t_set = torch.zeros_like(S, dtype=torch.bool).scatter_(-1, zt.topk(k).indices, True)
        K = {"topk_student": s_set, "topk_union": s_set | t_set, "topk_verl": s_set | t_set}.get(name, t_set)
        torch.testing.assert_close(out.teacher_mass, (T * K).sum(-1), rtol=1e-13, atol=0)
        torch.testing.assert_close(out.student_mass, (S * K).sum(-1), rtol=1e-13, atol=0)
        if k == 8:
            torch.testing.assert_close(out.teacher_mass, torch.ones(4), rtol=1e-13, atol=0)


def test_teacher_topk_estimate_is_topk_estimate_with_its_masses():
    d = get_divergence("jsd", beta=0.3)
    zs, zt = make_pair(2, "flat-far", 8, rows=2)
    t_all = zt.log_softmax(-1)
    t_k, ids = t_all.topk(3)
    y = torch.tensor([4, 6])
    for renormalize in (False, True):
        z1, z2 = zs.clone().requires_grad_(True), zs.clone().requires_grad_(True)
        sur, val = topk_estimate(d, z1, t_k, ids, y, t_all.gather(-1, y[:, None])[:, 0], renormalize=renormalize)
        out = teacher_topk_estimate(d, z2, t_k, ids, y, t_all.gather(-1, y[:, None])[:, 0], renormalize=renormalize)
        assert torch.equal(sur, out.surrogate) and torch.equal(val, out.value)
        sur.sum().backward()
        out.surrogate.sum().backward()
        assert torch.equal(z1.grad, z2.grad)
        tm, sm = truncation_masses(zs, ids, t_k)
        assert torch.equal(out.teacher_mass, tm) and torch.equal(out.student_mass, sm)


# --- ms-swift MOPD's generalised KL: KL minus the tail's generalised KL ----------------------


def generalized_kl_terms(p, q):
    return p * (p / q).log() - p + q


@pytest.mark.parametrize("spec", [("rkl", {}), ("fkl", {}), ("jsd", {"beta": 1.0}), ("jsd", {"beta": 0.0})], ids=spec_id)
def test_generalized_kl_is_kl_minus_the_tails_generalized_kl(spec):
    d = get_divergence(spec[0], **spec[1])
    reverse = spec[0] == "rkl" or spec[1].get("beta") == 1.0
    for regime in REGIMES:
        zs, zt = make_pair(0, regime, 8)
        t_all = zt.log_softmax(-1)
        D, grad_D = exact(d, zs, zt)
        for k in (1, 3, 8):
            t_k, ids = t_all.topk(k)
            z = zs.clone().requires_grad_(True)
            out = generalized_kl_topk(d, z, t_k, ids)
            out.surrogate.sum().backward()
            # closed form, from probabilities: p = S, q = T (reverse) or p = T, q = S (forward)
            zr = zs.clone().requires_grad_(True)
            S, T = zr.softmax(-1), zt.softmax(-1)
            g = generalized_kl_terms(S, T) if reverse else generalized_kl_terms(T, S)
            tail = torch.ones_like(S, dtype=torch.bool).scatter_(-1, ids, False)
            g_tail = (g * tail).sum(-1)
            (g * ~tail).sum().backward()  # MOPD's formula over the teacher's top-k
            torch.testing.assert_close(out.value, D - g_tail.detach(), rtol=1e-10, atol=1e-13)
            torch.testing.assert_close(z.grad, zr.grad, rtol=1e-10, atol=1e-13)
            assert (g >= 0).all() and (out.value - D <= 1e-12 * D.abs().max() + 1e-15).all()  # biased low by g_tail >= 0
            if k == 8:
                torch.testing.assert_close(out.value, D, rtol=1e-12, atol=1e-15)
                torch.testing.assert_close(z.grad, grad_D, rtol=1e-10, atol=1e-13)


def test_generalized_kl_is_zero_when_the_student_matches_the_teacher_on_its_top_k_only():
    """The stated case of its bias: S = T on the teacher's top-2, the tail mass moved elsewhere.
    The loss and its gradient are 0 while KL(S||T) = 0.2797 (bias -0.2797, all of it)."""
    d = get_divergence("rkl")
    T = torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.05, 0.05]])
    S = torch.tensor([[0.4, 0.3, 0.29, 0.003, 0.004, 0.003]])
    zs, t_all = S.log(), T.log()
    t_k, ids = t_all.topk(2)
    z = zs.clone().requires_grad_(True)
    out = generalized_kl_topk(d, z, t_k, ids)
    out.surrogate.sum().backward()
    kl = float(d.full(zs, t_all))
    assert out.value.item() == pytest.approx(0.0, abs=1e-15) and z.grad.abs().max().item() < 1e-15
    assert kl == pytest.approx(0.27970, abs=5e-6)


def test_generalized_kl_refuses_a_divergence_that_is_not_a_kl():
    zs, zt = make_pair(0, "flat-far", 6)
    t_k, ids = zt.log_softmax(-1).topk(2)
    for name, params in SPECS:
        d = get_divergence(name, **params)
        if name in ("rkl", "fkl") or (name == "jsd" and params["beta"] in (0.0, 1.0)):
            continue
        with pytest.raises(
            ValueError, match=r"^generalized_kl_topk: divergence=.* is not a KL; allowed: rkl, fkl \(or jsd with beta 0 or 1\)$"
        ):
            generalized_kl_topk(d, zs, t_k, ids)


# --- verl's clamped truncated top-k, a peer baseline ---------------------------------------


def verl_reference(loss_mode, student_logits, teacher_logits, k, beta=0.5):
    """The top-k loss of verl PR #5041's draft as its code computes it (volcengine/verl commit
    3baac345: distillation/losses.py and fsdp/utils.py; never released): the student's top-k ids
    and the teacher's concatenated and sorted, a repeated id's log-probs set to -inf on both sides,
    both clamped at log(1e-8), kl_div terms summed, the loss clamped at 0."""
    lp_s, lp_t = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    ids = torch.cat([lp_s.detach().topk(k).indices, lp_t.topk(k).indices], -1).sort(-1).values
    dupe = F.pad(ids.diff(dim=-1), (0, 1), value=1).eq(0)
    q = lp_s.gather(-1, ids).masked_fill(dupe, -math.inf).clamp(min=math.log(1e-8))
    p = lp_t.gather(-1, ids).masked_fill(dupe, -math.inf).clamp(min=math.log(1e-8))
    if loss_mode == "forward":
        loss = F.kl_div(q, p, reduction="none", log_target=True).sum(-1)
    elif loss_mode == "reverse":
        loss = F.kl_div(p, q, reduction="none", log_target=True).sum(-1)
    else:
        m = (beta * p.exp() + (1 - beta) * q.exp()).log()
        loss = beta * F.kl_div(m, p, reduction="none", log_target=True).sum(-1) + (1 - beta) * F.kl_div(
            m, q, reduction="none", log_target=True
        ).sum(-1)
    return loss.clamp_min(0.0)


@pytest.mark.parametrize(("mode", "spec"), [("forward", ("fkl", {})), ("reverse", ("rkl", {})), ("jsd", ("jsd", {"beta": 0.5}))])
def test_verl_topk_matches_verls_code(mode, spec):
    d = get_divergence(spec[0], **spec[1])
    cases = [make_pair(seed, regime, 8, rows=4) for seed in range(2) for regime in REGIMES]
    # a teacher top-k entry the student gives < 1e-8 (the log-prob floor acts)
    cases.append((torch.tensor([[10.0, 9.0, -12.0, 0.0, 1.0, -1.0]]), torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5, -3.0]])))
    for zs, zt in cases:
        for k in (1, 2, 3):
            z1, z2 = zs.clone().requires_grad_(True), zs.clone().requires_grad_(True)
            out = verl_topk(d, z1, zt.log_softmax(-1), k=k)
            want = verl_reference(mode, z2, zt, k)
            torch.testing.assert_close(out.value, want.detach(), rtol=1e-12, atol=1e-15)
            out.surrogate.sum().backward()
            want.sum().backward()
            torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-15)
            assert torch.equal(out.clamped, out.value == 0)


def verl_release_reference(student_logits, teacher_logits, k, log_prob_min_clamp=-10.0, loss_max_clamp=10.0):
    """verl v0.8.0's released ``forward_kl_topk`` at its defaults (DistillationLossConfig): the
    student's log-probs gathered on the TEACHER's top-k ids only (fsdp/losses.py
    compute_forward_kl_topk), both clamped at ``log_prob_min_clamp``, sum p_T (log p_T - log p_S),
    clamped at 0 (losses.py compute_forward_kl_topk), then to +-``loss_max_clamp`` (distillation_loss)."""
    lp_s, lp_t = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    t_k, ids = lp_t.topk(k)
    s_k = lp_s.gather(-1, ids).clamp_min(log_prob_min_clamp)
    t_k = t_k.clamp_min(log_prob_min_clamp)
    loss = (t_k.exp() * (t_k - s_k)).sum(-1).clamp_min(0.0)
    return loss.clamp(min=-loss_max_clamp, max=loss_max_clamp)


def test_topk_verl_is_not_verls_released_forward_kl_topk_and_the_docs_say_by_how_much():
    """Before: topk_verl was documented as verl's code; it is PR #5041's unreleased draft. On the
    forward-KL cases above it differs from v0.8.0's forward_kl_topk as docs/divergences.md states."""
    d = get_divergence("fkl")
    cases = [make_pair(seed, regime, 8, rows=4) for seed in range(2) for regime in REGIMES]
    cases.append((torch.tensor([[10.0, 9.0, -12.0, 0.0, 1.0, -1.0]]), torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5, -3.0]])))
    differ = positions = differing = 0
    worst, worst_random = 0.0, 0.0
    with torch.no_grad():
        for i, (zs, zt) in enumerate(cases):
            for k in (1, 2, 3):
                gap = (verl_topk(d, zs, zt.log_softmax(-1), k=k).value - verl_release_reference(zs, zt, k)).abs()
                differ += int((gap > 1e-9).any())
                positions += gap.numel()
                differing += int((gap > 1e-9).sum())
                worst = max(worst, float(gap.max()))
                worst_random = max(worst_random, float(gap.max())) if i < len(cases) - 1 else worst_random
    assert (differ, len(cases) * 3, differing, positions) == (21, 27, 57, 99)
    assert round(worst, 2) == 4.63 and round(worst_random, 2) == 0.68
    docs = " ".join((Path(__file__).parents[1] / "docs" / "divergences.md").read_text().split())
    assert (
        "differs from v0.8.0's `forward_kl_topk` on 21 of 27 cases (57 of 99 positions) by up to 4.63 nats (0.68 on the 8 random pairs"
        in docs
    )
    assert "unreleased" in TOPK_ESTIMATORS["topk_verl"].peer and "NOT verl's released loss" in verl_topk.__doc__


def test_verl_topk_bias_is_the_missing_tail_where_no_clamp_acts():
    """Stated case (random_pair seed 0, vocabulary 8, independent pair, rkl, k=2): no clamp or floor
    acts, and the bias is exactly -sum of phi outside the union: -0.0810 of D = 0.8208."""
    d = get_divergence("rkl")
    zs, zt = (x.unsqueeze(0) for x in random_pair(0, vocab=8, regime="far"))
    t_all = zt.log_softmax(-1)
    D, _ = exact(d, zs, zt)
    out = verl_topk(d, zs, t_all, k=2)
    K = torch.zeros_like(zs, dtype=torch.bool).scatter_(-1, zs.topk(2).indices, True).scatter_(-1, zt.topk(2).indices, True)
    phi = d.pointwise(zs.log_softmax(-1), t_all)
    assert not out.clamped.any() and zs.softmax(-1)[K].min() > 1e-8 and t_all.exp()[K].min() > 1e-8
    bias = out.value - D
    torch.testing.assert_close(bias, -(phi * ~K).sum(-1), rtol=1e-12, atol=1e-15)
    assert D.item() == pytest.approx(0.8208, abs=5e-5) and bias.item() == pytest.approx(-0.0810, abs=5e-5)


def test_verl_topk_clamp_zeroes_the_value_and_the_gradient_and_is_reported():
    """Stated case (a student close to its teacher, fkl, k=1): the truncated forward KL is negative,
    so the clamp sets value and gradient to 0 while D = 0.00287 > 0 (bias -D)."""
    d = get_divergence("fkl")
    zs = torch.tensor([[1.1, 0.2, 0.0, -0.5, -1.2]])
    zt = torch.tensor([[1.0, 0.2, 0.0, -0.5, -1.0]])
    z = zs.clone().requires_grad_(True)
    out = verl_topk(d, z, zt.log_softmax(-1), k=1)
    out.surrogate.sum().backward()
    D, grad_D = exact(d, zs, zt)
    assert out.clamped.tolist() == [True] and out.value.item() == 0.0 and z.grad.abs().max().item() == 0.0
    assert D.item() == pytest.approx(0.00287, abs=5e-6) and grad_D.abs().max() > 1e-2
    # the unbiased estimators still see it
    grad, value, clamped = enumerate_y(lambda z, t, y: union_topk_estimate(d, z, t, y, k=1), zs, zt)
    assert rel(value, D) <= 1e-12 and rel(grad, grad_D) <= 1e-12 and clamped.item() == 0.0


def test_verl_topk_loss_clamp_caps_and_reports():
    d = get_divergence("rkl")
    zs, zt = make_pair(0, "peaked-far", 8, rows=4)
    t_all = zt.log_softmax(-1)
    free = verl_topk(d, zs, t_all, k=2)
    capped = verl_topk(d, zs, t_all, k=2, loss_clamp=0.5)
    torch.testing.assert_close(capped.value, free.value.clamp(max=0.5), rtol=0, atol=0)
    assert torch.equal(capped.clamped, free.clamped | (free.value > 0.5)) and capped.clamped.any()


# --- the measured biases, as the docs quote them --------------------------------------------


BIAS_COLUMNS = ["estimator", "divergence", "k", "regime", "D", "bias", "rel_bias", "grad_cos", "clamp_rate"]


def test_biased_estimators_are_biased_and_the_docs_quote_the_measured_table():
    rows = topk_bias_table()
    assert {r["estimator"] for r in rows} == {n for n, e in TOPK_ESTIMATORS.items() if not e.unbiased}
    for r in rows:  # every biased estimator is off in every case of the table
        assert abs(r["bias"]) > 1e-4 or r["grad_cos"] < 0.999, r
    docs = (Path(__file__).parents[1] / "docs" / "divergences.md").read_text()
    assert format_rows(rows, BIAS_COLUMNS) in docs


# --- the public check ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", EXACT_SPECS, ids=spec_id)
def test_every_registered_divergence_passes_check_topk_estimators(spec):
    report = check_topk_estimators(get_divergence(spec[0], **spec[1]), seeds=(0, 1))
    assert report.ok and len(report.results) == 2 * len(UNBIASED)
    assert all(r.worst <= 1e-9 for r in report.results), str(report)
    assert str(report).startswith(f"check_topk_estimators({get_divergence(spec[0], **spec[1])!r}):\n  ok   topk: E_y[value] = D")


def test_check_topk_estimators_fails_in_one_line():
    with pytest.raises(DivergenceCheckError) as err:
        check_topk_estimators(get_divergence("jsd_legacy", beta=0.5))
    assert re.fullmatch(
        r"check_topk_estimators\(JensenShannonLegacy\(beta=0\.5\)\): 'topk: E_y\[grad surrogate\] = grad D' fails: "
        r"error [0-9.e+-]+ > 1e-06 \([a-z-]+, seed \d, k=\d\)",
        str(err.value),
    ), str(err.value)
    for name in ("topk_renorm", "topk_verl"):
        with pytest.raises(
            DivergenceCheckError, match=rf"^check_topk_estimators\(ReverseKL\(\)\): '{name}: E_y\[value\] = D \(unbiased\)' fails: "
        ):
            check_topk_estimators(get_divergence("rkl"), estimators=[name])
    report = check_topk_estimators(get_divergence("rkl"), estimators=["topk_verl"], raise_on_failure=False)
    assert not report.ok and "FAIL topk_verl: E_y[value] = D (unbiased)" in str(report)


def test_estimator_names_and_errors():
    assert list(TOPK_ESTIMATORS) == ["topk", "topk_student", "topk_union", "topk_renorm", "topk_generalized_kl", "topk_verl"]
    assert UNBIASED == ["topk", "topk_student", "topk_union"]
    with pytest.raises(ValueError, match=r"^unknown top-k estimator 'topk_x'; allowed: topk, topk_student, topk_union, topk_renorm, "):
        topk_estimator("topk_x")
