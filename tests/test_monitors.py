"""The monitors every step logs: exact divergences on the step's rollout, teacher entropy, top-k
overlap, and the engine/trainer log-prob gap (with its warning line)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.tiny import AddTask, small_config
from opd_exp.divergences import get_divergence
from opd_exp.training.monitors import Monitors, Tally, agreement
from opd_exp.training.objective import Objective


def _step(cfg, zs, zt, y, mask, **kw):
    """The objective's and the monitors' sums of one micro-batch, as the trainer tallies them."""
    out = Objective(cfg)(zs, zt, y, mask, **kw)
    tally = Tally()
    tally.add(out)
    tally.add(Monitors(cfg)(zs, zt, out))
    out.sums = dict(tally)
    return out


def test_exact_metrics_are_the_divergences_full_on_the_batch():
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "sampled"}, loss={"name": "reinforce"})
    g = torch.Generator().manual_seed(0)
    zs, zt = 2 * torch.randn(3, 5, 11, generator=g), 2 * torch.randn(3, 5, 11, generator=g)
    y = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    out = _step(cfg, zs, zt, y, mask, on_policy=True, normalizer=int(mask.sum()))
    for key, d in (
        ("exact/jsd", get_divergence("jsd", beta=0.5)),
        ("exact/kl_reverse", get_divergence("rkl")),
        ("exact/kl_forward", get_divergence("fkl")),
    ):
        assert out.sums[key] == pytest.approx(float(d.full(zs, zt, mask=mask).sum()), rel=1e-6), key
    lt = torch.log_softmax(zt, -1)
    assert out.sums["teacher/entropy"] == pytest.approx(float(-(lt.exp() * lt).sum(-1)[mask].sum()), rel=1e-6)
    cfg.trainer.exact_metrics = False  # the switch for very large vocabularies
    off = _step(cfg, zs, zt, y, mask, on_policy=True, normalizer=1)
    assert not any(k.startswith("exact/") for k in off.sums)


@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("div", [{"name": "rkl"}, {"name": "fkl"}, {"name": "jsd", "beta": 0.5}, {"name": "jsd", "beta": 0.3}])
def test_exact_metrics_reuse_the_losss_exact_value_only_where_it_is_the_same_divergence(div, on_policy):
    """estimator=full (and every teacher-sampled step) already computes the trained divergence
    exactly; the monitors take it from there instead of computing it again, and every exact/*
    value is still the divergence's own full() on the batch, in the same monitor pass."""
    cfg = small_config(divergence=div, estimator={"name": "full"}, loss={"name": "direct"})
    g = torch.Generator().manual_seed(1)
    zs, zt = 2 * torch.randn(4, 6, 13, generator=g), 2 * torch.randn(4, 6, 13, generator=g)
    y = torch.randint(0, 13, (4, 6), generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.25
    out = _step(cfg, zs, zt, y, mask, on_policy=on_policy, normalizer=int(mask.sum()))
    for key, d in (
        ("exact/jsd", get_divergence("jsd", beta=div.get("beta", 0.5))),
        ("exact/kl_reverse", get_divergence("rkl")),
        ("exact/kl_forward", get_divergence("fkl")),
    ):
        assert out.sums[key] == pytest.approx(float(d.full(zs, zt, mask=mask).sum()), rel=1e-6), key
    d = get_divergence(div["name"], **{k: v for k, v in div.items() if k != "name"})
    assert float(out.loss) * int(mask.sum()) == pytest.approx(float(d.full(zs, zt, mask=mask).sum()), rel=1e-6)


def test_overlap_by_hand():
    S = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0]])
    T = torch.tensor([[0.1, 0.5, 0.05, 0.3, 0.05]])
    ent_t, teacher_mass, student_mass, ratio = agreement(S.clamp(min=1e-30).log(), T.log(), k=2)
    assert float(teacher_mass) == pytest.approx(0.1 + 0.5)  # T on the student's top-2 {0, 1}
    assert float(student_mass) == pytest.approx(0.3 + 0.1)  # S on the teacher's top-2 {1, 3}
    assert float(ratio) == 0.5  # {0, 1} and {1, 3} share one of two
    assert float(ent_t) == pytest.approx(float(-(T * T.log()).sum()))
    *_, same = agreement(T.log(), T.log(), k=9)  # k above the vocabulary: all of it
    assert float(same) == 1.0


@pytest.mark.parametrize("filt", [dict(top_k=3), dict(top_p=0.6)], ids=["top_k3", "top_p0.6"])
def test_overlap_under_a_filter_keeping_fewer_than_k_is_defined_on_the_kept_set(filt):
    """k=8 under a filter that keeps fewer: the entries outside the filter all have zero mass and
    are in no top-k set, so the values do not depend on how the vocabulary is numbered."""
    from opd_exp.training.rollout import sampling_logits

    g = torch.Generator().manual_seed(3)
    V = 40
    zs, zt = 2 * torch.randn(6, V, generator=g), 2 * torch.randn(6, V, generator=g)
    zf = sampling_logits(zs, **filt)
    kept = torch.softmax(zf, -1) > 0
    assert (kept.sum(-1) < 8).all()
    got = torch.stack(agreement(zf, zt, k=8))
    for seed in range(3):
        perm = torch.randperm(V, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(torch.stack(agreement(zf[:, perm], zt[:, perm], k=8)), got, rtol=1e-6, atol=1e-7)
    S, T = torch.softmax(zf, -1), torch.softmax(zt, -1)
    top_t = T.topk(8, -1).indices
    torch.testing.assert_close(got[1], (T * kept).sum(-1))  # the teacher's mass on all the student keeps
    torch.testing.assert_close(got[2], S.gather(-1, top_t).sum(-1))
    shared = kept.gather(-1, top_t).sum(-1)  # kept entries among the teacher's top-8, of the smaller set
    torch.testing.assert_close(got[3], shared / kept.sum(-1))


@pytest.mark.parametrize(
    "rollout", [{}, {"top_k": 6, "temperature": 0.8}, {"top_p": 0.8}, {"top_k": 6, "top_p": 0.9}], ids=["none", "top_k", "top_p", "both"]
)
def test_logprob_gap_is_float_level_on_the_tiny_pair(tiny_pair, tmp_path, rollout):
    from opd_exp.training.trainer import Trainer

    cfg = small_config(
        divergence={"name": "jsd"}, estimator={"name": "sampled"}, loss={"name": "reinforce"}, rollout=rollout, trainer={"batch_size": 4}
    )
    t = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    m = t.train_step()
    assert m["rollout/logprob_gap"] < 1e-5 and m["rollout/logprob_gap_max"] < 1e-5
    assert m["rollout/outside_filter_tokens"] == 0.0
    for key in ("exact/jsd", "exact/kl_reverse", "teacher/entropy", "overlap/teacher_mass", "overlap/student_mass", "overlap/ratio"):
        assert math.isfinite(m[key]), key
    assert 0.0 <= m["overlap/ratio"] <= 1.0 and 0.0 <= m["overlap/teacher_mass"] <= 1.0
    assert ("exact/kl_forward" in m) == (not rollout.get("top_k") and rollout.get("top_p", 1.0) == 1.0)


def test_a_gap_above_the_threshold_is_a_warning_line(tiny_pair, tmp_path, monkeypatch):
    from opd_exp.training.trainer import Trainer

    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "sampled"}, loss={"name": "reinforce"}, trainer={"batch_size": 2})
    t = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    lines = []
    monkeypatch.setattr(t, "warn", lines.append)
    sample = t.sample

    def off_by_a_bit(step):  # an engine 0.01 nats away from the trainer on every token
        batch = sample(step)
        batch.sampling_logprobs = batch.sampling_logprobs + 0.01
        return batch

    monkeypatch.setattr(t, "sample", off_by_a_bit)
    m = t.train_step()
    assert m["rollout/logprob_gap"] == pytest.approx(0.01, rel=1e-3)
    assert len(lines) == 1 and lines[0].startswith("opd-train: warning: step 1: rollout/logprob_gap=1.00e-02 > 0.001 (max 1.00e-02)")
    t.train_step()
    assert len(lines) == 1  # once per run: the metric shows every step


def test_overlap_k_zero_drops_only_the_overlap_monitors():
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "sampled"}, loss={"name": "reinforce"})
    g = torch.Generator().manual_seed(2)
    zs, zt = torch.randn(2, 4, 9, generator=g), torch.randn(2, 4, 9, generator=g)
    y = torch.randint(0, 9, (2, 4), generator=g)
    mask = torch.ones(2, 4, dtype=torch.bool)
    full = _step(cfg, zs, zt, y, mask, on_policy=True, normalizer=8)
    cfg.trainer.overlap_k = 0
    out = _step(cfg, zs, zt, y, mask, on_policy=True, normalizer=8)
    assert not any(k.startswith("overlap/") for k in out.sums)
    assert not any(k.startswith("overlap/") for k in Monitors(cfg).names)
    assert {k: v for k, v in full.sums.items() if not k.startswith("overlap/")} == out.sums
    cfg.trainer.overlap_k = -1
    with pytest.raises(Exception, match=r"trainer.overlap_k=-1 .*integer >= 0"):
        cfg.trainer.__post_init__()
