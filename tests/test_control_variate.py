"""The control-variate baseline of the sampled estimator (``estimator.baseline``), by enumeration.

A tabular autoregressive student and teacher (vocabulary V, length L, one logit row per prefix,
float64); every one of the V^L sequences is scored through the ``Objective`` alone, so the
expected gradient and its per-sample variance are exact sums, not Monte Carlo: with either
baseline the expected gradient equals autograd's gradient of the exact objective, and the
per-sequence gradient's variance is lower than without it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from helpers import golden
from helpers.tiny import AddTask, small_config
from opd_exp.config.schema import Baseline
from opd_exp.divergences import DIVERGENCES, expected_cost, get_divergence, topk_expected_cost
from opd_exp.divergences.baseline import tail_fill, weighted_cost
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.objective import Objective
from opd_exp.training.scoring import TeacherScores, teacher_topk
from opd_exp.training.trainer import Trainer

V, L, K = 4, 3, 2  # 64 sequences; the top-k baseline sees the teacher's top 2 of 4
SPECS = {"rkl": ("rkl", {}), "fkl": ("fkl", {}), "jsd_0.3": ("jsd", {"beta": 0.3})}
EXACT = [n for n in DIVERGENCES if get_divergence(n).exact_cost]  # what is registered, minus the wrong-on-purpose


def tables(seed: int = 0):
    """Student logits (with grad) and teacher logits, one row per prefix of length 0..L-1."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(V**i for i in range(L))
    z = (1.5 * torch.randn(rows, V, generator=g, dtype=torch.float64)).requires_grad_(True)
    zt = 1.5 * torch.randn(rows, V, generator=g, dtype=torch.float64)
    return z, zt


def prefix_rows(seqs: torch.Tensor) -> torch.Tensor:
    """[N, L] index of the table row that predicts each position (its prefix)."""
    out = torch.zeros_like(seqs)
    offset, code = 0, torch.zeros(seqs.shape[0], dtype=torch.long)
    for i in range(L):
        out[:, i] = offset + code
        offset += V**i
        code = code * V + seqs[:, i]
    return out


SEQS = torch.tensor(list(itertools.product(range(V), repeat=L)))
ROWS = prefix_rows(SEQS)


def objective(div: str, baseline: Baseline, credit: str = "token", form: str = "reinforce") -> Objective:
    name, params = SPECS[div]
    return Objective(
        small_config(
            estimator={"name": "sampled", "baseline": baseline, "k": K},
            loss={"name": form, "credit": credit, "kl_coef": 0.7},
            divergence={"name": name, **params},
        )
    )


def per_sequence_gradients(obj: Objective, z, zt) -> tuple[torch.Tensor, torch.Tensor]:
    """(P(y) [N], the gradient of the estimator's loss on each sequence alone [N, rows*V])."""
    logp = torch.log_softmax(z, -1).detach()
    prob = logp[ROWS, SEQS].sum(-1).exp()
    grads = []
    for n in range(SEQS.shape[0]):
        zs, zts = z[ROWS[n]].unsqueeze(0), zt[ROWS[n]].unsqueeze(0)
        out = obj(zs, TeacherScores(logits=zts), SEQS[n : n + 1], torch.ones(1, L, dtype=torch.bool), on_policy=True, normalizer=1)
        grads.append(torch.autograd.grad(out.loss, z)[0].reshape(-1))
    return prob, torch.stack(grads)


def exact_gradient(div: str, z, zt, credit: str) -> torch.Tensor:
    """kl_coef x the gradient of E_{y~S}[sum_t D_t(y<t)]: the sampling distribution held fixed
    (token credit) or moving with the student (sequence credit, gamma = 1)."""
    name, params = SPECS[div]
    d = get_divergence(name, **params)
    prob = torch.log_softmax(z, -1)[ROWS, SEQS].sum(-1).exp()
    if credit == "token":
        prob = prob.detach()
    per_position = d.full(z[ROWS], zt[ROWS])  # [N, L]
    return 0.7 * torch.autograd.grad((prob * per_position.sum(-1)).sum(), z)[0].reshape(-1)


