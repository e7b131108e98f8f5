"""The exact filtered-mass term: what a sampled token cannot see under top-k / top-p.

With a filtered sampling distribution S (entries outside the top-k / top-p set have S = 0),
a token y ~ S only ever lands inside the support, so the importance-weighted value
phi(y) / S(y) estimates the sum over the support alone:

    D = sum_{v: S_v > 0} phi(s_v, t_v) + F,    F = sum_{v: S_v = 0} phi(-inf, t_v).

F is a function of the teacher's log-probs and the filter mask only (both at hand), so it is
added exactly: ``token_value(y) + F`` is unbiased for D again (each divergence says what an
entry outside the support adds, ``Divergence.outside_value``). F is 0 for divergences whose
phi vanishes where S = 0 (rkl, srkl) and for tvd (its one-sided value (1 - r)_+ already sums
to the whole TVD); -beta*log(beta) * T(filtered) for jsd, -log(alpha) * T(filtered) for skl,
and +inf for fkl wherever the teacher puts mass on a filtered entry (KL(T||S) is infinite:
the trainer refuses fkl with a filter).
F does not depend on the student's logits inside the support, so it adds nothing to the
gradient: only values (metrics, sequence credit) need it.

The top-k estimator's tail estimates with phi(y) / S(y) itself (``pointwise_over_prob``), not
with ``token_value``: what it cannot see is phi(-inf, t_v) on every filtered entry outside the
teacher's top-k, for every divergence (``pointwise=True``). For tvd that is 0.5 * T_v, not the
0 that completes its one-sided ``token_value``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .full import _compute_dtype, default_chunk_size

if TYPE_CHECKING:
    from .catalog import Divergence


def outside_support(student_logits: torch.Tensor) -> torch.Tensor:
    """Where the student's sampling distribution is exactly 0 (filtered out, or underflowed)."""
    z = student_logits.detach()
    return torch.softmax(z.to(_compute_dtype(z.dtype)), dim=-1) == 0


@torch.no_grad()
def filtered_value(
    div: Divergence,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    exclude_ids: torch.Tensor | None = None,
    pointwise: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """F per position, ``[..., V] -> [...]``: sum of ``outside_value(t_v)`` over the entries where the
    student's (filtered) distribution is 0; no gradient. ``exclude_ids`` ``[..., k]``: entries
    left out of the sum (the top-k estimator computes them exactly already). ``pointwise``: sum
    phi(-inf, t_v) instead, the complement of a ``pointwise_over_prob`` estimate (the top-k tail).
    Positions where ``mask`` is false give 0. Works a chunk of rows at a time."""
    lead, V = student_logits.shape[:-1], student_logits.shape[-1]
    zs = student_logits.detach().reshape(-1, V)
    zt = teacher_logits.detach().reshape(-1, V)
    ex = None if exclude_ids is None else exclude_ids.reshape(-1, exclude_ids.shape[-1])
    dtype = _compute_dtype(zs.dtype)
    out = torch.zeros(zs.shape[0], dtype=dtype, device=zs.device)
    rows = torch.arange(zs.shape[0], device=zs.device) if mask is None else mask.reshape(-1).bool().nonzero().squeeze(-1)
    chunk = chunk_size or default_chunk_size(V)
    for start in range(0, rows.numel(), chunk):
        idx = rows[start : start + chunk]
        outside = torch.softmax(zs.index_select(0, idx).to(dtype), dim=-1) == 0
        if ex is not None:
            outside.scatter_(-1, ex[idx], False)
        if not outside.any():
            continue
        t = torch.log_softmax(zt.index_select(0, idx).to(dtype), dim=-1)
        phi = div.pointwise(torch.full_like(t, float("-inf")), t) if pointwise else div.outside_value(t)
        out[idx] = torch.where(outside, phi, torch.zeros((), dtype=dtype, device=phi.device)).sum(-1)
    return out.reshape(lead)
