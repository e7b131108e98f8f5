"""Divergences between student and teacher, their estimators, and sequence credit.

Imports torch and nothing else of ours, so notebooks and other projects can use it alone::

    from opd_exp.divergences import get_divergence
    d = get_divergence("jsd", beta=0.5)
    cost = d.token_cost(s, t)        # REINFORCE cost of sampled tokens
    value = d.token_value(s, t)      # unbiased estimate of D
    exact = d.full(student_logits, teacher_logits, temperature=1.0, mask=mask)

A new divergence is one class with ``@register_divergence``; ``check_divergence(d)`` runs the
exactness checks on it (docs/extending.md), ``check_topk_estimators(d)`` those of the unbiased
top-k estimators (``TOPK_ESTIMATORS``, docs/divergences.md#top-k-estimators).
"""

from .baseline import expected_cost, leave_one_out, topk_expected_cost
from .catalog import (
    DIVERGENCES,
    Divergence,
    ForwardKL,
    JensenShannon,
    JensenShannonLegacy,
    ReverseKL,
    SkewForwardKL,
    SkewReverseKL,
    TotalVariation,
    divergence_class,
    get_divergence,
    on_register,
    parameter_names,
    register_divergence,
)
from .check import CheckReport, DivergenceCheckError, check_divergence, check_topk_estimators
from .credit import sequence_returns
from .filtered import filtered_value, outside_support
from .full import default_chunk_size
from .reduce import masked_mean, masked_sum
from .topk import topk_estimate
from .topk_variants import (
    TOPK_ESTIMATORS,
    TopkEstimate,
    TopkEstimator,
    generalized_kl_topk,
    set_estimate,
    student_topk_estimate,
    teacher_topk_estimate,
    topk_estimator,
    truncation_masses,
    union_topk_estimate,
    verl_topk,
)

__all__ = [
    "DIVERGENCES",
    "TOPK_ESTIMATORS",
    "CheckReport",
    "Divergence",
    "DivergenceCheckError",
    "ForwardKL",
    "JensenShannon",
    "JensenShannonLegacy",
    "ReverseKL",
    "SkewForwardKL",
    "SkewReverseKL",
    "TopkEstimate",
    "TopkEstimator",
    "TotalVariation",
    "check_divergence",
    "check_topk_estimators",
    "default_chunk_size",
    "divergence_class",
    "expected_cost",
    "filtered_value",
    "generalized_kl_topk",
    "get_divergence",
    "leave_one_out",
    "masked_mean",
    "masked_sum",
    "on_register",
    "outside_support",
    "parameter_names",
    "register_divergence",
    "sequence_returns",
    "set_estimate",
    "student_topk_estimate",
    "teacher_topk_estimate",
    "topk_estimate",
    "topk_estimator",
    "topk_expected_cost",
    "truncation_masses",
    "union_topk_estimate",
    "verl_topk",
]
