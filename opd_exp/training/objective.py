"""Objective: divergence x estimator x loss form -> loss and per-token metric sums.

Inputs per micro-batch are the student's sampling-distribution logits (with grad), the
teacher's tempered logits, the response ids and mask. The loss is a SUM over response
tokens divided by ``normalizer``, the step's global response-token count, so accumulating
micro-batches gives exactly the gradient of one big batch. Metric sums are returned
unnormalised for the same reason.

Estimators (student-sampled batches):
  sampled      R_t = c_t (credit=token) or c_t + sum gamma^k v_{t+k} (credit=sequence; k counts trained tokens), minus
               b_t = the score-weighted mean cost under S with ``estimator.baseline`` (a control variate that never reads y_t:
               the same expected gradient, a lower variance; ``divergences.baseline``)
               ppo:       -min(A r, A clip(r)), A = -kl_coef R, r = exp(logp - logp_old)
               reinforce: kl_coef * R * log S(y_t)
  topk/full    per-position surrogate g_t whose gradient estimates grad D_t (exact for full)
               reinforce: kl_coef * (g_t + F_t log S(y_t)), F_t the future part of the return
               direct:    kl_coef * g_t (GKD)
  topk_student, topk_union, topk_generalized_kl, topk_verl
               ``divergences.TOPK_ESTIMATORS`` on the teacher's dense log-probs, treated as topk
               (the last two are biased direct losses; their value is the loss itself)
Teacher-sampled batches (on_policy_fraction < 1): the samples are not from the student, so
sampled-token costs would be biased; they always use the exact full-vocab loss
kl_coef * D_t (GKD's choice), whatever the estimator.

Reward (``reward.coef > 0``, student-sampled batches only): ``reward_advantages`` [N, R] is
added to the advantages, its loss term -A_r log S(y_t) on the counted positions, after the
position weights (for ppo: inside the surrogate at ratio 1); ``training/reward.py``.

Filtered sampling (rollout.top_k / top_p): every value (metrics, sequence-credit returns)
adds the exact filtered-mass term F (``divergences.filtered``), which a sampled token cannot
see; a sampled token the trainer's distribution gives probability 0 (engine numerics at the
filter boundary) is kept out of the loss and the metrics and counted.

The monitors (``exact/*``, entropies, ``overlap/*``, ``rollout/logprob_gap``) are not the
objective's: ``training/monitors.py`` computes them beside it, from its ``Output``.

The teacher comes as ``TeacherScores``: dense logits (in-process), or a sparse payload (a
served teacher: top-k ids and log-probs, the sampled token's log-prob). A sparse teacher whose
k does not cover the vocabulary feeds the estimators that need no more than that
(``topk``/``topk_renorm``/``topk_generalized_kl``, and ``sampled``); whatever needs the teacher's whole distribution
(``exact/*``, ``teacher/entropy``, ``overlap/*``, the filtered-mass term, off-policy steps) is
refused at start-up or not logged (``monitors.TOKEN_METRICS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opd_exp.config.schema import TOPK_VARIANTS, Baseline, EstimatorName, LossName, TrainConfig
from opd_exp.divergences import (
    TOPK_ESTIMATORS,
    filtered_value,
    get_divergence,
)
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.estimators import StepInputs, get_estimator, ppo_surrogate
from opd_exp.training.monitors import OUTSIDE, exact_divergences, metric_beta, step_monitors, token_metric_names
from opd_exp.training.positions import build_position_rule, position_mask
from opd_exp.training.reward import with_reward
from opd_exp.training.scoring import TeacherScores, token_logprobs
from opd_exp.training.staleness import build_correction

__all__ = ["Objective", "Output", "metric_beta", "position_mask", "ppo_surrogate"]


def student_token_budget(cfg: TrainConfig) -> int:
    """The most tokens the student writes in one rollout row: ``rollout.max_new_tokens`` for one
    turn; for an episode (a task with an environment) its budget ``rollout.max_episode_tokens``, at
    most ``max_turns`` turns at their cap (environment tokens take from it, never add to it)."""
    from opd_exp.tasks.environment import environment_names

    ro = cfg.rollout
    if cfg.task.name not in environment_names():
        return ro.max_new_tokens
    return min(ro.episode_tokens, ro.max_turns * ro.max_new_tokens)


def loss_normalizer(cfg: TrainConfig, n_tokens: int, n_rows: int) -> float:
    """What a step's (or PPO mini-batch's) summed loss is divided by (``loss.normalizer``): its
    trained-token count, or the constant ``n_rows`` x the student's token budget per row
    (``student_token_budget``). Only the constant keeps E[grad loss] equal to the gradient of the
    per-token target when lengths vary (EOS, episodes)."""
    if cfg.loss.normalizer.value == "constant":
        return float(n_rows * student_token_budget(cfg))
    return float(n_tokens)


@dataclass
class Output:
    loss: torch.Tensor  # differentiable scalar (already divided by the normalizer)
    sums: dict[str, float]  # metric name -> sum over response tokens
    counts: dict[str, float] = field(default_factory=dict)  # metric name -> a count (not divided)
    maxes: dict[str, float] = field(default_factory=dict)  # metric name -> a maximum over tokens
    # per position [N, R] (detached): the advantages, the positions the loss counts, the log-probs
    # log S(y) of this forward (PPO's behaviour log-probs), the tokens the metrics count
    advantages: torch.Tensor | None = None
    counted: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    on_policy: bool = True
    exact: dict[str, torch.Tensor] = field(default_factory=dict)  # exact/* values already computed here


def check_sparse_teacher(cfg: TrainConfig, k: int, vocab_size: int) -> None:
    """A sparse teacher (top-``k`` of ``vocab_size`` tokens, k < V) feeds only what needs no
    more than the top-k and the sampled token: one line otherwise, before training."""
    est, ro = cfg.estimator.name, cfg.rollout
    where = f"with teacher=served and teacher.k={k} < the vocabulary's {vocab_size} tokens"
    if est is EstimatorName.full:
        raise ConfigError(
            f"estimator.name='full' is not allowed {where} (the exact loss needs every teacher log-prob); "
            "allowed: topk (exact top-k + unbiased tail), topk_renorm, or sampled; full only where teacher.k covers the vocabulary"
        )
    if est in TOPK_VARIANTS and not TOPK_ESTIMATORS[est.value].sparse_teacher:
        raise ConfigError(
            f"estimator.name={est.value!r} is not allowed {where} (it needs the teacher's log-probs on the student's top-k); "
            "allowed: topk, topk_renorm, topk_generalized_kl or sampled, or teacher=in_process, or teacher.k covering the vocabulary"
        )
    if cfg.estimator.baseline is Baseline.exact:
        raise ConfigError(
            f"estimator.baseline='exact' is not allowed {where} (it needs every teacher log-prob); "
            "allowed: topk (from the teacher's top-k) or none, or teacher=in_process"
        )
    topk_baseline = cfg.estimator.baseline is Baseline.topk
    if (est in (EstimatorName.topk, EstimatorName.topk_renorm, EstimatorName.topk_generalized_kl) or topk_baseline) and cfg.estimator.k > k:
        raise ConfigError(f"estimator.k={cfg.estimator.k} is not allowed {where}; allowed: estimator.k <= teacher.k")
    if ro.filtered:
        key, value = ("rollout.top_k", ro.top_k) if ro.top_k > 0 else ("rollout.top_p", ro.top_p)
        raise ConfigError(
            f"{key}={value!r} is not allowed {where} (the filtered-mass term needs the teacher's whole distribution); "
            "allowed: rollout.top_k=0 and rollout.top_p=1.0, or teacher=in_process"
        )
    if ro.on_policy_fraction < 1.0:
        raise ConfigError(
            f"rollout.on_policy_fraction={ro.on_policy_fraction!r} is not allowed {where} (teacher-sampled steps use the exact "
            "full-vocabulary loss); allowed: 1.0, or teacher=in_process"
        )


class Objective:
    def __init__(self, cfg: TrainConfig, teacher_k: int | None = None, vocab_size: int | None = None):
        """``teacher_k``: the top-k of a sparse teacher that does not cover the ``vocab_size``
        tokens (None: a dense teacher, or one whose payload is rebuilt dense)."""
        self.cfg = cfg
        self.sparse = teacher_k is not None
        self.positions = build_position_rule(cfg, sparse=self.sparse)  # which positions count, with what weight
        self.correction = build_correction(cfg)  # rollout.staleness > 0: importance weights of a stale rollout
        if self.sparse:
            check_sparse_teacher(cfg, teacher_k, int(vocab_size or 0))
        self.div = get_divergence(cfg.divergence.name.value, **cfg.divergence.params())
        self.estimator = get_estimator(cfg.estimator.name.value)
        self.jsd = get_divergence("jsd", beta=metric_beta(cfg))
        self.rkl = get_divergence("rkl")
        self.fkl = get_divergence("fkl")
        # the exact divergences (a teacher-sampled step's estimates), and those that are the trained one
        self.exact_order = exact_divergences(cfg)
        self.exact_is_trained = {n for n, d in self.exact_order.items() if type(d) is type(self.div) and d.params() == self.div.params()}
        self.filtered = cfg.rollout.filtered  # top-k/top-p: values need the filtered-mass term
        self.names = token_metric_names(cfg, sparse=self.sparse, by="objective")
        # the clip bites only where a sampled cost is used: estimator=sampled, and topk's tail
        self.report_clip = cfg.divergence.name.value == "fkl" and cfg.divergence.clip is not None

    def __call__(
        self,
        student_z: torch.Tensor,
        teacher: TeacherScores | torch.Tensor,
        response_ids: torch.Tensor,
        mask: torch.Tensor,
        *,
        on_policy: bool,
        normalizer: float,
        counted: torch.Tensor | None = None,
        reward_advantages: torch.Tensor | None = None,
        behaviour_logprobs: torch.Tensor | None = None,
    ) -> Output:
        """``counted``: the positions the loss counts, ``self.positions.counted`` of the rows' whole
        response masks (a caller that passes a chunk of positions from several rows computes it per
        row first); by default computed here, ``mask`` being whole rows. Their weights (or the
        entropy gate's forward-KL term) are applied here: ``training/positions.py``.
        ``behaviour_logprobs``: log B(y) of the policy that sampled a stale rollout (rollout.staleness
        > 0): its correction's importance weights multiply the terms (``training/staleness.py``)."""
        cfg = self.cfg
        # the teacher: its TeacherScores (completed beside the student's logits where it says so), or its dense tempered logits
        scores = (teacher if isinstance(teacher, TeacherScores) else TeacherScores(logits=teacher)).against(student_z)
        if scores.dense == self.sparse or (self.sparse and not on_policy):
            raise ValueError(
                f"Objective: built for a {'sparse' if self.sparse else 'dense'} teacher, given "
                f"{'dense' if scores.dense else 'sparse'} scores on a {'student' if on_policy else 'teacher'}-sampled batch"
            )
        teacher_z = scores.logits  # None for a sparse teacher
        zero = torch.zeros((), dtype=student_z.dtype, device=student_z.device)
        kl_coef = cfg.loss.kl_coef
        chunk = cfg.estimator.chunk_size
        s = token_logprobs(student_z, response_ids)  # log S(y_t), with grad
        t = scores.token_logprobs(response_ids).detach()  # log T(y_t)
        s0 = s.detach()
        # A token our (filtered) distribution gives probability 0: log S = -1e9. Sampled by the
        # student, it is outside the recomputed top-k/top-p set (engine numerics): a cost of
        # ~-1e9, kept out of the loss and the metrics. Sampled by the teacher, the exact loss is
        # defined anyway; only the log S metric leaves it out.
        outside = mask.bool() & (s0.exp() == 0)
        m = mask.bool() & ~outside if on_policy else mask.bool()
        stale = self.correction is not None and behaviour_logprobs is not None and on_policy
        cost_s = behaviour_logprobs.to(s0.dtype) if stale and self.correction.stored_costs else None

        per_position: dict[str, torch.Tensor] = {}  # estimator/* diagnostics of a top-k estimator
        if not on_policy:
            d_exact = self.div.full(student_z, teacher_z, mask=m, chunk_size=chunk)
            per_token = kl_coef * d_exact
            advantages = -kl_coef * d_exact.detach()
            clipped, trained_exact = None, d_exact.detach()
        else:
            per_token, advantages, clipped, trained_exact, per_position = self._on_policy(student_z, scores, response_ids, m, s, t, cost_s)

        if counted is None:
            counted = self.positions.counted(mask)
        counted = counted.bool() & m
        per_token, weighting = self.positions.terms(
            per_token, counted, s=s0, t=t, student_z=student_z, teacher_z=teacher_z, kl_coef=kl_coef, chunk_size=chunk
        )
        if reward_advantages is not None and on_policy:  # reward.coef > 0, after the position weights (training/reward.py)
            per_token, advantages = with_reward(per_token, advantages, reward_advantages, s, ppo=cfg.loss.name is LossName.ppo)
        stale_sums, stale_maxes = {}, {}
        if stale:  # after the weights and the reward: every term of a stale row is reweighted
            w, stale_sums, stale_maxes = self.correction.weights(s0, behaviour_logprobs, m)
            per_token = per_token * w
        loss = torch.where(counted, per_token, zero).sum() / max(float(normalizer), 1.0)

        with torch.no_grad():
            # the exact value the loss already computed (estimator=full, or a teacher-sampled step)
            known = dict.fromkeys(self.exact_is_trained, trained_exact) if trained_exact is not None else {}
            if on_policy:  # unbiased single-sample estimates under y ~ S
                exact = known
                jsd, rkl = (self.value(d, s0, t, student_z.detach(), teacher_z, m) for d in (self.jsd, self.rkl))
                fkl = None if self.filtered else self.fkl.token_value(s0, t)
            else:  # y is the teacher's: estimate exactly over the vocabulary instead, in one pass
                todo = {n: d for n, d in self.exact_order.items() if n not in known}
                exact = {
                    **known,
                    **step_monitors(student_z.detach(), teacher_z, m, divergences=todo, k=0, chunk_rows=chunk, entropies=False),
                }
                jsd, rkl, fkl = (exact.get(k) for k in ("exact/jsd", "exact/kl_reverse", "exact/kl_forward"))
            values = {
                "jsd/mean": jsd,
                "kl/reverse": rkl,
                "kl/forward": fkl,
                "advantages/mean": advantages,
                "student/logprob_mean": s0,
                "teacher/logprob_mean": t,
                **per_position,
                **weighting,
            }
            values = {k: v for k, v in values.items() if k in self.names}
            if clipped is not None:
                values["cost/clipped_frac"] = clipped.to(s0.dtype)
            sums = {k: float(torch.where(m, v.to(zero.dtype), zero).sum()) for k, v in values.items()}
            sums["student/logprob_mean"] = float(torch.where(m & ~outside, s0, zero).sum())
            counts = {OUTSIDE: float(outside.sum())} if on_policy else {}
        return Output(
            loss=loss,
            sums={**sums, **stale_sums},
            counts=counts,
            maxes=stale_maxes,
            advantages=advantages.detach(),
            counted=counted,
            logprobs=s0,
            kept=m,
            on_policy=on_policy,
            exact=exact,
        )

    def value(self, d, s, t, student_z, teacher_z, m) -> torch.Tensor:
        """Unbiased one-sample estimate of D_t: phi(y)/S(y), plus the filtered mass under top-k/top-p."""
        v = d.token_value(s, t)
        if self.filtered:
            v = v + filtered_value(d, student_z, teacher_z, mask=m, chunk_size=self.cfg.estimator.chunk_size).to(v.dtype)
        return v

    def _on_policy(self, student_z, scores: TeacherScores, y, m, s, t, cost_s=None):
        """The registered estimator's terms (``training/estimators.py``): one call, no name test."""
        est = self.estimator(StepInputs(self, student_z, scores, y, m, s, t, cost_s))
        return est.per_token, est.advantages, est.clipped, est.exact, est.per_position
