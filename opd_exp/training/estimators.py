"""Estimators of a student-sampled step, one registered object per ``estimator.name``.

An estimator turns the step's logits and teacher scores into per-token loss terms and the
advantages the metrics read; the objective makes one call (``Objective._on_policy``) and never asks
which estimator it has. Each states its own limits (``feeds``: what teacher payloads it needs;
``metrics``: the ``estimator/*`` diagnostics it logs; ``sampled_cost``: whether it uses the
sampled token's cost, where ``divergence.clip`` bites).

The math (DESIGN.md): with c the per-token REINFORCE cost of the divergence, E_{y~S}[c(y) grad log
S(y)] = grad D_t; ``full`` differentiates D_t exactly; the top-k estimators are exact on the
teacher's top-k and unbiased in the sampled tail (``topk``), or the documented biased variants.
A plugin registers one with ``register_estimator`` and passes ``check_estimator`` (expected
gradient against autograd of the exact divergence, by enumeration) before it trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from opd_exp.divergences import (
    TOPK_ESTIMATORS,
    expected_cost,
    filtered_value,
    generalized_kl_topk,
    leave_one_out,
    sequence_returns,
    topk_estimate,
    topk_expected_cost,
    truncation_masses,
)
from opd_exp.training.scoring import Feed, TeacherScores


@dataclass
class Estimate:
    """What an estimator gives the objective, per position ``[N, R]``."""

    per_token: torch.Tensor  # the loss term (with grad); summed over counted positions / normalizer
    advantages: torch.Tensor  # -kl_coef x the return: what ``advantages/mean`` logs
    clipped: torch.Tensor | None = None  # divergence.clip active (fkl's sampled cost)
    exact: torch.Tensor | None = None  # D_t exactly, where this estimator computed it (monitors reuse it)
    per_position: dict[str, torch.Tensor] = field(default_factory=dict)  # estimator/* diagnostics


@dataclass
class StepInputs:
    """One micro-batch as the objective sees it (the divergence, the run's settings, the tensors)."""

    obj: object  # the Objective (its divergence, ``value``, config)
    student_z: torch.Tensor  # [N, R, V] sampling-distribution logits, with grad
    scores: TeacherScores
    y: torch.Tensor  # [N, R] sampled ids
    m: torch.Tensor  # [N, R] bool: the kept (trained) positions
    s: torch.Tensor  # [N, R] log S(y), with grad
    t: torch.Tensor  # [N, R] log T(y), detached
    # [N, R] the log-probs the sampled-token cost is computed from, where not this forward's
    # (rollout.correction=is: the behaviour policy's); None: s
    cost_s: torch.Tensor | None = None

    @property
    def cfg(self):
        return self.obj.cfg


class Estimator:
    name: ClassVar[str]
    feeds: ClassVar[frozenset] = frozenset({Feed.dense})  # teacher payloads it can use
    metrics: ClassVar[tuple[str, ...]] = ()  # estimator/* names it logs
    sampled_cost: ClassVar[bool] = False

    def __call__(self, x: StepInputs) -> Estimate:
        raise NotImplementedError

    @staticmethod
    def with_credit(x: StepInputs, surrogate: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A per-position surrogate g_t (grad estimates grad D_t) and its value: (loss term,
        advantages) under ``loss.credit`` (sequence: the future values through log S(y_t))."""
        lo = x.cfg.loss
        if lo.credit.value == "sequence":
            future = sequence_returns(torch.zeros_like(value), value, x.m, lo.gamma)
            return lo.kl_coef * (surrogate + future * x.s), -lo.kl_coef * (value + future)
        return lo.kl_coef * surrogate, -lo.kl_coef * value


def ppo_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped per-token loss -min(A r, A clip(r, 1-eps, 1+eps)), and where the clip is
    active (the clipped term is the smaller: its gradient is 0 there)."""
    unclipped, clipped = advantages * ratio, advantages * ratio.clamp(1 - eps, 1 + eps)
    return -torch.minimum(unclipped, clipped), clipped.detach() < unclipped.detach()


ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(cls: type[Estimator]) -> type[Estimator]:
    """Register ``cls()`` under ``estimator.name=cls.name`` (a class decorator)."""
    from opd_exp.config.schema import EstimatorName

    if not getattr(cls, "name", "").isidentifier():
        raise ValueError(f"register_estimator: {cls.__name__}.name must be an identifier (it becomes estimator.name)")
    ESTIMATORS[cls.name] = cls()
    EstimatorName._add(cls.name)
    return cls


def get_estimator(name: str) -> Estimator:
    return ESTIMATORS[name]


@register_estimator
class Sampled(Estimator):
    """REINFORCE/PPO on the sampled token's exact cost, minus ``estimator.baseline``."""

    name = "sampled"
    feeds = frozenset({Feed.dense, Feed.topk, Feed.sampled})
    metrics = ("estimator/baseline",)
    sampled_cost = True

    def __call__(self, x: StepInputs) -> Estimate:
        obj, cfg, s0 = x.obj, x.cfg, x.s.detach()
        sc = s0 if x.cost_s is None else x.cost_s
        cost = obj.div.token_cost(sc, x.t)
        value = None
        if cfg.loss.credit.value == "sequence":
            value = obj.value(obj.div, sc, x.t, x.student_z.detach(), x.scores.logits, x.m)
            returns = sequence_returns(cost, value, x.m, cfg.loss.gamma)
        else:
            returns = cost
        per_position = {}
        if cfg.estimator.baseline.value != "none":  # a control variate that never reads y: the same expected gradient
            b = self.baseline(x, returns, value).to(returns.dtype)
            returns = torch.where(x.m, returns - b, returns)
            per_position["estimator/baseline"] = b
        advantages = -cfg.loss.kl_coef * returns  # after the baseline: what the loss uses (advantages/mean)
        if cfg.loss.name.value == "ppo":
            # The first (or only) update of a rollout: the weights are the sampling policy's, so
            # logp_old is this forward's own log-prob: the ratio is 1 in value, its gradient
            # grad log S (later updates: training/ppo.py, against the stored logp_old).
            per_token, _ = ppo_surrogate(torch.exp(x.s - s0), advantages, cfg.loss.clip_eps)
        else:
            per_token = -advantages * x.s
        clipped = obj.div.clipped(s0, x.t) if obj.report_clip else None
        return Estimate(per_token, advantages, clipped, None, per_position)

    @staticmethod
    def baseline(x: StepInputs, returns: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        """b per position (``estimator.baseline``, ``divergences.baseline``): the score-weighted mean cost under S, exact
        from a dense teacher or from the teacher's top-k (the sampling distribution's logits); or, over the prompt's other
        samples (loo), the mean of ``returns`` at each position, or with undiscounted sequence credit RLOO on each row's
        whole value sum_t v_t (``value``: the one-sample values the returns add up; for rkl the costs themselves)."""
        cfg = x.cfg
        if cfg.estimator.baseline.value == "loo":
            n = cfg.rollout.n_samples
            if value is not None and cfg.loss.gamma == 1.0:
                # b_t = mean_{j != i} V_j - sum_{t' < t} v_t': the advantage is c_t - v_t + V_i - mean_{j != i} V_j
                return leave_one_out(sequence_returns(value, value, x.m, 1.0), x.m, n, whole_row=True)
            return leave_one_out(returns, x.m, n)
        if cfg.estimator.baseline.value == "exact":
            return expected_cost(x.obj.div, x.student_z, x.scores.logits)
        tk_lp, tk_ids = x.scores.topk(cfg.estimator.k)
        return topk_expected_cost(x.obj.div, x.student_z, tk_lp, tk_ids)


@register_estimator
class Full(Estimator):
    """The exact D_t over the vocabulary, differentiated (GKD)."""

    name = "full"

    def __call__(self, x: StepInputs) -> Estimate:
        surrogate = x.obj.div.full(x.student_z, x.scores.logits, mask=x.m, chunk_size=x.cfg.estimator.chunk_size)
        value = surrogate.detach()
        per_token, advantages = self.with_credit(x, surrogate, value)
        return Estimate(per_token, advantages, None, value)


@register_estimator
class Topk(Estimator):
    """Exact over the teacher's top-k + an unbiased sampled tail (``renormalize``: ms-swift /
    NeMo-RL's renormalised top-k, biased)."""

    name = "topk"
    renormalize = False
    feeds = frozenset({Feed.dense, Feed.topk})
    metrics = ("estimator/teacher_mass", "estimator/student_mass")
    sampled_cost = True  # the tail term

    def __call__(self, x: StepInputs) -> Estimate:
        obj, cfg = x.obj, x.cfg
        tk_lp, tk_ids = x.scores.topk(cfg.estimator.k)
        surrogate, value = topk_estimate(obj.div, x.student_z, tk_lp, tk_ids, x.y, x.t, renormalize=self.renormalize)
        value = value.detach()
        clipped = None
        if obj.filtered and not self.renormalize:  # the tail's filtered entries, outside the exact head
            value = value + filtered_value(
                obj.div, x.student_z, x.scores.logits, mask=x.m, exclude_ids=tk_ids, pointwise=True, chunk_size=cfg.estimator.chunk_size
            ).to(value.dtype)
        if obj.report_clip and not self.renormalize:  # only the tail term uses the (clipped) cost
            clipped = obj.div.clipped(x.s.detach(), x.t) & ~(tk_ids == x.y.unsqueeze(-1)).any(-1)
        with torch.no_grad():
            masses = truncation_masses(x.student_z, tk_ids, tk_lp)
        per_token, advantages = self.with_credit(x, surrogate, value)
        return Estimate(per_token, advantages, clipped, None, dict(zip(self.metrics, masses)))


@register_estimator
class TopkRenorm(Topk):
    name = "topk_renorm"
    renormalize = True
    sampled_cost = False


class TopkVariant(Estimator):
    """A ``divergences.TOPK_ESTIMATORS`` variant on the teacher's dense log-probs (a sparse teacher
    reaches only topk_generalized_kl); both logits come tempered already (temperature 1 here)."""

    metrics = ("estimator/teacher_mass", "estimator/student_mass")

    def __call__(self, x: StepInputs) -> Estimate:
        k = x.cfg.estimator.k
        if not x.scores.dense:
            tk_lp, tk_ids = x.scores.topk(k)
            out = generalized_kl_topk(x.obj.div, x.student_z, tk_lp, tk_ids)
        else:
            teacher_z = x.scores.logits
            teacher_z = teacher_z.float() if teacher_z.dtype in (torch.float16, torch.bfloat16) else teacher_z
            t_lp = torch.log_softmax(teacher_z.detach(), dim=-1)
            out = TOPK_ESTIMATORS[self.name].estimate(x.obj.div, x.student_z, t_lp, x.y, k=min(k, t_lp.shape[-1]), temperature=1.0)
        per_position = {"estimator/teacher_mass": out.teacher_mass, "estimator/student_mass": out.student_mass}
        if "estimator/clamp_rate" in self.metrics:
            per_position["estimator/clamp_rate"] = out.clamped
        per_token, advantages = self.with_credit(x, out.surrogate, out.value.detach())
        return Estimate(per_token, advantages, None, None, per_position)


for _name in ("topk_student", "topk_union", "topk_generalized_kl", "topk_verl"):
    _feeds = frozenset({Feed.dense, Feed.topk}) if TOPK_ESTIMATORS[_name].sparse_teacher else frozenset({Feed.dense})
    _metrics = TopkVariant.metrics + (("estimator/clamp_rate",) if _name == "topk_verl" else ())
    _cost = _name in ("topk_student", "topk_union")  # their tail uses the sampled cost
    register_estimator(type(f"Topk_{_name}", (TopkVariant,), {"name": _name, "feeds": _feeds, "metrics": _metrics, "sampled_cost": _cost}))
