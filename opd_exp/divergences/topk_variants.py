"""The top-k estimators the field uses, each unbiased (proved by enumeration) or labelled biased.

Every one sums phi(s_v, t_v) over a set K of vocabulary entries exactly; they differ in the set
and in what they do about the rest (the tail):

* ``set_estimate``: exact over any set K that does not depend on the sampled token, plus the
  importance-weighted tail of ``topk_estimate`` from y ~ S. Unbiased in value and gradient:

      value     = sum_K phi + [y not in K] * phi(y) / S(y)
      surrogate = sum_K phi + stopgrad([y not in K] * score(y)) * log S(y)

  E_y[value] = sum_K phi + sum_{not K} phi = D, and E_y[grad surrogate] = grad_z sum_K phi +
  sum_{v not in K} (d phi / d S_v) grad_z S_v = grad_z D with K held fixed. D = sum_v phi_v for
  every partition, so its gradient with K held fixed is grad D itself.
* ``student_topk_estimate``: K = the student's top-k. K is a function of the student's logits,
  but a piecewise constant one (it changes only where two logits tie, a set of measure zero), so
  its derivative is zero almost everywhere and the argument above holds at every z: the set is
  never differentiated (integer ids), only the log-probs gathered on it. Unbiased. Needs the
  teacher's log-probs on the student's ids (a dense teacher, or one that scores given ids).
* ``union_topk_estimate``: K = the student's top-k united with the teacher's top-k (each entry
  once). Unbiased, as above.
* ``generalized_kl_topk`` (ms-swift MOPD): sum over the teacher's top-k of the generalised KL
  p log(p/q) - p + q of the unnormalised masses, no tail. It equals KL - G_tail, G_tail = the
  same sum over the entries outside K; every term is >= 0, so it is biased low by exactly
  G_tail (0 only where S = T on the whole tail), its gradient by -grad G_tail. KL only.
* ``verl_topk`` (the ``*_topk`` losses of verl PR #5041's draft, never released): phi over the
  union of both top-k sets with log-probs floored at log(eps), no tail, the per-token loss
  clamped at 0. Biased: where no floor or clamp acts its bias is -sum_{v not in K} phi_v; where
  the clamp acts the value is 0 and the gradient vanishes (``clamped``, for
  ``estimator/clamp_rate``). It is NOT verl v0.8.0's released ``forward_kl_topk`` (below).

Each returns a ``TopkEstimate`` with the truncation diagnostics T(K) and S(K) per position.
``TOPK_ESTIMATORS`` lists them (with ``topk`` and ``topk_renorm`` of ``topk.py``) under one
dense-teacher call, the form ``check_topk_estimators`` enumerates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .topk import topk_estimate

if TYPE_CHECKING:
    from .catalog import Divergence


@dataclass(frozen=True)
class TopkEstimate:
    """One top-k estimator's output per position ``[...]``."""

    surrogate: torch.Tensor  # differentiable; its gradient is the estimator's (minimise it)
    value: torch.Tensor  # detached estimate of D
    teacher_mass: torch.Tensor  # T(K): the teacher's mass inside the summed set
    student_mass: torch.Tensor  # S(K): the student's mass inside the summed set (detached)
    clamped: torch.Tensor  # bool: a loss clamp changed the value (verl_topk); False elsewhere


def _tempered(student_logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, logsumexp z): log S on any ids is z.gather(ids) - lse, without a [..., V] log-softmax."""
    z = student_logits.float() if student_logits.dtype in (torch.float16, torch.bfloat16) else student_logits
    if temperature != 1.0:
        z = z / temperature
    return z, torch.logsumexp(z, dim=-1, keepdim=True)


def _masked_sum(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if valid is not None:
        x = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum(-1)


def _masses(s_k: torch.Tensor, t_k: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _masked_sum(t_k.detach().exp(), valid), _masked_sum(s_k.detach().exp(), valid)


def _gather(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return x.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def student_topk_ids(student_logits: torch.Tensor, k: int) -> torch.Tensor:
    """The student's top-k ids ``[..., k]`` (a temperature does not change the order); no gradient."""
    return student_logits.detach().topk(k, dim=-1).indices


