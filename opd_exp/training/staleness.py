"""Asynchronous OPD: rollouts sampled ``rollout.staleness`` = k updates before the learner trains
on them, and the correction that makes their gradient the current student's.

Notation: the rollout of step n (0-based; the learner then holds theta_n, n updates applied) is
sampled by the behaviour policy B = S_{theta_{max(0, n-k)}}; S is the current student. Per row,
r_j = S(y_j | y_<j) / B(y_j | y_<j) at its trained positions j (the student's own tokens).

Importance weights (held constant to autograd):
- token credit: w_t = prod_{j <= t} r_j (the prefix up to and including y_t). For every per-token
  term g_t(y_<=t) of the on-policy estimator, E_{y~B}[w_t g_t] = E_{y~S}[g_t] exactly, so the
  expected gradient is the on-policy gradient at the current student (``tests/test_staleness.py``
  proves it by enumeration on a tabular model for sampled, top-k and full estimators);
- sequence credit: every position of a row gets the whole row's w = prod_j r_j (its returns sum
  the row's future costs).
Truncated at ``rollout.is_cap`` c: min(w, c); biased (towards the behaviour policy), measured in the
tests and docs/training.md. The loss normaliser is the one the run names (``loss.normalizer``).

Corrections (``rollout.correction``, a registry like the other axes):
- ``recompute``: the costs and log-probs under the current student (what the objective computes
  anyway), times the weights: AsyncOPD's learner-time recompute;
- ``is``: the weights on the costs as the behaviour policy gave them (the sampled-token cost of
  log B(y) instead of log S(y)); biased even untruncated (the cost is B's);
- ``none``: the stale rollout trained as if on-policy; biased; the weights it would have had are
  still logged.

Metrics (per trained token unless said): ``async/is_weight_mean`` (the applied, truncated weight),
``async/is_weight_max`` (the largest untruncated weight of the step), ``async/is_clip_frac`` (the
share truncated); per step ``async/staleness`` (updates between the sampling weights and the
learner's), ``async/learner_wait_s`` and ``async/producer_wait_s``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

WEIGHT_MEAN, WEIGHT_MAX, CLIP_FRAC = "async/is_weight_mean", "async/is_weight_max", "async/is_clip_frac"


def log_weights(s_now: torch.Tensor, s_behaviour: torch.Tensor, m: torch.Tensor, *, sequence: bool) -> torch.Tensor:
    """log w per position ``[N, R]`` (0 off ``m``): the prefix sums of log r over each row's trained
    positions, or (``sequence``) the row's whole sum at every position."""
    log_r = torch.where(m, s_now.to(torch.float64) - s_behaviour.to(torch.float64), torch.zeros((), dtype=torch.float64))
    log_w = log_r.sum(-1, keepdim=True).expand_as(log_r) if sequence else torch.cumsum(log_r, -1)
    return torch.where(m, log_w, torch.zeros_like(log_w))


class Correction:
    """One ``rollout.correction``: ``weights`` applied to the per-token loss terms and whether the
    sampled-token costs are the behaviour policy's (``stored_costs``)."""

    name: ClassVar[str]
    stored_costs: ClassVar[bool] = False
    applies: ClassVar[bool] = True  # False: the weights are logged, never applied

    def __init__(self, cap: float | None, sequence: bool):
        self.log_cap = math.inf if cap is None else math.log(cap)
        self.sequence = sequence

    @torch.no_grad()
    def weights(self, s_now, s_behaviour, m) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """(w [N, R] to multiply the loss terms by, per-token sums, maxima) on the trained positions ``m``."""
        log_w = log_weights(s_now, s_behaviour, m, sequence=self.sequence)
        w = torch.exp(log_w.clamp(max=self.log_cap))
        zero = torch.zeros((), dtype=w.dtype)
        sums = {WEIGHT_MEAN: float(torch.where(m, w, zero).sum()), CLIP_FRAC: float((m & (log_w > self.log_cap)).sum())}
        maxes = {WEIGHT_MAX: float(torch.exp(log_w[m].max())) if bool(m.any()) else 1.0}
        applied = w if self.applies else torch.ones_like(w)
        return applied.to(s_now.dtype), sums, maxes


CORRECTIONS: dict[str, type[Correction]] = {}


def register_correction(cls: type[Correction]) -> type[Correction]:
    from opd_exp.config.rollout import StalenessCorrection

    CORRECTIONS[cls.name] = cls
    StalenessCorrection._add(cls.name)
    return cls


@register_correction
class Recompute(Correction):
    name = "recompute"


@register_correction
class StoredCosts(Correction):
    name, stored_costs = "is", True


@register_correction
class NoCorrection(Correction):
    name, applies = "none", False


def build_correction(cfg) -> Correction | None:
    """The run's correction; None when rollouts are not stale (``rollout.staleness=0``)."""
    ro = cfg.rollout
    if not ro.staleness:
        return None
    return CORRECTIONS[ro.correction.value](ro.is_cap, sequence=cfg.loss.credit.value == "sequence")
