"""Sequence credit and layouts, checked on a tabular model small enough to enumerate."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from opd_exp.divergences import get_divergence, masked_mean, sequence_returns

# exact comparisons in float64 (fixture in conftest.py restores the default afterwards)
pytestmark = pytest.mark.usefixtures("float64_default")

V, L = 5, 3
PREFIXES = [p for n in range(L) for p in itertools.product(range(V), repeat=n)]
INDEX = {p: i for i, p in enumerate(PREFIXES)}


def tabular(seed, scale):
    """Logits of a full autoregressive table: one row per prefix (1 + 5 + 25 rows)."""
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(len(PREFIXES), V, generator=g)


def exact_objective(d, zs, zt, frozen_prefix):
    """J = sum_t E_{y<t ~ S}[D_t(y<t)], enumerating prefixes; optionally prefix-frozen."""
    logS = zs.log_softmax(-1)
    D = d.full(zs, zt)  # [prefixes]
    J = torch.zeros(())
    for p in PREFIXES:
        prob = torch.ones(())
        for i in range(len(p)):
            prob = prob * logS[INDEX[p[:i]], p[i]].exp()
        if frozen_prefix:
            prob = prob.detach()
        J = J + prob * D[INDEX[p]]
    return J


def expected_reinforce(d, zs, zt, gamma, segments=False):
    """E_{y~S}[sum_t R_t grad log S(y_t | y<t)] by enumerating all V^L sequences."""
    seqs = list(itertools.product(range(V), repeat=L))
    rows = torch.tensor([[INDEX[y[:i]] for i in range(L)] for y in seqs])
    ys = torch.tensor(seqs)
    logS, logT = zs.log_softmax(-1), zt.log_softmax(-1)
    s = logS[rows, ys]  # [N, L]
    t = logT[rows, ys]
    mask = torch.ones_like(s, dtype=torch.bool)
    cost, value = d.token_cost(s.detach(), t), d.token_value(s.detach(), t)
    if segments:
        # the same sequences packed two per row with segment ids: must give identical returns
        N = len(seqs)
        packed = lambda x: x.reshape(N // 2 + N % 2, -1) if N % 2 == 0 else None
        assert N % 2 == 1  # 125 sequences: pad one row
        pad = lambda x, v: torch.cat([x, torch.full((1, L), v, dtype=x.dtype)])
        c2, v2, m2 = pad(cost, 0.0).reshape(-1, 2 * L), pad(value, 0.0).reshape(-1, 2 * L), pad(mask, False).reshape(-1, 2 * L)
        seg = torch.arange(N + 1).repeat_interleave(L).reshape(-1, 2 * L)
        R = sequence_returns(c2, v2, m2, gamma, segment_ids=seg).reshape(-1, L)[:N]
        del packed
    else:
        R = sequence_returns(cost, value, mask, gamma)
    prob = s.sum(-1).exp().detach()
    surrogate = (prob[:, None] * R.detach() * s).sum()
    (g,) = torch.autograd.grad(surrogate, zs)
    return g


SPECS = [("rkl", {}), ("jsd", {"beta": 0.1}), ("jsd", {"beta": 0.5}), ("jsd", {"beta": 0.9}), ("fkl", {}), ("tvd", {})]


@pytest.mark.parametrize("gamma", [0.0, 1.0])
@pytest.mark.parametrize("scale", [0.5, 2.0])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s[0] + str(s[1].get("beta", "")))
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sequence_returns_follow_the_exact_gradient(spec, scale, gamma, packed):
    d = get_divergence(spec[0], **spec[1])
    for seed in range(2):
        zs = tabular(seed, scale).requires_grad_(True)
        zt = tabular(100 + seed, scale)
        got = expected_reinforce(d, zs, zt, gamma, segments=packed)
        (want,) = torch.autograd.grad(exact_objective(d, zs, zt, frozen_prefix=(gamma == 0.0)), zs)
        cos = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
        assert cos >= 0.9999
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_gamma_one_rkl_is_the_sequence_kl():
    """For rkl the summed per-position KLs along student prefixes is KL of whole sequences."""
    d = get_divergence("rkl")
    zs, zt = tabular(0, 1.0), tabular(1, 1.0)
    logS, logT = zs.log_softmax(-1), zt.log_softmax(-1)
    seq_kl = torch.zeros(())
    for y in itertools.product(range(V), repeat=L):
        ls = sum(logS[INDEX[y[:i]], y[i]] for i in range(L))
        lt = sum(logT[INDEX[y[:i]], y[i]] for i in range(L))
        seq_kl = seq_kl + ls.exp() * (ls - lt)
    torch.testing.assert_close(exact_objective(d, zs, zt, frozen_prefix=False), seq_kl)


def test_prefix_frozen_and_whole_sequence_gradients_differ():
    d = get_divergence("jsd", beta=0.5)
    zs = tabular(3, 2.0).requires_grad_(True)
    zt = tabular(4, 2.0)
    (a,) = torch.autograd.grad(exact_objective(d, zs, zt, True), zs)
    (b,) = torch.autograd.grad(exact_objective(d, zs, zt, False), zs)
    assert (a - b).norm() > 0.05 * b.norm()  # so the gamma=0/1 tests above can tell them apart


def test_returns_values_padded_and_packed_match_exactly():
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4]
    T = 6
    prompt = [2, 1, 2]
    c = torch.randn(3, T, generator=g)
    v = torch.randn(3, T, generator=g)
    mask = torch.zeros(3, T, dtype=torch.bool)
    for i, (p, n) in enumerate(zip(prompt, lengths)):
        mask[i, p : p + n] = True
    R = sequence_returns(c, v, mask, 0.7)
    # by hand for row 0: positions 2, 3, 4
    want0 = [c[0, 2] + 0.7 * v[0, 3] + 0.49 * v[0, 4], c[0, 3] + 0.7 * v[0, 4], c[0, 4]]
    torch.testing.assert_close(R[0, 2:5], torch.stack(want0))
    assert (R[~mask] == 0).all()
    # packed: concatenate each row's prompt + response into one line with segment ids
    cp = torch.cat([c[i, : p + n] for i, (p, n) in enumerate(zip(prompt, lengths))])[None]
    vp = torch.cat([v[i, : p + n] for i, (p, n) in enumerate(zip(prompt, lengths))])[None]
    mp = torch.cat([mask[i, : p + n] for i, (p, n) in enumerate(zip(prompt, lengths))])[None]
    seg = torch.cat([torch.full((p + n,), i) for i, (p, n) in enumerate(zip(prompt, lengths))])[None]
    Rp = sequence_returns(cp, vp, mp, 0.7, segment_ids=seg)
    assert torch.equal(Rp[mp], R[mask])
    torch.testing.assert_close(masked_mean(Rp, mp), masked_mean(R, mask), rtol=1e-12, atol=0)  # summation order only
    # full() per position is layout-free too
    d = get_divergence("jsd", beta=0.3)
    zs, zt = torch.randn(3, T, 7, generator=g), torch.randn(3, T, 7, generator=g)
    zsp = torch.cat([zs[i, : p + n] for i, (p, n) in enumerate(zip(prompt, lengths))])[None]
    ztp = torch.cat([zt[i, : p + n] for i, (p, n) in enumerate(zip(prompt, lengths))])[None]
    torch.testing.assert_close(d.full(zsp, ztp, mask=mp)[mp], d.full(zs, zt, mask=mask)[mask], rtol=0, atol=0)


def test_a_gap_in_the_mask_is_not_a_step_of_the_discount():
    """An episode's environment tokens (mask 0 between the student's): gamma counts masked positions only."""
    c, v = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]), torch.tensor([[10.0, 20.0, 30.0, 40.0, 50.0, 60.0]])
    mask = torch.tensor([[True, False, False, True, True, False]])
    R = sequence_returns(c, v, mask, 0.5)
    # by hand: position 0's next trained token is 3 (one step), then 4 (two steps)
    torch.testing.assert_close(R, torch.tensor([[1.0 + 0.5 * 40.0 + 0.25 * 50.0, 0.0, 0.0, 4.0 + 0.5 * 50.0, 5.0, 0.0]]))
    # with no gap the same tokens give the same returns
    packed = sequence_returns(c[:, [0, 3, 4]], v[:, [0, 3, 4]], mask[:, [0, 3, 4]], 0.5)
    assert torch.equal(packed, R[:, [0, 3, 4]])


def test_all_masked_batch_gives_zero_not_nan():
    c = torch.full((2, 4), float("nan"))
    mask = torch.zeros(2, 4, dtype=torch.bool)
    R = sequence_returns(c, c, mask, 1.0)
    assert (R == 0).all()
    assert masked_mean(R, mask).item() == 0.0
    out = get_divergence("rkl").full(torch.randn(2, 4, 5), torch.randn(2, 4, 5), mask=mask)
    assert (out == 0).all()


def test_gamma_out_of_range():
    with pytest.raises(ValueError, match=r"gamma=1\.5 is out of range; allowed: 0 <= gamma <= 1"):
        sequence_returns(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), 1.5)
