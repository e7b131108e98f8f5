"""Divergences between student and teacher, their estimators, and sequence credit.

Imports torch and nothing else of ours, so notebooks and other projects can use it alone::

    from opd_exp.divergences import get_divergence
    d = get_divergence("jsd", beta=0.5)
    cost = d.token_cost(s, t)        # REINFORCE cost of sampled tokens
    value = d.token_value(s, t)      # unbiased estimate of D
    exact = d.full(student_logits, teacher_logits, temperature=1.0, mask=mask)

A new divergence is one class with ``@register_divergence``; ``check_divergence(d)`` runs the
exactness checks on it (docs/extending.md).
"""

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
from .check import CheckReport, DivergenceCheckError, check_divergence
from .credit import sequence_returns
from .filtered import filtered_value, outside_support
from .full import default_chunk_size
from .reduce import masked_mean, masked_sum
from .topk import topk_estimate

__all__ = [
    "DIVERGENCES",
    "CheckReport",
    "Divergence",
    "DivergenceCheckError",
    "ForwardKL",
    "JensenShannon",
    "JensenShannonLegacy",
    "ReverseKL",
    "SkewForwardKL",
    "SkewReverseKL",
    "TotalVariation",
    "check_divergence",
    "default_chunk_size",
    "divergence_class",
    "filtered_value",
    "get_divergence",
    "masked_mean",
    "masked_sum",
    "on_register",
    "outside_support",
    "parameter_names",
    "register_divergence",
    "sequence_returns",
    "topk_estimate",
]
