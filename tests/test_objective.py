"""The objective: each estimator x loss form follows kl_coef * grad D in expectation; masks,
teacher-sampled batches, gradient accumulation."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny import small_config
from opd_exp.config.schema import validate
from opd_exp.divergences import get_divergence
from opd_exp.training.objective import Objective

V = 6


def _expected_grad(cfg, zs, zt):
    """E_{y~S}[grad loss(y)] by enumerating the vocabulary at one position."""
    obj = Objective(cfg)
    probs = torch.softmax(zs.detach(), -1)[0, 0]
    total = torch.zeros_like(zs)
    for y in range(V):
        z = zs.detach().clone().requires_grad_(True)
        out = obj(z, zt, torch.tensor([[y]]), torch.ones(1, 1, dtype=torch.bool), on_policy=True, normalizer=1)
        (g,) = torch.autograd.grad(out.loss, z)
        total += probs[y] * g
    return total


@pytest.mark.parametrize(
    "divergence,estimator,loss",
    [
        ({"name": "rkl"}, {"name": "sampled"}, {"name": "ppo"}),
        ({"name": "jsd", "beta": 0.3}, {"name": "sampled"}, {"name": "ppo"}),
        ({"name": "fkl"}, {"name": "sampled"}, {"name": "reinforce"}),
        ({"name": "jsd", "beta": 0.9}, {"name": "sampled"}, {"name": "reinforce"}),
        ({"name": "tvd"}, {"name": "sampled"}, {"name": "reinforce"}),
        ({"name": "skl", "alpha": 0.2}, {"name": "topk", "k": 2}, {"name": "reinforce"}),
        ({"name": "jsd", "beta": 0.5}, {"name": "topk", "k": 3}, {"name": "direct"}),
        ({"name": "srkl"}, {"name": "full"}, {"name": "direct"}),
        ({"name": "jsd", "beta": 0.1}, {"name": "full"}, {"name": "reinforce"}),
    ],
)
def test_expected_gradient_is_kl_coef_times_grad_divergence(divergence, estimator, loss):
    cfg = small_config(divergence=divergence, estimator=estimator, loss={**loss, "kl_coef": 0.7})
    g = torch.Generator().manual_seed(3)
    zs = (2 * torch.randn(1, 1, V, generator=g)).requires_grad_(True)
    zt = 2 * torch.randn(1, 1, V, generator=g)
    d = get_divergence(divergence["name"], **{k: v for k, v in divergence.items() if k != "name"})
    (exact,) = torch.autograd.grad(0.7 * d.full(zs, zt).sum(), zs)
    got = _expected_grad(cfg, zs, zt)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), exact.flatten(), dim=0)
    assert cos > 0.9999
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-4)


def test_renormalised_topk_is_offered_but_biased():
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "topk_renorm", "k": 2}, loss={"name": "direct"})
    g = torch.Generator().manual_seed(4)
    zs = (2 * torch.randn(1, 1, V, generator=g)).requires_grad_(True)
    zt = 2 * torch.randn(1, 1, V, generator=g)
    (exact,) = torch.autograd.grad(get_divergence("rkl").full(zs, zt).sum(), zs)
    got = _expected_grad(cfg, zs, zt)
    assert (got - exact).abs().max() > 1e-2


def test_masked_positions_never_count():
    cfg = small_config(divergence={"name": "jsd"}, estimator={"name": "sampled"}, loss={"name": "reinforce"})
    obj = Objective(cfg)
    g = torch.Generator().manual_seed(5)
    zs, zt = torch.randn(2, 4, V, generator=g), torch.randn(2, 4, V, generator=g)
    y = torch.randint(0, V, (2, 4), generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    base = obj(zs, zt, y, mask, on_policy=True, normalizer=5)
    zs2, zt2 = zs.clone(), zt.clone()
    zs2[~mask] = 1e4  # garbage where the mask is off
    zt2[~mask] = -1e4
    y2 = torch.where(mask, y, torch.zeros_like(y))
    other = obj(zs2, zt2, y2, mask, on_policy=True, normalizer=5)
    torch.testing.assert_close(base.loss, other.loss)
    assert base.sums == pytest.approx(other.sums)
    empty = obj(zs, zt, y, torch.zeros_like(mask), on_policy=True, normalizer=0)
    assert float(empty.loss) == 0.0 and all(v == 0.0 for v in empty.sums.values())


def test_teacher_sampled_batches_use_the_exact_loss():
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "sampled"}, loss={"name": "ppo", "kl_coef": 2.0})
    obj = Objective(cfg)
    g = torch.Generator().manual_seed(6)
    zs, zt = torch.randn(2, 3, V, generator=g).requires_grad_(True), torch.randn(2, 3, V, generator=g)
    y = torch.randint(0, V, (2, 3), generator=g)
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = obj(zs, zt, y, mask, on_policy=False, normalizer=6)
    exact = get_divergence("rkl").full(zs, zt)
    torch.testing.assert_close(out.loss, 2.0 * exact.mean())
    assert out.sums["kl/reverse"] == pytest.approx(float(exact.detach().sum()), rel=1e-5)


def test_metrics_are_unbiased_estimates_under_student_samples():
    """Averaged exactly over y ~ S, the per-token metrics equal the exact divergences; jsd/mean
    is built with the importance weight (the concave s/t-only form would be <= 0)."""
    cfg = small_config(divergence={"name": "fkl"}, estimator={"name": "sampled"}, loss={"name": "reinforce"})
    obj = Objective(cfg)
    g = torch.Generator().manual_seed(7)
    zs, zt = 2 * torch.randn(1, 1, V, generator=g), 2 * torch.randn(1, 1, V, generator=g)
    probs = torch.softmax(zs, -1)[0, 0]
    mean = {}
    for y in range(V):
        sums = obj(zs, zt, torch.tensor([[y]]), torch.ones(1, 1, dtype=torch.bool), on_policy=True, normalizer=1).sums
        for k, v in sums.items():
            mean[k] = mean.get(k, 0.0) + float(probs[y]) * v
    for key, d in (
        ("jsd/mean", get_divergence("jsd", beta=0.5)),
        ("kl/reverse", get_divergence("rkl")),
        ("kl/forward", get_divergence("fkl")),
    ):
        assert mean[key] == pytest.approx(float(d.full(zs, zt)), rel=1e-4)
    assert mean["jsd/mean"] > 0


def test_sequence_credit_requires_a_return_form():
    cfg = small_config(loss={"name": "reinforce", "credit": "sequence"}, estimator={"name": "full"})
    assert validate(cfg) is cfg


@pytest.mark.parametrize(
    "divergence,estimator,loss",
    [
        ({"name": "rkl"}, {"name": "sampled"}, {"name": "reinforce"}),
        ({"name": "jsd", "beta": 0.5}, {"name": "sampled"}, {"name": "ppo"}),
        ({"name": "jsd", "beta": 0.3}, {"name": "full"}, {"name": "reinforce"}),
        ({"name": "fkl"}, {"name": "topk", "k": 2}, {"name": "reinforce"}),
    ],
)
def test_sequence_credit_follows_the_whole_sequence_divergence(divergence, estimator, loss):
    """Tabular two-token model: E_y[grad loss(y)] = grad sum_t E[D_t] (the prefix moves too)."""
    W = 4
    cfg = small_config(divergence=divergence, estimator=estimator, loss={**loss, "credit": "sequence", "gamma": 1.0})
    obj = Objective(cfg)
    g = torch.Generator().manual_seed(8)
    z1 = torch.randn(W, generator=g).requires_grad_(True)  # student logits of token 1
    z2 = torch.randn(W, W, generator=g).requires_grad_(True)  # ... of token 2 given token 1
    t1, t2 = torch.randn(W, generator=g), torch.randn(W, W, generator=g)
    d = get_divergence(divergence["name"], **{k: v for k, v in divergence.items() if k != "name"})
    p1 = torch.softmax(z1, -1)
    J = d.full(z1, t1) + (p1 * d.full(z2, t2)).sum()
    exact = torch.autograd.grad(J, (z1, z2))
    got = [torch.zeros_like(z1), torch.zeros_like(z2)]
    mask = torch.ones(1, 2, dtype=torch.bool)
    for a in range(W):
        for b in range(W):
            prob = float((p1[a] * torch.softmax(z2[a], -1)[b]).detach())
            zs = torch.stack([z1, z2[a]]).unsqueeze(0)
            zt = torch.stack([t1, t2[a]]).unsqueeze(0)
            out = obj(zs, zt, torch.tensor([[a, b]]), mask, on_policy=True, normalizer=1)
            g1, g2 = torch.autograd.grad(out.loss, (z1, z2))
            got[0] += prob * g1
            got[1] += prob * g2
    for mine, ref in zip(got, exact):
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-4)
