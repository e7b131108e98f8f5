"""Exact checks of the divergence core: every estimator against an enumeration of the vocabulary.

References below are written from the definitions (probabilities, not log-space tricks), so
they share no code with the implementation.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from opd_exp.divergences import DIVERGENCES, check_divergence, get_divergence, masked_mean, topk_estimate

# exact comparisons in float64 (fixture in conftest.py restores the default afterwards)
pytestmark = pytest.mark.usefixtures("float64_default")

V = 11
# Parameter grids of the divergences that take parameters; every registered divergence is
# tested (a new one with its defaults), so registering one needs no edit here.
PARAM_GRIDS = {
    "jsd": [{"beta": b} for b in (0.0, 0.1, 0.3, 0.5, 0.9, 1.0)],
    "skl": [{"alpha": a} for a in (0.1, 0.5)],
    "srkl": [{"alpha": a} for a in (0.1, 0.5)],
}
SPECS = [(name, params) for name in DIVERGENCES for params in PARAM_GRIDS.get(name, [{}])]
# divergences whose sampled cost is exact (all but the ones kept wrong on purpose, for reproduction)
EXACT_SPECS = [spec for spec in SPECS if get_divergence(spec[0], **spec[1]).exact_cost]
REGIMES = ("peaked-near", "peaked-far", "flat-near", "flat-far")


def spec_id(spec):
    name, params = spec
    return name + "".join(f"-{k}{v}" for k, v in params.items())


def reference(name: str, params: dict, S: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """The divergences from their definitions over probabilities (last dim = vocabulary)."""

    def kl(p, q):
        return (p * (p / q).log()).sum(-1)

    if name == "rkl":
        return kl(S, T)
    if name == "fkl":
        return kl(T, S)
    if name == "tvd":
        return 0.5 * (S - T).abs().sum(-1)
    if name == "jsd":
        b = params["beta"]
        if b == 0.0:
            return kl(T, S)
        if b == 1.0:
            return kl(S, T)
        M = b * T + (1 - b) * S
        return b * kl(T, M) + (1 - b) * kl(S, M)
    a = params.get("alpha")
    if name == "skl":
        return kl(T, a * T + (1 - a) * S)
    if name == "srkl":
        return kl(S, a * S + (1 - a) * T)
    pytest.skip(f"no reference definition for registered divergence {name!r} here (check_divergence covers it)")


def make_pair(seed: int, regime: str, shape=(V,)):
    g = torch.Generator().manual_seed(seed)
    scale = 4.0 if regime.startswith("peaked") else 0.5
    zs = scale * torch.randn(shape, generator=g)
    if regime.endswith("near"):
        zt = zs + 0.2 * torch.randn(shape, generator=g)
    else:
        zt = scale * torch.randn(shape, generator=g)
    return zs, zt


def expected_reinforce_grad(cost: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """E_{y~S}[c(y) grad_z log S(y)] by enumeration: grad_z log S(y) = e_y - S."""
    return S * cost - S * (S * cost).sum(-1, keepdim=True)


def assert_same_direction(got: torch.Tensor, want: torch.Tensor):
    cos = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    rel = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
    assert cos >= 0.9999, f"cosine {cos}"
    assert rel <= 1e-4, f"relative error {rel}"


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spec", EXACT_SPECS, ids=spec_id)
def test_reinforce_cost_follows_exact_gradient(spec, seed, regime):
    name, params = spec
    d = get_divergence(name, **params)
    zs, zt = make_pair(seed, regime)
    zs.requires_grad_(True)
    d.full(zs, zt).backward()
    S = zs.detach().softmax(-1)
    s, t = S.log(), zt.log_softmax(-1)
    got = expected_reinforce_grad(d.token_cost(s, t), S)
    assert_same_direction(got, zs.grad)
    # and the exact score (cost + baseline) gives the same expectation
    assert_same_direction(expected_reinforce_grad(d.token_score(s, t), S), zs.grad)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_full_equals_reference_and_autograd(spec, seed, regime):
    name, params = spec
    d = get_divergence(name, **params)
    zs, zt = make_pair(seed, regime, shape=(3, 5, V))
    zs1 = zs.clone().requires_grad_(True)
    zs2 = zs.clone().requires_grad_(True)
    got = d.full(zs1, zt)
    want = reference(name, params, zs2.softmax(-1), zt.softmax(-1))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    w = torch.randn(3, 5)
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(zs1.grad, zs2.grad, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_token_value_is_unbiased(spec, regime):
    name, params = spec
    d = get_divergence(name, **params)
    for seed in range(3):
        zs, zt = make_pair(seed, regime)
        S = zs.softmax(-1)
        s, t = S.log(), zt.log_softmax(-1)
        expectation = (S * d.token_value(s, t)).sum()
        torch.testing.assert_close(expectation, d.full(zs, zt), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", [0.1, 0.3, 0.5, 0.9])
def test_jsd_mean_is_positive_and_the_concave_form_is_not(beta):
    d = get_divergence("jsd", beta=beta)
    for seed in range(5):
        zs, zt = make_pair(seed, "flat-far")
        S = zs.softmax(-1)
        s, t = S.log(), zt.log_softmax(-1)
        exact = d.full(zs, zt)
        assert exact > 0
        # Monte-Carlo jsd/mean over sampled tokens: close to the exact value, so >= 0
        g = torch.Generator().manual_seed(seed)
        y = torch.multinomial(S, 200_000, replacement=True, generator=g)
        mc = d.token_value(s[y], t[y])
        assert abs(mc.mean() - exact) < 4 * mc.std() / math.sqrt(y.numel())
        assert mc.mean() >= 0
        # The s/t-only form shipped in the seed is never positive (concavity of log).
        lm = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
        concave = beta * (t - lm) + (1 - beta) * (s - lm)
        assert (concave <= 1e-12).all()


def test_seed_001_cost_ascends_jsd_and_ours_descends():
    """The cost shipped before seed 001's fix points away from -grad JSD; ours matches it."""
    # Standard-normal logits over 8 tokens, as in the seed's table (cosines -0.15 .. -0.94).
    for beta in (0.3, 0.5, 0.9):
        d = get_divergence("jsd", beta=beta)
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            zs, zt = torch.randn(8, generator=g), torch.randn(8, generator=g)
            zs.requires_grad_(True)
            d.full(zs, zt).backward()
            S = zs.detach().softmax(-1)
            s, t = S.log(), zt.log_softmax(-1)
            lm = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
            shipped = beta * (t - lm) + (1 - beta) * (s - lm)
            cos_shipped = F.cosine_similarity(expected_reinforce_grad(shipped, S), zs.grad, dim=0)
            cos_ours = F.cosine_similarity(expected_reinforce_grad(d.token_cost(s, t), S), zs.grad, dim=0)
            assert cos_shipped < 0
            assert cos_ours > 0.9999


