"""Control-variate baselines for the sampled estimator: b per position, subtracted from the cost.

The sampled estimator's gradient at a position is c(y) grad log S(y), y ~ S. For any b that
is a function of the two distributions at the position only (so of the prefix, never of the
sampled y) and carries no gradient,

    E_y[(c(y) - b) grad log S(y)] = E_y[c(y) grad log S(y)] - b * sum_v grad S_v = grad D,

because sum_v S_v = 1 has zero gradient. So subtracting b leaves the expected gradient exactly
as it was and changes only its variance. The baseline used by default (``weighted=True``) is the
cost averaged under the student with weights w_v = |e_v - S|^2, the squared norm of the score
grad_z log S(v) (the variance-optimal constant for the score's squared norm),

    b = sum_v S_v w_v c(s_v, t_v) / sum_v S_v w_v,

and with ``weighted=False`` the plain expected cost b = E_{y~S}[c(y)] = sum_v S_v c(s_v, t_v), the
classic value baseline (for rkl, c = s - t, it is KL(S || T) = D itself; for fkl, c = -T/S, it is
-T(supp S), -1 without a sampling filter; for jsd (1 - beta) KL(S || M)). Either centres the
advantage (a cost above b pushes its token down, a cost below it up), where without one every
sampled token of a positive-cost divergence is pushed down and only the sizes differ.

* ``expected_cost``: exact, from the teacher's whole distribution (an in-process teacher).
* ``topk_expected_cost``: from the teacher's top-k only (a served teacher works too): exact over
  the top-k set K, and over the tail the teacher's remaining mass T(K^c) = 1 - sum_K T_v spread
  evenly over the V - k tail entries (``tail_fill``: log T(K^c) - log(V - k) each, never above the
  smallest top-k log-prob). It reads neither y nor
  the teacher's log-prob of y: a baseline b(y) that did (a tail term [y not in K] c(y), as the
  unbiased top-k value has) would add E_y[b(y) grad log S(y)] = sum_{v not in K} S_v c_v grad log S_v
  != 0 to the gradient, and undoing that needs every tail entry's teacher log-prob, which is
  what a top-k teacher does not send. Its tail guess may be off; that costs variance, not bias.

* ``leave_one_out``: from the prompt's OTHER samples. Per position (token credit, gamma < 1): the mean
  of their returns at t (over those that have a token there; 0 where none does). With undiscounted
  sequence credit, RLOO: each row's advantage is (c_t - v_t) + V_i - mean_{j != i} V_j, V a row's
  sum of one-sample values v (for rkl v = c, so it is C_i - mean C_j, the sequence costs), i.e.
  b_t = mean_{j != i} V_j - sum_{t' < t} v_t'. Either reads other samples and the row's prefix only,
  so E[b grad log S(y_t)] = 0 for any teacher, one that scores only the sampled tokens (another
  tokenizer) included. It removes what the samples of a prompt share: the ~+30 nats a 24-token
  row's reverse-KL return carries, which without a baseline pushes down every sampled sequence alike.

A position whose baseline is not finite (a teacher log-prob of -inf where the student has mass:
D itself is infinite there) gets b = 0, which is the same unbiased choice made from the
position's distributions alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .catalog import Divergence

# ~32 MiB of fp32 per [chunk, V] buffer, as the full-vocabulary divergence.
_CHUNK_ELEMENTS = 1 << 23


def _rows(logits: torch.Tensor) -> tuple[torch.Size, torch.Tensor, int]:
    lead, V = logits.shape[:-1], logits.shape[-1]
    return lead, logits.detach().reshape(-1, V), max(1, _CHUNK_ELEMENTS // max(V, 1))


def _dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32  # fp32 at least


def weighted_cost(div: Divergence, s: torch.Tensor, t: torch.Tensor, weighted: bool = True) -> torch.Tensor:
    """b per row of log-probs ``s``, ``t`` ``[n, V]``: sum_v S_v w_v c_v / sum_v S_v w_v over the
    entries with S_v > 0; w_v = |e_v - S|^2 (``weighted``) or 1 (the plain mean E_S[c]).
    Rows with no spread (S one-hot: sum S w = 0, and grad log S = 0 there) take the plain mean."""
    S = s.exp()
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    on = S > 0
    c = torch.where(on, div.token_cost(s, t), zero)  # S = 0: never drawn (0 * inf would be NaN)
    mean = (S * c).sum(-1)
    if not weighted:
        return mean
    q = (S * S).sum(-1, keepdim=True)
    sw = S * (1.0 - 2.0 * S + q)  # S_v |e_v - S|^2 >= 0
    den = sw.sum(-1)  # = 1 - |S|^2
    spread = den > 64 * torch.finfo(s.dtype).eps
    return torch.where(spread, (sw * c).sum(-1) / torch.where(spread, den, 1.0), mean)


def _finite_or_zero(b: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(b), b, torch.zeros((), dtype=b.dtype, device=b.device))


@torch.no_grad()
def expected_cost(div: Divergence, student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, weighted: bool = True) -> torch.Tensor:
    """b per position from the teacher's whole distribution: ``[..., V] x [..., V] -> [...]``.

    The student's logits are its sampling distribution's (tempered, filtered: -inf or -1e9 where a
    token cannot be drawn), the teacher's tempered; both detached, computed a chunk of rows at a time."""
    lead, zs, chunk = _rows(student_logits)
    zt = teacher_logits.detach().reshape(zs.shape)
    dtype = _dtype(zs)
    out = torch.empty(zs.shape[0], dtype=dtype, device=zs.device)
    for a in range(0, zs.shape[0], chunk):
        s = torch.log_softmax(zs[a : a + chunk].to(dtype), -1)
        t = torch.log_softmax(zt[a : a + chunk].to(dtype), -1)
        out[a : a + chunk] = weighted_cost(div, s, t, weighted)
    return _finite_or_zero(out).reshape(lead)