def moments(prob, grads) -> tuple[torch.Tensor, float]:
    mean = (prob.unsqueeze(-1) * grads).sum(0)
    return mean, float((prob * (grads - mean).pow(2).sum(-1)).sum())  # E|g - E g|^2


# E|g - E g|^2 of the per-sequence gradient under token credit (kl_coef 0.7, tables(0)), float64
VARIANCE = {
    "rkl": {"none": 0.79965094869, "exact": 0.57325595310, "topk": 0.57546459133},
    "fkl": {"none": 31.0255356856, "exact": 25.6344399065, "topk": 25.6471248469},
    "jsd_0.3": {"none": 0.0568966438121, "exact": 0.0342008697785, "topk": 0.0344230292578},
}


@pytest.mark.parametrize("div", list(SPECS))
def test_baselined_expected_gradient_is_exact_and_its_variance_lower(div):
    z, zt = tables()
    want = exact_gradient(div, z, zt, "token")
    assert want.abs().max() > 1e-2  # not a vacuous 0 == 0
    variances = {}
    for kind in (Baseline.none, Baseline.exact, Baseline.topk):  # one row each; loo needs a prompt's samples (below)
        mean, variances[kind.value] = moments(*per_sequence_gradients(objective(div, kind), z, zt))
        torch.testing.assert_close(mean, want, rtol=1e-10, atol=1e-12)
    assert variances == pytest.approx(VARIANCE[div], rel=1e-6)
    assert max(variances["exact"], variances["topk"]) < variances["none"]


@pytest.mark.parametrize("div", ["rkl", "jsd_0.3"])
def test_sequence_credit_with_a_baseline_follows_the_whole_sequence_gradient(div):
    z, zt = tables(1)
    want = exact_gradient(div, z, zt, "sequence")
    for kind in (Baseline.exact, Baseline.topk):
        mean, _ = moments(*per_sequence_gradients(objective(div, kind, credit="sequence"), z, zt))
        torch.testing.assert_close(mean, want, rtol=1e-10, atol=1e-12)


# -- the baseline's value ----------------------------------------------------------


def logit_variance(s: torch.Tensor, c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """E_y|(c_y - b)(e_y - S)|^2 - |E_y (c_y - b)(e_y - S)|^2 per row: the variance of the
    one-sample gradient with respect to the position's logits."""
    S = s.exp()
    eye = torch.eye(s.shape[-1], dtype=s.dtype)
    g = (c - b.unsqueeze(-1)).unsqueeze(-1) * (eye - S.unsqueeze(-2))  # [rows, y, V]
    mean = (S.unsqueeze(-1) * g).sum(-2, keepdim=True)
    return (S * (g - mean).pow(2).sum(-1)).sum(-1)


@pytest.mark.parametrize("name", EXACT)
def test_the_weighted_baseline_minimises_the_logit_gradient_variance(name):
    """b = sum S w c / sum S w, w = |e_y - S|^2: the minimum of the quadratic variance(b), so
    below both no baseline and the plain mean E_S[c], at every row."""
    d = get_divergence(name)
    g = torch.Generator().manual_seed(7)
    zs, zt = 2 * torch.randn(50, 9, generator=g, dtype=torch.float64), 2 * torch.randn(50, 9, generator=g, dtype=torch.float64)
    s, t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    c = d.token_cost(s, t)
    best = expected_cost(d, zs, zt)
    v = logit_variance(s, c, best)
    for other in (torch.zeros_like(best), expected_cost(d, zs, zt, weighted=False), best + 1e-3, best - 1e-3):
        assert bool((v <= logit_variance(s, c, other) + 1e-12).all())


def test_the_plain_mean_is_the_reverse_kl_itself():
    """For rkl (c = s - t) E_S[c] = KL(S || T): the unweighted form is D."""
    d = get_divergence("rkl")
    g = torch.Generator().manual_seed(8)
    zs, zt = torch.randn(3, 5, 11, generator=g, dtype=torch.float64), torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    torch.testing.assert_close(expected_cost(d, zs, zt, weighted=False), d.full(zs, zt), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", EXACT)
def test_topk_baseline_with_the_whole_vocabulary_is_the_exact_one(name):
    d = get_divergence(name)
    g = torch.Generator().manual_seed(9)
    zs, zt = torch.randn(2, 3, 7, generator=g, dtype=torch.float64), torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    torch.testing.assert_close(topk_expected_cost(d, zs, *teacher_topk(zt, 7)), expected_cost(d, zs, zt), rtol=1e-12, atol=1e-12)


def test_tail_fill_spreads_the_remaining_mass_below_the_top_k():
    t = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.3, 0.1]], dtype=torch.float64))
    fill = tail_fill(t, vocab_size=5)
    # row 0: 0.1 left for 2 entries (0.05 each, below the smallest top-k 0.1); row 1: nothing left
    # but rounding, so the rounding floor 3 * eps of float64 instead
    torch.testing.assert_close(fill, torch.log(torch.tensor([[0.05], [3 * 2.220446049250313e-16 / 2]], dtype=torch.float64)))
    capped = tail_fill(torch.log(torch.tensor([[0.3, 0.2]], dtype=torch.float64)), vocab_size=3)
    torch.testing.assert_close(capped, torch.log(torch.tensor([[0.2]], dtype=torch.float64)))  # 0.5 left > 0.2: at the floor of K