def test_trinity_beta1_branch_ascends_reverse_kl():
    d = get_divergence("jsd", beta=1.0)
    zs, zt = make_pair(0, "flat-far")
    zs.requires_grad_(True)
    d.full(zs, zt).backward()
    S = zs.detach().softmax(-1)
    s, t = S.log(), zt.log_softmax(-1)
    cos = F.cosine_similarity(expected_reinforce_grad(t - s, S), zs.grad, dim=0)
    assert cos.item() == pytest.approx(-1.0, abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_jsd_matches_trl_generalized_jsd_loss(beta, temperature):
    gkd = pytest.importorskip("trl.experimental.gkd")
    zs, zt = make_pair(3, "flat-far", shape=(2, 6, V))
    ours = get_divergence("jsd", beta=beta).full(zs, zt, temperature=temperature)
    trl = gkd.GKDTrainer.generalized_jsd_loss(zs, zt, beta=beta, temperature=temperature, reduction="none")
    torch.testing.assert_close(ours, trl.sum(-1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_identical_distributions_give_zero(spec):
    d = get_divergence(*spec[:1], **spec[1])
    zs, _ = make_pair(0, "peaked-far", shape=(4, V))
    torch.testing.assert_close(d.full(zs, zs.clone()), torch.zeros(4), atol=1e-12, rtol=0)
    s = zs.log_softmax(-1)
    torch.testing.assert_close(d.token_value(s, s), torch.zeros_like(s), atol=1e-12, rtol=0)


def test_jsd_endpoints_are_exactly_the_kls():
    zs, zt = make_pair(1, "peaked-far", shape=(4, V))
    s, t = zs.log_softmax(-1), zt.log_softmax(-1)
    for beta, kl in ((0.0, "fkl"), (1.0, "rkl")):
        j, k = get_divergence("jsd", beta=beta), get_divergence(kl)
        assert torch.equal(j.full(zs, zt), k.full(zs, zt))
        assert torch.equal(j.token_cost(s, t), k.token_cost(s, t))
        assert torch.equal(j.token_value(s, t), k.token_value(s, t))
    # and the mixture tends to them after dividing by beta (resp. 1 - beta)
    fkl, rkl = get_divergence("fkl").full(zs, zt), get_divergence("rkl").full(zs, zt)
    eps = 1e-10  # the gap is O(eps * chi^2), so peaked-far pairs need a small eps
    torch.testing.assert_close(get_divergence("jsd", beta=eps).full(zs, zt) / eps, fkl, rtol=1e-4, atol=0)
    torch.testing.assert_close(get_divergence("jsd", beta=1 - eps).full(zs, zt) / eps, rkl, rtol=1e-4, atol=0)


def test_temperature_tempers_logits_not_log_probs():
    zs, zt = make_pair(2, "peaked-far", shape=(3, V))
    d = get_divergence("rkl")
    got = d.full(zs, zt, temperature=2.0)
    want = reference("rkl", {}, (zs / 2).softmax(-1), (zt / 2).softmax(-1))
    torch.testing.assert_close(got, want)
    # dividing log-probs by tau is a different (and unnormalised) thing
    wrong = reference("rkl", {}, (zs.log_softmax(-1) / 2).exp(), (zt.log_softmax(-1) / 2).exp())
    assert (got - wrong).abs().max() > 1e-3


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_fp32_values_near_convergence_keep_their_digits(spec):
    """Late in training student and teacher differ by noise: the fp32 value must stay within 1e-7
    of float64 (V=32000; true values 4e-10 to 5e-5, tvd up to 4e-3), not carry the ~1e-6 rounding of two
    entropy-sized normalisers. The reference is the definition per entry, in float64."""
    d = get_divergence(spec[0], **spec[1])
    g = torch.Generator().manual_seed(0)
    n, vocab = 4, 32000
    zs = torch.cat([scale * torch.randn(n, vocab, generator=g, dtype=torch.float32) for scale in (1.0, 3.0) for _ in (1e-2, 1e-3, 1e-4)])
    noise = torch.tensor([e for _ in (1.0, 3.0) for e in (1e-2, 1e-3, 1e-4)], dtype=torch.float32).repeat_interleave(n)
    offset = 25.0 * (torch.arange(zs.shape[0]) % 2)[:, None]  # the two models' logits need not share an offset
    zt = zs + noise[:, None] * torch.randn(zs.shape, generator=g, dtype=torch.float32) + offset
    got = d.full(zs, zt, chunk_size=5)
    assert got.dtype == torch.float32
    want = d.pointwise(zs.double().log_softmax(-1), zt.double().log_softmax(-1)).sum(-1)
    assert float(want.min()) >= 0 and float(want.max()) < 1e-2  # close pairs (tvd is first order in the noise)
    err = (got.double() - want).abs().max()
    assert err < 1e-7, f"{spec_id(spec)}: fp32 value {float(err):.1e} off float64"


def test_fp32_tvd_gradient_takes_float64s_sign():
    """tvd's gradient is 0.5 sign(s - t) S: at Liger's test shape (41, 401, 1271), entries where
    S and T agree to fp32 rounding must not take the other sign than float64 (which moves the
    gradient by S there, up to ~1e-2). Independent pairs, close pairs, and close pairs whose
    logits differ by an offset."""
    d = get_divergence("tvd")
    g = torch.Generator().manual_seed(0)
    B, T, vocab = 41, 401, 1271
    zs = torch.randn(B, T, vocab, generator=g, dtype=torch.float32)
    zt = torch.randn(B, T, vocab, generator=g, dtype=torch.float32)
    close = zs[:, 150:] + 1e-3 * torch.randn(B, T - 150, vocab, generator=g, dtype=torch.float32)
    zt[:, 150:] = close + 20.0 * (torch.arange(T - 150) % 2)[:, None]
    grads = []
    for z in (zs, zs.double()):
        z = z.clone().requires_grad_(True)
        d.full(z, zt.to(z.dtype), temperature=1.0).sum().backward()
        grads.append(z.grad)
    err = (grads[0].double() - grads[1]).abs().max()
    assert err < 1e-7, f"fp32 tvd gradient {float(err):.1e} off float64"


@pytest.mark.parametrize("spec", [("rkl", {}), ("jsd", {"beta": 0.5}), ("fkl", {}), ("tvd", {})], ids=spec_id)
def test_chunked_equals_unchunked_in_value_and_gradient(spec):
    d = get_divergence(spec[0], **spec[1])
    zs, zt = make_pair(5, "peaked-far", shape=(3, 7, V))
    mask = torch.rand(3, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    w = torch.randn(3, 7)
    results = []
    for chunk in (1, 2, 5, 1000):
        z = zs.clone().requires_grad_(True)
        out = d.full(z, zt, mask=mask, chunk_size=chunk, temperature=1.5)
        (out * w).sum().backward()
        results.append((out.detach(), z.grad))
    for out, grad in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-12, atol=1e-14)
    out, grad = results[0]
    assert (out[~mask] == 0).all() and (grad[~mask] == 0).all()
    # masked rows equal the unmasked computation
    full_rows = d.full(zs, zt, temperature=1.5)
    torch.testing.assert_close(out[mask], full_rows[mask])


def test_full_accepts_half_precision_and_returns_grad_in_its_dtype():
    zs, zt = make_pair(0, "flat-far", shape=(2, 3, V))
    z = zs.to(torch.bfloat16).requires_grad_(True)
    out = get_divergence("jsd", beta=0.5).full(z, zt.to(torch.bfloat16))
    out.sum().backward()
    assert out.dtype == torch.float32 and z.grad.dtype == torch.bfloat16
    ref = get_divergence("jsd", beta=0.5).full(z.detach().double(), zt.to(torch.bfloat16).double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


# --- top-k -----------------------------------------------------------------


def topk_expectations(d, zs, zt, k, renormalize=False):
    """Exact E_y[surrogate gradient] and E_y[value] by enumerating y ~ S."""
    t_all = zt.log_softmax(-1)
    t_k, ids = t_all.topk(k)
    S = zs.detach().softmax(-1)
    grad = torch.zeros_like(zs)
    value = torch.zeros(())
    for y in range(V):
        z = zs.detach().clone().requires_grad_(True)
        sur, val = topk_estimate(d, z, t_k, ids, torch.tensor(y), t_all[y], renormalize=renormalize)
        sur.backward()
        grad += S[y] * z.grad
        value = value + S[y] * val
    return grad, value


@pytest.mark.parametrize("k", [1, 3, 8, V])
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("spec", EXACT_SPECS, ids=spec_id)
def test_topk_is_unbiased_at_any_k(spec, regime, k):
    d = get_divergence(spec[0], **spec[1])
    for seed in range(2):
        zs, zt = make_pair(seed, regime)
        grad, value = topk_expectations(d, zs, zt, k)
        z = zs.clone().requires_grad_(True)
        exact = d.full(z, zt)
        exact.backward()
        assert_same_direction(grad, z.grad)
        torch.testing.assert_close(value, exact.detach(), rtol=1e-10, atol=1e-12)


def test_renormalised_topk_is_biased():
    d = get_divergence("rkl")
    zs, zt = make_pair(1, "flat-far")
    exact = d.full(zs, zt)
    _, unbiased = topk_expectations(d, zs, zt, 3)
    _, renorm = topk_expectations(d, zs, zt, 3, renormalize=True)
    torch.testing.assert_close(unbiased, exact)
    assert abs(renorm - exact) > 0.05 * exact  # the bias the explicit name warns about


# --- parameters and errors --------------------------------------------------


def test_jsd_legacy_docstring_states_what_was_measured():
    """The share of random pairs on which jsd_legacy's expected update points away from -grad JSD,
    recomputed here, is the figure its docstring quotes (not "always")."""
    from opd_exp.divergences import JensenShannonLegacy
    from opd_exp.divergences.check import cost_cosine, random_pair

    doc = " ".join(JensenShannonLegacy.__doc__.split())
    for beta in (0.1, 0.5, 0.9):
        legacy, jsd = get_divergence("jsd_legacy", beta=beta), get_divergence("jsd", beta=beta)
        share = []
        for regime in ("far", "near"):
            cos = [cost_cosine(legacy.token_cost, jsd, *random_pair(seed, vocab=8, regime=regime)) for seed in range(1000)]
            share.append(sum(c < 0 for c in cos) / len(cos))
        assert f"beta={beta}: {share[0]:.0%} / {share[1]:.0%}" in doc, (beta, share)


def test_check_divergence_catches_a_cost_kept_wrong_on_purpose():
    from opd_exp.divergences import DivergenceCheckError

    with pytest.raises(DivergenceCheckError):
        check_divergence(get_divergence("jsd_legacy", beta=0.5))


@pytest.mark.parametrize("spec", EXACT_SPECS, ids=spec_id)
def test_every_registered_divergence_passes_check_divergence(spec):
    report = check_divergence(get_divergence(spec[0], **spec[1]))
    assert report.ok and len(report.results) == 8
    assert all(r.worst <= 1e-9 for r in report.results), str(report)


def test_names_and_errors():
    assert set(DIVERGENCES) >= {"rkl", "fkl", "jsd", "skl", "srkl", "tvd"}
    assert list(DIVERGENCES)[:6] == ["rkl", "fkl", "jsd", "skl", "srkl", "tvd"]
    with pytest.raises(ValueError, match=r"unknown divergence 'kl'; allowed: " + ", ".join(DIVERGENCES) + "$"):
        get_divergence("kl")
    with pytest.raises(ValueError, match=r"beta=1\.5 is out of range; allowed: 0 <= beta <= 1"):
        get_divergence("jsd", beta=1.5)
    with pytest.raises(ValueError, match=r"alpha=0 is out of range; allowed: 0 < alpha < 1"):
        get_divergence("skl", alpha=0)
    with pytest.raises(ValueError, match=r"alpha=1\.0 is out of range"):
        get_divergence("srkl", alpha=1.0)
    with pytest.raises(ValueError, match=r"'rkl' takes no parameter 'beta'; allowed: none"):
        get_divergence("rkl", beta=0.5)
    with pytest.raises(ValueError, match=r"clip=-1 is out of range"):
        get_divergence("fkl", clip=-1)


def test_fkl_clip_is_off_by_default_and_reported():
    s = torch.tensor([-5.0, -1.0, -0.1])
    t = torch.tensor([-0.1, -1.0, -5.0])
    plain = get_divergence("fkl")
    assert torch.equal(plain.token_cost(s, t), -(t - s).exp())
    assert not plain.clipped(s, t).any()
    clipped = get_divergence("fkl", clip=10.0)
    assert clipped.token_cost(s, t)[0] == -10.0
    assert clipped.clipped(s, t).tolist() == [True, False, False]


def test_zero_probability_entries_give_finite_results():
    zs = torch.tensor([[0.0, 1.0, -math.inf, 2.0]])
    zt = torch.tensor([[1.0, -math.inf, 0.5, 0.0]])
    for name, params in SPECS:
        if name not in ("jsd", "tvd") or (name == "jsd" and params["beta"] in (0.0, 1.0)):
            continue  # the KLs (and registered ones) may be infinite by definition when supports differ
        z = zs.clone().requires_grad_(True)
        out = get_divergence(name, **params).full(z, zt)
        out.backward()
        assert torch.isfinite(out).all() and torch.isfinite(z.grad).all(), name


def test_masked_mean_normalisation():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 5.0]])
    m = torch.tensor([[True, True, False], [True, False, True]])
    assert masked_mean(x, m).item() == pytest.approx((1 + 2 + 3 + 5) / 4)
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0
    assert masked_mean(x, m, count=8).item() == pytest.approx(11 / 8)
