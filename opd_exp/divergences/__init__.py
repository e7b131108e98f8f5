"""Divergences between student and teacher, their estimators, and sequence credit.

Imports torch and nothing else of ours, so notebooks and other projects can use it alone::

    from opd_exp.divergences import get_divergence
    d = get_divergence("jsd", beta=0.5)
    cost = d.token_cost(s, t)        # REINFORCE cost of sampled tokens
    value = d.token_value(s, t)      # unbiased estimate of D
    exact = d.full(student_logits, teacher_logits, temperature=1.0, mask=mask)
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
    get_divergence,
    parameter_names,
)
from .credit import sequence_returns
from .full import default_chunk_size
from .reduce import masked_mean, masked_sum
from .topk import topk_estimate

__all__ = [
    "DIVERGENCES",
    "Divergence",
    "ForwardKL",
    "JensenShannon",
    "JensenShannonLegacy",
    "ReverseKL",
    "SkewForwardKL",
    "SkewReverseKL",
    "TotalVariation",
    "default_chunk_size",
    "get_divergence",
    "masked_mean",
    "masked_sum",
    "parameter_names",
    "sequence_returns",
    "topk_estimate",
]
