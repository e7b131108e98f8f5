"""Objective: divergence x estimator x loss form -> loss and per-token metric sums.

Inputs per micro-batch are the student's sampling-distribution logits (with grad), the
teacher's tempered logits, the response ids and mask. The loss is a SUM over response
tokens divided by ``normalizer``, the step's global response-token count, so accumulating
micro-batches gives exactly the gradient of one big batch. Metric sums are returned
unnormalised for the same reason.

Estimators (student-sampled batches):
  sampled      R_t = c_t (credit=token) or c_t + sum gamma^k v_{t+k} (credit=sequence)
               ppo:       -min(A r, A clip(r)), A = -kl_coef R, r = exp(logp - logp_old)
               reinforce: kl_coef * R * log S(y_t)
  topk/full    per-position surrogate g_t whose gradient estimates grad D_t (exact for full)
               reinforce: kl_coef * (g_t + F_t log S(y_t)), F_t the future part of the return
               direct:    kl_coef * g_t (GKD)
Teacher-sampled batches (on_policy_fraction < 1): the samples are not from the student, so
sampled-token costs would be biased; they always use the exact full-vocab loss
kl_coef * D_t (GKD's choice), whatever the estimator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd_exp.config.schema import Credit, EstimatorName, LossName, TrainConfig
from opd_exp.divergences import get_divergence, sequence_returns, topk_estimate
from opd_exp.training.scoring import entropy, teacher_topk, token_logprobs

# Per-token metrics summed over response tokens (divide by the global token count).
TOKEN_METRICS = (
    "jsd/mean",
    "kl/reverse",
    "kl/forward",
    "advantages/mean",
    "student/logprob_mean",
    "teacher/logprob_mean",
    "student/entropy",
)


def position_mask(mask: torch.Tensor, positions: str, fraction: float) -> torch.Tensor:
    """The response positions that count in the loss: ``all`` of them, or the ``first`` /
    ``last`` ceil(fraction * L) of each row's L response tokens (``mask`` is [N, R], a prefix
    of each row)."""
    m = mask.bool()
    if positions == "all":
        return m
    length = m.sum(-1, keepdim=True)
    n = torch.ceil(fraction * length.to(torch.float64)).to(length.dtype)
    index = torch.cumsum(m.long(), -1) - 1  # 0-based index among the row's response tokens
    keep = index < n if positions == "first" else index >= length - n
    return m & keep


@dataclass
class Output:
    loss: torch.Tensor  # differentiable scalar (already divided by the normalizer)
    sums: dict[str, float]  # metric name -> sum over response tokens


def metric_beta(cfg: TrainConfig) -> float:
    """`jsd/mean` is at the configured beta for jsd (and jsd_legacy), and at 0.5 for every other divergence."""
    return cfg.divergence.beta if cfg.divergence.name.value in ("jsd", "jsd_legacy") else 0.5


class Objective:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.div = get_divergence(cfg.divergence.name.value, **cfg.divergence.params())
        self.jsd = get_divergence("jsd", beta=metric_beta(cfg))
        self.rkl = get_divergence("rkl")
        self.fkl = get_divergence("fkl")
        self.report_clip = cfg.divergence.name.value == "fkl" and cfg.divergence.clip is not None

    def __call__(
        self,
        student_z: torch.Tensor,
        teacher_z: torch.Tensor,
        response_ids: torch.Tensor,
        mask: torch.Tensor,
        *,
        on_policy: bool,
        normalizer: float,
    ) -> Output:
        cfg = self.cfg
        m = mask.bool()
        zero = torch.zeros((), dtype=student_z.dtype, device=student_z.device)
        kl_coef = cfg.loss.kl_coef
        chunk = cfg.estimator.chunk_size
        s = token_logprobs(student_z, response_ids)  # log S(y_t), with grad
        t = token_logprobs(teacher_z, response_ids).detach()  # log T(y_t)
        s0 = s.detach()

        if not on_policy:
            exact = self.div.full(student_z, teacher_z, mask=m, chunk_size=chunk)
            per_token = kl_coef * exact
            advantages = -kl_coef * exact.detach()
        else:
            per_token, advantages = self._on_policy(student_z, teacher_z, response_ids, m, s, t)

        counted = position_mask(m, cfg.loss.positions.value, cfg.loss.position_fraction)
        loss = torch.where(counted, per_token, zero).sum() / max(float(normalizer), 1.0)

        with torch.no_grad():
            if on_policy:  # unbiased single-sample estimates under y ~ S
                jsd, rkl, fkl = (d.token_value(s0, t) for d in (self.jsd, self.rkl, self.fkl))
            else:  # y is the teacher's: estimate exactly over the vocabulary instead
                jsd, rkl, fkl = (d.full(student_z.detach(), teacher_z, mask=m, chunk_size=chunk) for d in (self.jsd, self.rkl, self.fkl))
            values = {
                "jsd/mean": jsd,
                "kl/reverse": rkl,
                "kl/forward": fkl,
                "advantages/mean": advantages,
                "student/logprob_mean": s0,
                "teacher/logprob_mean": t,
                "student/entropy": entropy(student_z),
            }
            if self.report_clip and on_policy:
                values["cost/clipped_frac"] = self.div.clipped(s0, t).to(s0.dtype)
            sums = {k: float(torch.where(m, v.to(zero.dtype), zero).sum()) for k, v in values.items()}
        return Output(loss=loss, sums=sums)

    def _on_policy(self, student_z, teacher_z, y, m, s, t):
        cfg = self.cfg
        kl_coef, credit, gamma = cfg.loss.kl_coef, cfg.loss.credit, cfg.loss.gamma
        est, form = cfg.estimator.name, cfg.loss.name
        s0 = s.detach()
        if est is EstimatorName.sampled:
            cost = self.div.token_cost(s0, t)
            if credit is Credit.sequence:
                returns = sequence_returns(cost, self.div.token_value(s0, t), m, gamma)
            else:
                returns = cost
            advantages = -kl_coef * returns
            if form is LossName.ppo:
                # One optimizer step per rollout, so logp_old is the sampling policy's log-prob
                # under the same transform: the ratio is 1 in value, its gradient grad log S.
                ratio = torch.exp(s - s0)
                eps = cfg.loss.clip_eps
                per_token = -torch.minimum(advantages * ratio, advantages * ratio.clamp(1 - eps, 1 + eps))
            else:
                per_token = -advantages * s
            return per_token, advantages

        if est is EstimatorName.full:
            surrogate = self.div.full(student_z, teacher_z, mask=m, chunk_size=cfg.estimator.chunk_size)
            value = surrogate.detach()
        else:
            tk_lp, tk_ids = teacher_topk(teacher_z, cfg.estimator.k)
            surrogate, value = topk_estimate(self.div, student_z, tk_lp, tk_ids, y, t, renormalize=est is EstimatorName.topk_renorm)
            value = value.detach()
        if credit is Credit.sequence:
            future = sequence_returns(torch.zeros_like(value), value, m, gamma)
            per_token = kl_coef * (surrogate + future * s)
        else:
            future = torch.zeros_like(value)
            per_token = kl_coef * surrogate
        return per_token, -kl_coef * (value + future)


@torch.no_grad()
def exact_divergences(
    student_z: torch.Tensor, teacher_z: torch.Tensor, mask: torch.Tensor, divergences: dict, chunk_size=None
) -> dict[str, float]:
    """Sums over masked positions of the exact divergences ``{name: Divergence}``."""
    m = mask.bool()
    return {name: float(d.full(student_z, teacher_z, mask=m, chunk_size=chunk_size).sum()) for name, d in divergences.items()}
