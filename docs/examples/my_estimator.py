"""A plugin estimator in one file: sampled REINFORCE with the whole-vocabulary expectation of the
cost as its own control variate ("rao_baseline": the same expected gradient as estimator=sampled,
with b = E_S[c] computed here rather than by estimator.baseline).

    OPD_PLUGINS=docs/examples/my_estimator.py opd-train estimator.name=rao_baseline loss=reinforce

opd-train runs ``check_estimator`` on it first (expected gradient under y ~ S, by enumeration,
against autograd of the exact divergence) and refuses it in one line if it fails.
"""

import torch

from opd_exp.divergences import expected_cost
from opd_exp.training.estimators import Estimate, Estimator, register_estimator
from opd_exp.training.scoring import Feed


@register_estimator
class RaoBaseline(Estimator):
    name = "rao_baseline"
    feeds = frozenset({Feed.dense})  # the expectation needs the teacher's whole distribution
    sampled_cost = True

    def __call__(self, x):
        s0 = x.s.detach()
        cost = x.obj.div.token_cost(s0, x.t)
        b = expected_cost(x.obj.div, x.student_z, x.scores.logits).to(cost.dtype)  # never reads y: no bias
        advantages = -x.cfg.loss.kl_coef * torch.where(x.m, cost - b, cost)
        return Estimate(per_token=-advantages * x.s, advantages=advantages)