@torch.no_grad()
def topk_expected_cost(
    div: Divergence,
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    *,
    weighted: bool = True,
) -> torch.Tensor:
    """b per position from the teacher's top-k: its log-probs on its top-k set K (normalised over
    its whole vocabulary), every tail entry filled with ``tail_fill``.
    ``[..., V]``, ``[..., k]``, ``[..., k]`` -> ``[...]``."""
    lead, zs, chunk = _rows(student_logits)
    k = teacher_topk_ids.shape[-1]
    ids = teacher_topk_ids.reshape(-1, k)
    t_k_all = teacher_topk_logprobs.detach().reshape(-1, k)
    dtype = _dtype(zs)
    out = torch.empty(zs.shape[0], dtype=dtype, device=zs.device)
    for a in range(0, zs.shape[0], chunk):
        s = torch.log_softmax(zs[a : a + chunk].to(dtype), -1)
        idx, t_k = ids[a : a + chunk], t_k_all[a : a + chunk]
        fill = tail_fill(t_k, s.shape[-1]).to(dtype)
        t = fill.expand_as(s).scatter(-1, idx, t_k.to(dtype))  # log T: known on K, filled on the tail
        out[a : a + chunk] = weighted_cost(div, s, t, weighted)
    return _finite_or_zero(out).reshape(lead)


def tail_fill(topk_logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[n, 1]`` the log-prob given to each of the V - k entries outside the teacher's top-k:
    its remaining mass T(K^c) = 1 - sum_K T spread evenly, never above the smallest top-k log-prob
    (no tail entry is), and T(K^c) never taken below k * eps of the log-probs' dtype (the rounding
    of the top-k sum: a tail mass below it is not known, and 0 would put every tail entry at -inf)."""
    k = topk_logprobs.shape[-1]
    floor = k * torch.finfo(topk_logprobs.dtype).eps
    t_k = topk_logprobs.double()
    tail_mass = (-torch.expm1(torch.logsumexp(t_k, -1, keepdim=True))).clamp_min(floor)
    return torch.minimum(t_k.amin(-1, keepdim=True), tail_mass.log() - math.log(max(vocab_size - k, 1)))


def _group_sum(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each row's group total of ``x`` ``[N, ...]`` (groups of ``group_size`` consecutive rows), on every row."""
    shape = x.shape
    return x.reshape(-1, group_size, *shape[1:]).sum(1, keepdim=True).expand(-1, group_size, *shape[1:]).reshape(shape)


@torch.no_grad()
def leave_one_out(returns: torch.Tensor, mask: torch.Tensor, group_size: int, *, whole_row: bool = False) -> torch.Tensor:
    """b ``[N, R]`` from the other rows of each group of ``group_size`` consecutive rows (a prompt's
    samples, prompt-major), never from the row itself:

    * ``whole_row=False``: per position, the mean of the others' ``returns`` there (over those with a
      position inside ``mask``; 0 where none has, and outside the row's own mask);
    * ``whole_row=True``: b_t = R_t - (R_first - mean of the others' R_first), R_first a row's return
      at its first masked position (its whole sum C), so R_t - b_t = C_i - mean_{j != i} C_j at every
      position (RLOO). ``returns`` must then be undiscounted sums to go of values that never read a
      later token (R_first - R_t = the row's sum BEFORE t, a function of its prefix), so b_t never
      reads y_t; a shared cost cancels exactly, whatever the rows' lengths. 0 for a row whose group
      has no other trained row."""
    N = returns.shape[0]
    if group_size < 2 or N % group_size:
        raise ValueError(
            f"leave_one_out: {N} rows are not whole groups of rollout.n_samples={group_size} (a prompt's samples share one "
            "micro-batch, in order)"
        )
    on = mask.bool()
    zero = torch.zeros((), dtype=returns.dtype, device=returns.device)
    r = torch.where(on, returns.detach(), zero)
    if not whole_row:
        others = _group_sum(on.to(r.dtype), group_size) - on.to(r.dtype)
        return torch.where(on & (others > 0), (_group_sum(r, group_size) - r) / others.clamp(min=1), zero)
    has = on.any(-1)
    first = r.gather(1, on.to(torch.int8).argmax(-1, keepdim=True)).squeeze(1)  # 0 for a row without a trained token
    others = _group_sum(has.to(r.dtype), group_size) - has.to(r.dtype)
    mean_others = (_group_sum(first, group_size) - first) / others.clamp(min=1)
    # a row whose group has no other trained row gets no baseline (b = 0), as per position
    return torch.where(on & (others > 0)[:, None], r - (first - mean_others)[:, None], zero)