def union_ids(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids ``[..., k1 + k2]``, valid): both id sets side by side; ``valid`` is False on the entries
    of ``second`` already in ``first``, so each id of the union counts once."""
    dup = (second.unsqueeze(-1) == first.unsqueeze(-2)).any(-1)
    return torch.cat([first, second], -1), torch.cat([torch.ones_like(first, dtype=torch.bool), ~dup], -1)


def truncation_masses(
    student_logits: torch.Tensor,
    set_ids: torch.Tensor,
    teacher_set_logprobs: torch.Tensor,
    *,
    set_valid: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T(K), S(K)) per position: how much of each distribution the set K sums exactly."""
    z, lse = _tempered(student_logits.detach(), temperature)
    return _masses(z.gather(-1, set_ids) - lse, teacher_set_logprobs, set_valid)


def set_estimate(
    div: Divergence,
    student_logits: torch.Tensor,
    set_ids: torch.Tensor,
    teacher_set_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    teacher_sampled_logprobs: torch.Tensor,
    *,
    set_valid: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> TopkEstimate:
    """Exact over the set K = ``set_ids`` (entries where ``set_valid`` is False left out), plus the
    sampled tail; unbiased in value and gradient for any K chosen without looking at y.

    Args:
        student_logits: ``[..., V]`` raw student logits (differentiable).
        set_ids: ``[..., m]`` the ids summed exactly.
        teacher_set_logprobs: ``[..., m]`` teacher log-probs (normalised over the full, tempered
            vocabulary) on ``set_ids``.
        sampled_ids: ``[...]`` the token y drawn from the student.
        teacher_sampled_logprobs: ``[...]`` teacher log-prob of y.
        temperature: divides the student logits (the teacher's are tempered by the caller).
    """
    z, lse = _tempered(student_logits, temperature)
    s_k = z.gather(-1, set_ids) - lse
    t_k = teacher_set_logprobs.to(s_k.dtype)
    head = _masked_sum(div.pointwise(s_k, t_k), set_valid)
    s_y = _gather(z, sampled_ids) - lse.squeeze(-1)
    t_y = teacher_sampled_logprobs.to(s_y.dtype)
    # a left-out duplicate has the same id as a kept entry, so membership needs no mask
    in_tail = ~(set_ids == sampled_ids.unsqueeze(-1)).any(-1)
    zero = torch.zeros((), dtype=s_y.dtype, device=s_y.device)
    score = torch.where(in_tail, div.token_score(s_y.detach(), t_y), zero)
    tail_value = torch.where(in_tail, div.pointwise_over_prob(s_y.detach(), t_y), zero)
    teacher_mass, student_mass = _masses(s_k, t_k, set_valid)
    return TopkEstimate(
        surrogate=head + score * s_y,
        value=head.detach() + tail_value,
        teacher_mass=teacher_mass,
        student_mass=student_mass,
        clamped=torch.zeros_like(in_tail),
    )


def teacher_topk_estimate(
    div: Divergence,
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    sampled_ids: torch.Tensor,
    teacher_sampled_logprobs: torch.Tensor,
    *,
    temperature: float = 1.0,
    renormalize: bool = False,
) -> TopkEstimate:
    """``topk_estimate`` (the teacher's top-k; ``renormalize``: the biased ``topk_renorm``) with
    its truncation diagnostics; surrogate and value are exactly ``topk_estimate``'s."""
    surrogate, value = topk_estimate(
        div,
        student_logits,
        teacher_topk_logprobs,
        teacher_topk_ids,
        sampled_ids,
        teacher_sampled_logprobs,
        temperature=temperature,
        renormalize=renormalize,
    )
    teacher_mass, student_mass = truncation_masses(student_logits, teacher_topk_ids, teacher_topk_logprobs, temperature=temperature)
    return TopkEstimate(surrogate, value, teacher_mass, student_mass, torch.zeros(value.shape, dtype=torch.bool, device=value.device))


def student_topk_estimate(
    div: Divergence,
    student_logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    *,
    k: int,
    temperature: float = 1.0,
) -> TopkEstimate:
    """Exact over the student's top-k, sampled tail (NeMo-RL 3584, verl 7590/7806 argue for this
    set). Unbiased at every k. ``teacher_logprobs`` ``[..., V]``: the teacher's (tempered,
    normalised) log-probs; with a teacher that scores given ids instead, call ``set_estimate``
    with ``student_topk_ids``."""
    return _dense_set_estimate(div, student_logits, teacher_logprobs, student_topk_ids(student_logits, k), sampled_ids, temperature)


def union_topk_estimate(
    div: Divergence,
    student_logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    sampled_ids: torch.Tensor,
    *,
    k: int,
    temperature: float = 1.0,
) -> TopkEstimate:
    """Exact over the union of the student's and the teacher's top-k (verl's set), sampled tail.
    Unbiased at every k."""
    ids, valid = union_ids(teacher_logprobs.detach().topk(k, dim=-1).indices, student_topk_ids(student_logits, k))
    return _dense_set_estimate(div, student_logits, teacher_logprobs, ids, sampled_ids, temperature, valid)


def _dense_set_estimate(div, student_logits, teacher_logprobs, ids, sampled_ids, temperature, set_valid=None) -> TopkEstimate:
    """``set_estimate`` over ``ids`` with the teacher's log-probs read off its dense ``[..., V]`` row."""
    t_set, t_y = teacher_logprobs.gather(-1, ids), _gather(teacher_logprobs, sampled_ids)
    return set_estimate(div, student_logits, ids, t_set, sampled_ids, t_y, set_valid=set_valid, temperature=temperature)


def _kl_direction(div: Divergence) -> str:
    from .catalog import ForwardKL, JensenShannon, ReverseKL

    d = div._endpoint if isinstance(div, JensenShannon) and div._endpoint is not None else div
    if isinstance(d, ReverseKL):
        return "reverse"
    if isinstance(d, ForwardKL):
        return "forward"
    raise ValueError(f"generalized_kl_topk: divergence={div!r} is not a KL; allowed: rkl, fkl (or jsd with beta 0 or 1)")


def generalized_kl_topk(
    div: Divergence,
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> TopkEstimate:
    """ms-swift MOPD: sum over the teacher's top-k of p log(p/q) - p + q, p and q the unnormalised
    masses (p = S, q = T for rkl; p = T, q = S for fkl); a direct loss (surrogate = value).

    BIASED, low: it equals KL - G_tail with G_tail = sum_{v not in K} [p log(p/q) - p + q] >= 0
    (the full KL is that sum over the whole vocabulary, since sum_v (q - p) = 0)."""
    sign = 1.0 if _kl_direction(div) == "reverse" else -1.0
    z, lse = _tempered(student_logits, temperature)
    s_k = z.gather(-1, teacher_topk_ids) - lse
    t_k = teacher_topk_logprobs.to(s_k.dtype)
    # generalised KL term: the KL's own term plus q - p (q - p = T - S for rkl, S - T for fkl)
    value = (div.pointwise(s_k, t_k) + sign * (t_k.exp() - s_k.exp())).sum(-1)
    teacher_mass, student_mass = _masses(s_k, t_k, None)
    return TopkEstimate(value, value.detach(), teacher_mass, student_mass, torch.zeros(value.shape, dtype=torch.bool, device=value.device))


def verl_topk(
    div: Divergence,
    student_logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    k: int,
    temperature: float = 1.0,
    eps: float = 1e-8,
    loss_clamp: float | None = None,
) -> TopkEstimate:
    """The ``forward_kl_topk`` / ``reverse_kl_topk`` / ``jsd_topk`` of verl PR #5041's draft
    (volcengine/verl commit 3baac345, ``verl/trainer/distillation/losses.py``; never in a release)
    as a peer baseline: phi over the union of the student's and the teacher's top-k (each id
    once), both full-vocabulary log-probs floored at log(eps), no tail; the per-token loss capped
    at ``loss_clamp`` (that draft's ``loss_clamp``, off by default) and clamped at 0. A direct loss
    (surrogate = value). The tests replay that draft's code exactly (``verl_reference``).

    NOT verl's released loss: verl v0.8.0 (the first release with distillation; v0.9.0 alike) has
    ``forward_kl_topk`` only, summed over the TEACHER's top-k alone, log-probs floored at
    ``log_prob_min_clamp=-10``, clamped at 0 and to +-``loss_max_clamp=10``. On the 27 forward-KL
    cases of ``tests/test_topk_variants.py`` (9 logit pairs x k = 1, 2, 3; 99 positions) this
    function differs from it on 21 cases (57 positions), by up to 4.63 nats (0.68 on the 8 random
    pairs; docs/divergences.md).

    BIASED: the tail's share of D is missing (bias -sum_{v not in K} phi_v where the floor and the
    clamps are inactive); where the truncated sum is negative the clamp sets it, and its gradient,
    to 0 (``clamped``; verl 7855 measured it active in 89% of steps)."""
    ids, valid = union_ids(teacher_logprobs.detach().topk(k, dim=-1).indices, student_topk_ids(student_logits, k))
    z, lse = _tempered(student_logits, temperature)
    s_k = z.gather(-1, ids) - lse
    t_k = teacher_logprobs.gather(-1, ids).to(s_k.dtype)
    floor = math.log(eps)
    raw = _masked_sum(div.pointwise(s_k.clamp(min=floor), t_k.clamp(min=floor)), valid)
    loss = raw if loss_clamp is None else raw.clamp(max=loss_clamp)
    clamped = loss < 0 if loss_clamp is None else (loss < 0) | (raw > loss_clamp)
    loss = loss.clamp(min=0.0)
    teacher_mass, student_mass = _masses(s_k, t_k, valid)
    return TopkEstimate(loss, loss.detach(), teacher_mass, student_mass, clamped)


# -- one dense-teacher call for every top-k estimator ----------------------------

DenseEstimate = Callable[..., TopkEstimate]  # (div, student_logits, teacher_logprobs, sampled_ids, *, k, temperature)


def _dense_teacher_topk(renormalize: bool) -> DenseEstimate:
    def estimate(div, student_logits, teacher_logprobs, sampled_ids, *, k, temperature=1.0):
        t_k, ids = teacher_logprobs.topk(k, dim=-1)
        return teacher_topk_estimate(
            div,
            student_logits,
            t_k,
            ids,
            sampled_ids,
            _gather(teacher_logprobs, sampled_ids),
            temperature=temperature,
            renormalize=renormalize,
        )

    return estimate


def _dense_generalized_kl(div, student_logits, teacher_logprobs, sampled_ids, *, k, temperature=1.0):
    t_k, ids = teacher_logprobs.topk(k, dim=-1)
    return generalized_kl_topk(div, student_logits, t_k, ids, temperature=temperature)


def _dense_verl(div, student_logits, teacher_logprobs, sampled_ids, *, k, temperature=1.0):
    return verl_topk(div, student_logits, teacher_logprobs, k=k, temperature=temperature)


@dataclass(frozen=True)
class TopkEstimator:
    """A registered top-k estimator: what it sums, whether it is unbiased, whom it matches."""

    name: str
    summed: str  # the set K summed exactly, and what happens to the rest
    unbiased: bool  # value and gradient (tested by enumeration; check_topk_estimators)
    peer: str
    estimate: DenseEstimate  # (div, student_logits, teacher_logprobs [..., V], sampled_ids, *, k, temperature)
    sparse_teacher: bool  # works from the teacher's top-k and sampled-token log-probs alone


TOPK_ESTIMATORS: dict[str, TopkEstimator] = {
    e.name: e
    for e in (
        TopkEstimator("topk", "teacher's top-k + sampled tail", True, "opd-exp", _dense_teacher_topk(False), True),
        TopkEstimator(
            "topk_student",
            "student's top-k + sampled tail",
            True,
            "NeMo-RL 3584, verl 7590/7806 (with a tail)",
            student_topk_estimate,
            False,
        ),
        TopkEstimator(
            "topk_union", "student's and teacher's top-k + sampled tail", True, "verl's set, with a tail", union_topk_estimate, False
        ),
        TopkEstimator(
            "topk_renorm",
            "teacher's top-k, both renormalised there",
            False,
            "ms-swift gkd_logits_topk, NeMo-RL",
            _dense_teacher_topk(True),
            True,
        ),
        TopkEstimator(
            "topk_generalized_kl",
            "teacher's top-k, p log(p/q) - p + q unnormalised",
            False,
            "ms-swift MOPD (10079)",
            _dense_generalized_kl,
            True,
        ),
        TopkEstimator(
            "topk_verl",
            "student's and teacher's top-k, log-probs floored at 1e-8, loss clamped at 0",
            False,
            "verl PR #5041 draft *_topk (unreleased; not v0.8.0's forward_kl_topk)",
            _dense_verl,
            False,
        ),
    )
}


def topk_estimator(name: str) -> TopkEstimator:
    if name not in TOPK_ESTIMATORS:
        raise ValueError(f"unknown top-k estimator {name!r}; allowed: {', '.join(TOPK_ESTIMATORS)}")
    return TOPK_ESTIMATORS[name]
