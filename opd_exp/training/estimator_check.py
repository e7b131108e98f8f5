"""``check_estimator``: an estimator's expected gradient by enumeration against autograd of the
exact divergence (run at start on a plugin estimator, ``opd_exp.cli.plugin_check``). Apart from
``estimators.py`` because it drives the whole objective, which itself calls the estimators."""

from __future__ import annotations

import dataclasses

import torch

from opd_exp.divergences import get_divergence
from opd_exp.training.objective import Objective
from opd_exp.training.scoring import TeacherScores


class EstimatorCheckError(AssertionError):
    """A registered estimator whose expected gradient is not the divergence's."""


def check_estimator(cfg, *, vocab: int = 6, seeds=(0, 1, 2), rtol: float = 1e-6) -> float:
    """The expected gradient of ``cfg.estimator.name``'s loss under y ~ S, by enumeration over a
    ``vocab``-token vocabulary at one position in float64, against autograd of kl_coef x the exact
    D(S, T) of ``cfg.divergence`` (token credit, every position counted, no reward or filter).
    Returns the largest relative error; raises ``EstimatorCheckError`` above ``rtol``."""
    check_cfg = dataclasses.replace(
        cfg,
        loss=dataclasses.replace(cfg.loss, credit=type(cfg.loss.credit)("token")),
        rollout=dataclasses.replace(cfg.rollout, top_k=0, top_p=1.0),
        reward=dataclasses.replace(cfg.reward, coef=0.0),
        positions=type(cfg.positions)(),
    )
    obj = Objective(check_cfg, vocab_size=vocab)
    div = get_divergence(cfg.divergence.name.value, **cfg.divergence.params())
    worst = 0.0
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        zs = torch.randn(1, 1, vocab, generator=g, dtype=torch.float64, requires_grad=True)
        zt = torch.randn(1, 1, vocab, generator=g, dtype=torch.float64)
        (want,) = torch.autograd.grad(cfg.loss.kl_coef * div.full(zs, zt).sum(), zs)
        probs = torch.softmax(zs.detach(), -1)[0, 0]
        got = torch.zeros_like(zs)
        mask = torch.ones(1, 1, dtype=torch.bool)
        for y in range(vocab):
            out = obj(zs, TeacherScores(logits=zt), torch.tensor([[y]]), mask, on_policy=True, normalizer=1)
            (gy,) = torch.autograd.grad(out.loss, zs)
            got += probs[y] * gy
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        worst = max(worst, err)
        if not err <= rtol:  # a NaN fails too
            raise EstimatorCheckError(
                f"estimator={cfg.estimator.name.value}: its expected gradient under y ~ S differs from the exact gradient of "
                f"{cfg.divergence.name.value} by {err:.3g} relative (seed {seed}, {vocab} tokens, float64; allowed: <= {rtol:g})"
            )
    return worst