def test_positions_with_an_infinite_cost_get_no_baseline():
    """A teacher log-prob of -inf where the student has mass (rkl is infinite there): b = 0."""
    s = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64))
    t = torch.log(torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64))
    b = expected_cost(get_divergence("rkl"), s, t)
    assert b.tolist() == [0.0, 0.0]
    assert not torch.isfinite(weighted_cost(get_divergence("rkl"), s, t)[0])


def test_a_sparse_teacher_gives_the_topk_baseline_of_the_dense_one():
    """teacher=served: the top-k payload alone (the sampled token's log-prob is not read by b)."""
    cfg = small_config(estimator={"name": "sampled", "baseline": Baseline.topk, "k": 3}, loss={"name": "ppo"}, divergence={"name": "rkl"})
    g = torch.Generator().manual_seed(10)
    zs, zt = torch.randn(2, 4, 8, generator=g, dtype=torch.float64), torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 8, (2, 4), generator=g)
    mask = torch.ones(2, 4, dtype=torch.bool)
    dense = Objective(cfg)(zs, TeacherScores(logits=zt), y, mask, on_policy=True, normalizer=8)
    lp, ids = teacher_topk(zt, 3)
    t_y = torch.log_softmax(zt, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    sparse = TeacherScores(topk_ids=ids, topk_logprobs=lp, sampled_logprobs=t_y)
    got = Objective(cfg, teacher_k=3, vocab_size=8)(zs, sparse, y, mask, on_policy=True, normalizer=8)
    torch.testing.assert_close(got.advantages, dense.advantages, rtol=1e-12, atol=1e-12)
    assert got.sums["estimator/baseline"] == pytest.approx(dense.sums["estimator/baseline"], rel=1e-12)


def test_advantages_mean_is_after_the_baseline_and_the_baseline_is_logged():
    def run(baseline):
        cfg = small_config(
            estimator={"name": "sampled", "baseline": baseline}, loss={"name": "reinforce", "kl_coef": 0.5}, divergence={"name": "rkl"}
        )
        return Objective(cfg)(zs, zt, y, mask, on_policy=True, normalizer=5)

    g = torch.Generator().manual_seed(11)
    zs, zt = torch.randn(2, 3, 6, generator=g, dtype=torch.float64), torch.randn(2, 3, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 6, (2, 3), generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    plain, based = run(Baseline.none), run(Baseline.exact)
    b = expected_cost(get_divergence("rkl"), zs, zt)
    assert "estimator/baseline" not in plain.sums
    assert based.sums["estimator/baseline"] == pytest.approx(float(b[mask].sum()), rel=1e-12)
    # A = -kl_coef (c - b): the sum moves by kl_coef * sum b; masked positions keep A = 0
    assert based.sums["advantages/mean"] == pytest.approx(plain.sums["advantages/mean"] + 0.5 * float(b[mask].sum()), rel=1e-12)
    torch.testing.assert_close(based.advantages - plain.advantages, torch.where(mask, 0.5 * b, 0.0))


# -- config --------------------------------------------------------------------


def test_a_baseline_outside_the_sampled_estimator_is_refused():
    with pytest.raises(ConfigError) as ex:
        small_config(estimator={"name": "full", "baseline": Baseline.exact}, loss={"name": "direct"})
    assert str(ex.value) == (
        "estimator.baseline='exact' is not allowed; allowed: none with estimator=full (the baseline is subtracted from "
        "estimator=sampled's cost)"
    )


def test_a_served_teacher_refuses_the_exact_baseline():
    cfg = small_config(estimator={"name": "sampled", "baseline": Baseline.exact}, loss={"name": "ppo"}, divergence={"name": "rkl"})
    with pytest.raises(ConfigError) as ex:
        Objective(cfg, teacher_k=4, vocab_size=50)
    assert str(ex.value) == (
        "estimator.baseline='exact' is not allowed with teacher=served and teacher.k=4 < the vocabulary's 50 tokens (it needs "
        "every teacher log-prob); allowed: topk (from the teacher's top-k) or none, or teacher=in_process"
    )
    cfg = small_config(estimator={"name": "sampled", "baseline": Baseline.topk, "k": 8}, loss={"name": "ppo"}, divergence={"name": "rkl"})
    with pytest.raises(ConfigError, match=r"estimator.k=8 is not allowed .*; allowed: estimator.k <= teacher.k"):
        Objective(cfg, teacher_k=4, vocab_size=50)


def test_the_leave_one_out_baseline_needs_groups_in_one_micro_batch():
    with pytest.raises(ConfigError) as ex:
        small_config(estimator={"name": "sampled", "baseline": "loo"}, loss={"name": "reinforce"}, divergence={"name": "rkl"})
    assert str(ex.value) == (
        "estimator.baseline='loo' is not allowed; allowed: none | exact | topk with rollout.n_samples=1 (leave-one-out needs "
        ">= 2 samples of each prompt)"
    )
    with pytest.raises(ConfigError) as ex:
        small_config(
            estimator={"name": "sampled", "baseline": "loo"},
            rollout={"n_samples": 2},
            trainer={"micro_batch_size": 3},
            loss={"name": "reinforce"},
            divergence={"name": "rkl"},
        )
    assert str(ex.value) == (
        "trainer.micro_batch_size=3 is not allowed; allowed: 0 or a multiple of rollout.n_samples=2 with estimator.baseline=loo "
        "(a prompt's samples share one micro-batch)"
    )
    loo = dict(estimator={"name": "sampled", "baseline": "loo"}, rollout={"n_samples": 2}, divergence={"name": "rkl"})
    with pytest.raises(ConfigError, match=r"scale.fused_lm_head='on' is not allowed; allowed: auto or off with estimator.baseline=loo"):
        small_config(loss={"name": "reinforce"}, **loo, scale={"fused_lm_head": "on"})
    small_config(loss={"name": "reinforce"}, **loo, trainer={"micro_batch_size": 4})
    # ranks: each must hold a prompt's samples whole (checked when the trainer starts, before any model loads)
    from opd_exp.config.schema import whole_groups
    from opd_exp.runtime.distributed import DistState, shard

    group = whole_groups(small_config(loss={"name": "reinforce"}, **loo))
    assert group == ("estimator.baseline=loo", 2)
    assert shard(4, DistState(parallel="ddp", rank=1, world_size=2), group) == slice(2, 4)
    with pytest.raises(ConfigError) as ex:
        shard(6, DistState(parallel="ddp", rank=0, world_size=2), group)
    assert str(ex.value) == (
        "trainer.batch_size=3 is not allowed with estimator.baseline=loo over 2 ranks (a prompt's 2 samples would be split "
        "between ranks); allowed: a multiple of 2"
    )
    assert whole_groups(small_config()) is None


def test_leave_one_out_by_hand():
    """Two prompts x two samples; returns R [4, 3], the last row one token shorter."""
    from opd_exp.divergences import leave_one_out

    R = torch.tensor([[5.0, 3.0, 1.0], [9.0, 4.0, 2.0], [1.0, 1.0, 1.0], [7.0, 6.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    per_position = leave_one_out(R, m, 2)
    assert per_position.tolist() == [[9.0, 4.0, 2.0], [5.0, 3.0, 1.0], [7.0, 6.0, 0.0], [1.0, 1.0, 0.0]]
    whole = leave_one_out(R, m, 2, whole_row=True)
    # RLOO: R_t - b_t = C_i - C_other at every trained position
    assert (R - whole)[m].tolist() == [-4.0, -4.0, -4.0, 4.0, 4.0, 4.0, -6.0, -6.0, -6.0, 6.0, 6.0]
    assert whole[~m].tolist() == [0.0]
    with pytest.raises(ValueError, match=r"leave_one_out: 3 rows are not whole groups of rollout.n_samples=2"):
        leave_one_out(R[:3], m[:3], 2)
    # a row whose group holds no other trained row gets no baseline, either way
    alone = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    for whole_row in (False, True):
        assert leave_one_out(R[:2], alone, 2, whole_row=whole_row).tolist() == [[0.0] * 3] * 2


@pytest.mark.parametrize("div", ["rkl", "jsd_0.3", "fkl"])
@pytest.mark.parametrize("credit", ["sequence", "token"])
def test_leave_one_out_is_exact_for_every_divergence(div, credit):
    """Every pair of a prompt's two samples (the tabular tables, V=4, L=3: 4096 pairs) through the
    Objective with estimator.baseline=loo: the expected gradient per row is autograd of the exact
    objective, sequence or prefix-frozen. With sequence credit the row's whole VALUE sum is what RLOO
    compares (for rkl the costs; a baseline read off the cost returns reads y_t for jsd and fkl)."""
    z, zt = tables(2)
    want = exact_gradient(div, z, zt, credit)
    name, params = SPECS[div]
    cfg = small_config(
        estimator={"name": "sampled", "baseline": "loo"},
        divergence={"name": name, **params},
        loss={"name": "reinforce", "credit": credit, "gamma": 1.0 if credit == "sequence" else 0.0, "kl_coef": 0.7},
        rollout={"n_samples": 2},
    )
    obj = Objective(cfg)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=L)))
    rows = prefix_rows(seqs)
    prob = torch.log_softmax(z, -1).detach()[rows, seqs].sum(-1).exp()
    total = torch.zeros_like(z)
    mask = torch.ones(2, L, dtype=torch.bool)
    for a, b in itertools.product(range(len(seqs)), repeat=2):
        idx = torch.tensor([a, b])
        out = obj(z[rows[idx]], TeacherScores(logits=zt[rows[idx]]), seqs[idx], mask, on_policy=True, normalizer=1.0)
        (g,) = torch.autograd.grad(out.loss, z)
        total = total + prob[a] * prob[b] * g
    torch.testing.assert_close(total.reshape(-1) / 2, want, rtol=1e-9, atol=1e-12)


# -- the loop ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_root(tmp_path_factory):
    return golden.build_pair(tmp_path_factory.mktemp("cv_pair"))


def trainer64(pair_root, run_dir, baseline: Baseline, **loss) -> Trainer:
    cfg = small_config(
        estimator={"name": "sampled", "baseline": baseline},
        loss={"name": "ppo", **loss},
        divergence={"name": "rkl"},
        rollout={"engine": "hf"},
        trainer={"max_steps": 3},
    )
    return Trainer(cfg, run_dir, pair=golden.load_pair(pair_root), task=AddTask())


def test_a_short_run_with_the_baseline_trains_and_differs_from_none(pair_root, tmp_path):
    with golden.float64():
        runs = {}
        for kind in (Baseline.none, Baseline.exact):
            t = trainer64(pair_root, tmp_path / kind.value, kind)
            rows = [t.train_step() for _ in range(3)]
            runs[kind] = (rows, [p.detach().clone() for p in t.student.parameters()])
    none, exact = runs[Baseline.none], runs[Baseline.exact]
    # the same first rollout (same weights, same seed): the same tokens and estimates, another gradient
    assert exact[0][0]["kl/reverse"] == pytest.approx(none[0][0]["kl/reverse"], rel=1e-12)
    assert exact[0][0]["grad/norm"] != pytest.approx(none[0][0]["grad/norm"], rel=1e-3)
    assert all(r["estimator/baseline"] > 0 and "estimator/baseline" not in n for r, n in zip(exact[0], none[0]))
    assert max(float((a - b).abs().max()) for a, b in zip(exact[1], none[1])) > 1e-4


def test_a_short_run_with_the_leave_one_out_baseline(pair_root, tmp_path):
    """estimator.baseline=loo in the loop (two samples per prompt, micro-batches of one prompt): the same
    first rollout as without it, another gradient, and estimator/baseline logged."""
    runs = {}
    with golden.float64():
        for kind in ("none", "loo"):
            cfg = small_config(
                estimator={"name": "sampled", "baseline": kind},
                loss={"name": "reinforce", "credit": "sequence"},
                divergence={"name": "rkl"},
                rollout={"engine": "hf", "n_samples": 2},
                trainer={"max_steps": 2, "batch_size": 2, "micro_batch_size": 2},
            )
            t = Trainer(cfg, tmp_path / kind, pair=golden.load_pair(pair_root), task=AddTask())
            runs[kind] = [t.train_step() for _ in range(2)]
    none, loo = runs["none"], runs["loo"]
    assert loo[0]["kl/reverse"] == pytest.approx(none[0]["kl/reverse"], rel=1e-12)
    assert loo[0]["grad/norm"] != pytest.approx(none[0]["grad/norm"], rel=1e-3)
    assert all(math.isfinite(r["estimator/baseline"]) and "estimator/baseline" not in n for r, n in zip(loo, none))


def test_ppo_mini_batches_keep_a_prompts_samples_together():
    """Several PPO updates draw their mini-batches as whole groups under estimator.baseline=loo (the scoring
    pass computes the baseline per micro-batch); with one row per group the draw is the rows' as before."""
    from opd_exp.training.ppo import mini_batch_rows

    for seed in range(5):
        rows = mini_batch_rows(12, 2, torch.Generator().manual_seed(seed), group=3)
        assert sorted(torch.cat(rows).tolist()) == list(range(12)) and [len(r) for r in rows] == [6, 6]
        for r in rows:  # each mini-batch: whole groups, each group's rows in order
            g = r.view(-1, 3)
            assert (g - g[:, :1]).tolist() == [[0, 1, 2]] * 2 and (g[:, 0] % 3 == 0).all()
        plain = mini_batch_rows(12, 2, torch.Generator().manual_seed(seed))
        want = torch.randperm(12, generator=torch.Generator().manual_seed(seed)).tensor_split(2)
        assert all(torch.equal(a, b) for a, b in zip(plain, want))


def test_several_ppo_updates_with_the_leave_one_out_baseline(pair_root, tmp_path):
    """loss.ppo_epochs=2 loss.ppo_mini_batches=2 with loo: every micro-batch of the scoring pass holds whole
    prompts (its rows' prompt_index come in equal pairs), and the run trains."""
    with golden.float64():
        cfg = small_config(
            estimator={"name": "sampled", "baseline": "loo"},
            loss={"name": "ppo", "ppo_epochs": 2, "ppo_mini_batches": 2},
            divergence={"name": "rkl"},
            rollout={"engine": "hf", "n_samples": 2},
            trainer={"max_steps": 1, "batch_size": 4, "micro_batch_size": 2},
        )
        t = Trainer(cfg, tmp_path, pair=golden.load_pair(pair_root), task=AddTask())
        seen = []
        behaviour = t.head.behaviour

        def recording(mbs, **kw):
            seen.extend(mb.prompt_index.tolist() for mb in mbs)
            return behaviour(mbs, **kw)

        t.head.behaviour = recording
        row = t.train_step()
    assert len(seen) == 4 and all(len(p) == 2 and p[0] == p[1] for p in seen)
    assert sorted(p[0] for p in seen) == [0, 1, 2, 3]
    assert math.isfinite(row["loss"]) and math.isfinite(row["estimator/baseline"])


def test_several_ppo_updates_use_the_baselined_advantages(pair_root, tmp_path):
    """loss.ppo_epochs=2: the advantages fixed in the scoring pass are the objective's, after the baseline."""
    with golden.float64():
        t = trainer64(pair_root, tmp_path, Baseline.exact, ppo_epochs=2)
        seen = []
        behaviour = t.head.objective.__call__

        def recording(*a, **k):
            out = behaviour(*a, **k)
            seen.append(out)
            return out

        t.head.objective = recording
        groups = []
        update = t.ppo._update
        t.ppo._update = lambda group, stats: (groups.append(group), update(group, stats))[1]
        t.train_step()
    assert len(groups) == 2 and seen and all("estimator/baseline" in out.sums for out in seen)
    # the second epoch's advantages (the rollout's rows again, regrouped): their total over the counted
    # tokens is the baselined one, kl_coef * sum(b) away from the plain costs' total
    second = sum(float(p.advantages[p.counted].sum()) for p in groups[1])
    baselined = sum(out.sums["advantages/mean"] for out in seen)
    b_total = sum(out.sums["estimator/baseline"] for out in seen)
    assert second == pytest.approx(baselined, rel=1e-12)
    assert abs(b_total) > 1e-2 and abs(second - (baselined - b_total)) > 1e-2


def test_the_sampled_estimator_brings_its_baseline_and_lr_and_a_pair_keeps_its_own_lr():
    from opd_exp.cli.compose import compose_config

    def chosen(*overrides):
        cfg = compose_config(*overrides)
        return cfg.estimator.baseline, cfg.trainer.lr

    assert chosen("estimator=sampled", "loss=ppo") == (Baseline.exact, 1e-3)
    assert chosen("estimator=full") == (Baseline.none, 3e-3)
    assert chosen("estimator=sampled", "loss=ppo", "model_pair=smollm2") == (Baseline.exact, 1e-4)  # the pair's own lr
    assert chosen("estimator=sampled", "loss=ppo", "trainer.lr=3e-3", "estimator.baseline=none") == (Baseline.none, 3e-3)
    assert chosen("experiment=opd_gsm8k_rkl") == (Baseline.exact, 1e-6)  # an experiment's lr wins


@pytest.mark.parametrize("kind", [Baseline.exact, Baseline.topk])
@pytest.mark.parametrize("div,credit,top_k", [("rkl", "token", 0), ("jsd", "sequence", 0), ("rkl", "sequence", 5)])
def test_the_fused_head_gives_the_materialised_baseline(pair64, kind, div, credit, top_k):
    """The baseline is per position: chunks of positions (the fused head) change nothing."""
    from test_fused import _assert_equal, _batch, _both_paths

    ro = dict(temperature=0.9, top_k=top_k, top_p=1.0, max_new_tokens=6, max_prompt_tokens=8)
    est = dict(name="sampled", baseline=kind, k=4)
    cfg = small_config(divergence=dict(name=div), estimator=est, loss=dict(name="ppo", credit=credit), rollout=ro)
    batch = _batch(pair64, ro)
    ref, *rest = _both_paths(pair64, cfg, batch, on_policy=True, chunk=5)
    assert abs(ref.sums["estimator/baseline"]) > 1e-3
    _assert_equal(ref, *rest)


@pytest.fixture
def pair64(tiny_pair, float64_default):
    tiny_pair.student.double()
    tiny_pair.teacher.double()
    return tiny_pair
