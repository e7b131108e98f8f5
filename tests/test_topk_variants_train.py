"""The TOPK_ESTIMATORS variants selected from config: a short run on the tiny pair logs finite
metrics with the estimator/* diagnostics; the unbiased ones at k = V give estimator=full's
gradient exactly; what they cannot do is refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers.tiny import AddTask, small_config
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.objective import Objective
from opd_exp.training.trainer import Trainer

V = 6
NEW = ("topk_student", "topk_union", "topk_generalized_kl", "topk_verl")


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_a_short_run_logs_finite_metrics_and_the_estimator_diagnostics(name, tiny_pair, tmp_path):
    cfg = small_config(estimator={"name": name, "k": 4}, loss={"name": "direct"}, trainer={"max_steps": 2})
    Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask()).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        for key in ("loss", "grad/norm", "kl/reverse", "exact/kl_reverse", "estimator/teacher_mass", "estimator/student_mass"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r[key])
        # masses of a top-4 set (or a union of two) of one distribution: in (0, 1]
        assert 0.0 < r["estimator/teacher_mass"] <= 1.0 + 1e-6 and 0.0 < r["estimator/student_mass"] <= 1.0 + 1e-6
        if name == "topk_verl":
            assert 0.0 <= r["estimator/clamp_rate"] <= 1.0
        else:
            assert "estimator/clamp_rate" not in r


def _pair(seed):
    g = torch.Generator().manual_seed(seed)
    zs = 2 * torch.randn(2, 3, V, generator=g, dtype=torch.float64)
    zt = 2 * torch.randn(2, 3, V, generator=g, dtype=torch.float64)
    return zs, zt, torch.randint(0, V, (2, 3), generator=g)


def _grad(cfg, zs, zt, y, mask):
    z = zs.clone().requires_grad_(True)
    out = Objective(cfg)(z, zt, y, mask, on_policy=True, normalizer=int(mask.sum()))
    (g,) = torch.autograd.grad(out.loss, z)
    return out, g


@pytest.mark.parametrize("name", ["topk_student", "topk_union"])
@pytest.mark.parametrize("divergence", [{"name": "rkl"}, {"name": "jsd", "beta": 0.3}, {"name": "fkl"}])
def test_unbiased_variants_at_k_equal_v_give_full_gradient(name, divergence):
    zs, zt, y = _pair(7)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    full = small_config(divergence=divergence, estimator={"name": "full"}, loss={"name": "direct", "kl_coef": 0.7})
    cfg = small_config(divergence=divergence, estimator={"name": name, "k": V}, loss={"name": "direct", "kl_coef": 0.7})
    want_out, want = _grad(full, zs, zt, y, mask)
    got_out, got = _grad(cfg, zs, zt, y, mask)
    assert want.abs().max() > 1e-2  # not a vanishing gradient
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(got_out.loss, want_out.loss, atol=1e-12, rtol=1e-10)
    # the whole vocabulary summed: both masses are 1 at every counted token (5 of them)
    assert got_out.sums["estimator/teacher_mass"] == pytest.approx(5.0, rel=1e-12)
    assert got_out.sums["estimator/student_mass"] == pytest.approx(5.0, rel=1e-12)


def test_topk_keeps_its_loss_and_reports_the_masses():
    zs, zt, y = _pair(8)
    mask = torch.ones(2, 3, dtype=torch.bool)
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "topk", "k": 2}, loss={"name": "direct"})
    out, _ = _grad(cfg, zs, zt, y, mask)
    t_top = torch.log_softmax(zt, -1).topk(2, dim=-1)
    teacher_mass = t_top.values.exp().sum(-1).sum()
    student_mass = torch.softmax(zs, -1).gather(-1, t_top.indices).sum(-1).sum()
    assert out.sums["estimator/teacher_mass"] == pytest.approx(float(teacher_mass), rel=1e-12)
    assert out.sums["estimator/student_mass"] == pytest.approx(float(student_mass), rel=1e-12)
    assert "estimator/clamp_rate" not in out.sums


def test_verl_reports_its_clamp():
    # fkl, the student more sure of the shared top-1 token than the teacher: T log(T/S) < 0 there
    zt = torch.tensor([[[4.0, 0.0, 0.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    zs = torch.tensor([[[6.0, 0.0, 0.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    cfg = small_config(divergence={"name": "fkl"}, estimator={"name": "topk_verl", "k": 1}, loss={"name": "direct"})
    out, g = _grad(cfg, zs, zt, torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool))
    assert out.sums["estimator/clamp_rate"] == 1.0 and float(out.loss.detach()) == 0.0 and float(g.abs().max()) == 0.0


@pytest.mark.parametrize(
    "groups,message",
    [
        (
            dict(estimator={"name": "topk_student"}, rollout={"top_k": 8}),
            "rollout.top_k=8 is not allowed; allowed: 0 (off) with estimator=topk_student: its estimate is not defined under a "
            "sampling filter (no filtered-mass term); use estimator=topk, full or sampled with a filter",
        ),
        (
            dict(estimator={"name": "topk_verl"}, rollout={"top_p": 0.9}),
            "rollout.top_p=0.9 is not allowed; allowed: 1.0 (off) with estimator=topk_verl: its estimate is not defined under a "
            "sampling filter (no filtered-mass term); use estimator=topk, full or sampled with a filter",
        ),
        (
            dict(estimator={"name": "topk_generalized_kl"}, divergence={"name": "tvd"}),
            "divergence.name='tvd' is not allowed; allowed: rkl, fkl, or jsd with beta 0 or 1 with "
            "estimator=topk_generalized_kl (the generalised KL is a KL's)",
        ),
        (
            dict(estimator={"name": "topk_generalized_kl"}, divergence={"name": "jsd", "beta": 0.5}),
            "divergence.beta=0.5 is not allowed; allowed: rkl, fkl, or jsd with beta 0 or 1 with "
            "estimator=topk_generalized_kl (the generalised KL is a KL's)",
        ),
        (
            dict(estimator={"name": "topk_verl"}, divergence={"name": "fkl", "clip": 5.0}),
            "divergence.clip=5.0 is not allowed; allowed: null with estimator=topk_verl (the clip caps the sampled cost; "
            "estimator=topk_verl uses none)",
        ),
    ],
)
def test_config_refusals_are_one_line(groups, message):
    with pytest.raises(ConfigError) as err:
        small_config(loss={"name": "direct"}, **groups)
    assert str(err.value) == message


@pytest.mark.parametrize("name", ["topk_student", "topk_union", "topk_verl"])
def test_a_sparse_teacher_refuses_the_estimators_that_need_it_dense(name):
    cfg = small_config(estimator={"name": name, "k": 2}, loss={"name": "direct"})
    with pytest.raises(ConfigError) as err:
        Objective(cfg, teacher_k=4, vocab_size=V)
    assert str(err.value) == (
        f"estimator.name='{name}' is not allowed with teacher=served and teacher.k=4 < the vocabulary's {V} tokens (it needs "
        "the teacher's log-probs on the student's top-k); allowed: topk, topk_renorm, topk_generalized_kl or sampled, or "
        "teacher=in_process, or teacher.k covering the vocabulary"
    )
    assert "\n" not in str(err.value)


def test_generalized_kl_runs_from_a_sparse_teacher():
    from opd_exp.training.scoring import TeacherScores

    zs, zt, y = _pair(9)
    mask = torch.ones(2, 3, dtype=torch.bool)
    cfg = small_config(estimator={"name": "topk_generalized_kl", "k": 2}, divergence={"name": "rkl"}, loss={"name": "direct"})
    dense, g_dense = _grad(cfg, zs, zt, y, mask)
    t_lp = torch.log_softmax(zt, -1)
    top = t_lp.topk(4, dim=-1)
    sparse_scores = TeacherScores(
        topk_ids=top.indices, topk_logprobs=top.values, sampled_logprobs=t_lp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    )
    z = zs.clone().requires_grad_(True)
    sparse = Objective(cfg, teacher_k=4, vocab_size=V)(z, sparse_scores, y, mask, on_policy=True, normalizer=6)
    (g_sparse,) = torch.autograd.grad(sparse.loss, z)
    torch.testing.assert_close(sparse.loss, dense.loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(g_sparse, g_dense, atol=1e-12, rtol=1e-12)
    with pytest.raises(ConfigError, match=r"^estimator.k=5 is not allowed with teacher=served and teacher.k=4"):
        Objective(small_config(estimator={"name": "topk_generalized_kl", "k": 5}, loss={"name": "direct"}), teacher_k=4, vocab_size=V)
