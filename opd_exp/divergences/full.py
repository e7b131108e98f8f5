"""Exact full-vocabulary divergence with a chunked, memory-lean backward.

D per position needs log-softmax of both logit tensors, the mixture, and elementwise terms:
autograd would keep several [N, V] intermediates alive until backward (B*T*V floats each:
1.2 GiB at B*T=2048, V=151936). Here the forward keeps only the inputs (which exist anyway)
and per-row log-normalisers; the backward recomputes one chunk of rows at a time and writes
that chunk of the gradient straight into the gradient tensor. Extra peak memory is a few
[chunk, V] buffers, independent of B*T.

Gradient: with s = log_softmax(z / tau) and G_v = d phi(s_v, t_v) / d s_v,
    dD/dz_u = (G_u - S_u * sum_v G_v) / tau.

Values near convergence: s and t normalised apart each carry the fp32 rounding of an entropy-sized
normaliser (~1e-6 at V=32000), and a value formed from them is off by that much even when D is
1e-9. The forward instead forms log T/S from the difference of the logits (``log_ratio``) and
evaluates D as sum_v S_v f(T_v / S_v) with f(1) = f'(1) = 0 (``Divergence.rows_value_close``),
every term second order in delta: fp32 values within ~1e-9 of float64 there. Rows where the
ratio cannot be formed (an entry with zero mass on one side: filtered or -inf logits) take
``rows_value(s, t)``. The backward needs no such care (gradients carry no cancellation), except
where d phi / d s jumps at s = t (tvd: sign(s - t), ``Divergence.grad_jumps_at_equality``): the
entries whose s - t is within fp32 rounding of 0 take float64's side (``_settle_ties``), so no
sign is decided by rounding.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class Divergence(Protocol):
    """What the chunked exact path needs of a divergence (``catalog.Divergence`` has it): the
    per-row value, its close-pair form, the per-row gradient, and whether d phi / d s jumps at
    s = t. A protocol, so this module does not import the catalog that imports it."""

    grad_jumps_at_equality: bool

    def rows_value(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor: ...

    def rows_value_close(self, S: torch.Tensor, delta: torch.Tensor, u: torch.Tensor) -> torch.Tensor: ...

    def rows_grad(self, s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


# ~32 MiB of fp32 per [chunk, V] buffer; a handful of them live at once.
_CHUNK_ELEMENTS = 1 << 23


def default_chunk_size(vocab_size: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(vocab_size, 1))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision logits are upcast per chunk: log-space differences need fp32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tempered(logits: torch.Tensor, tau: float, dtype: torch.dtype) -> torch.Tensor:
    z = logits.to(dtype)
    return z / tau if tau != 1.0 else z


def _log_probs(logits: torch.Tensor, tau: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.log_softmax(_tempered(logits, tau, dtype), dim=-1)


# Largest |log T/S| formed from logit differences: beyond it an entry whose S underflows to 0
# could still carry teacher mass, and T/S = 1 + u (u ~ -1 to rounding) would lose its digits
# against a large log T/S (filtered or -inf logits are far beyond it).
_LOG_RATIO_LIMIT = 60.0


def log_ratio(S: torch.Tensor, zs: torch.Tensor, zt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(delta, u, close) for a chunk: delta = log T/S and u = T/S - 1 per entry ``[n, V]``, formed
    from the (tempered) logits' difference, and the rows ``[n]`` where they are formed (elsewhere
    they are meaningless). Overwrites nothing it is given.

    log T/S = d - c with d = zt - zs and c = log sum_v S_v e^(d_v): no normaliser is subtracted
    apart, and c is a log1p of a small sum when the two are close. c is taken against sum_v S_v
    (1 up to rounding), so that sum_v S_v u_v = 0 to rounding, which the second-order forms of
    ``rows_value_close`` rely on."""
    # each relative to its value at the student's mode: e^d stays in range, and logits with a large
    # offset (teacher ~500, student ~2) are not differenced before the offset is gone
    mode = S.argmax(-1, keepdim=True)
    d = (zt - zt.gather(-1, mode)).sub_(zs).add_(zs.gather(-1, mode))
    u = torch.expm1(d)
    gamma = (torch.linalg.vecdot(S, u) / S.sum(-1)).unsqueeze(-1)  # e^c - 1
    c = torch.log1p(gamma)
    low, high = d.amin(-1, keepdim=True), d.amax(-1, keepdim=True)  # (aminmax is 10x slower on CPU)
    close = (torch.isfinite(c) & (high - c < _LOG_RATIO_LIMIT) & (low - c > -_LOG_RATIO_LIMIT)).squeeze(-1)
    return d.sub_(c), u.sub_(gamma).div_(gamma + 1.0), close  # expm1(d - c) = (e^d - 1 - gamma) / (1 + gamma)


def chunk_value(div: Divergence, S: torch.Tensor, ratio: tuple[torch.Tensor, torch.Tensor, torch.Tensor], far_log_probs) -> torch.Tensor:
    """D per row of a chunk: ``rows_value_close(S, delta, u)`` on the rows where ``ratio`` (what
    ``log_ratio`` returns) is formed, ``rows_value(s, t)`` on the others with ``(s, t) =
    far_log_probs(rows)``, their log-probs normalised apart (new tensors: rows_value may
    overwrite them)."""
    delta, u, close = ratio
    if bool(close.all()):
        return div.rows_value_close(S, delta, u)
    out = torch.empty(S.shape[0], dtype=S.dtype, device=S.device)
    if bool(close.any()):
        out[close] = div.rows_value_close(S[close], delta[close], u[close])
    far = ~close
    out[far] = div.rows_value(*far_log_probs(far))
    return out


def _settle_ties(s: torch.Tensor, t: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor, tau: float) -> None:
    """Where s - t is within the rounding of the two log-softmaxes of 0, set t (in place) to the
    float next to s on the side float64 puts it (or to s where float64 has them equal), so a
    gradient that jumps at s = t takes float64's side. log_softmax rounds s_v by a few ulps of
    max(|s_v|, log V); 8 ulps of |s_v| + |t_v| + 2 log V bound the error of s_v - t_v. float64
    needs only the affected rows' normalisers (and a subtraction)."""
    slack = 8 * torch.finfo(s.dtype).eps
    near = (s - t).abs_() < (s.abs() + t.abs()).add_(2 * math.log(s.shape[-1])).mul_(slack)  # never at -inf
    rows = near.any(-1).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return
    zs, zt = _tempered(student[rows], tau, torch.float64), _tempered(teacher[rows], tau, torch.float64)
    c = torch.logsumexp(zs, -1, keepdim=True) - torch.logsumexp(zt, -1, keepdim=True)
    side = zs.sub_(zt).sub_(c).sign_().to(s.dtype)  # sign(s - t) in float64
    del zs, zt
    at = s[rows]
    t[rows] = torch.where(near[rows], torch.nextafter(at, at - side), t[rows])  # s - t of float64's sign


class _FullDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, rows, div, tau, chunk):
        # student, teacher: [N, V]; rows: 1-D LongTensor of the positions to compute.
        dtype = _compute_dtype(student.dtype)
        out = torch.zeros(student.shape[0], dtype=dtype, device=student.device)
        for start in range(0, rows.numel(), chunk):
            idx = rows[start : start + chunk]
            zs = _tempered(student.index_select(0, idx), tau, dtype)
            zt = _tempered(teacher.index_select(0, idx), tau, dtype)
            s = torch.log_softmax(zs, dim=-1)
            S = s.exp()
            ratio = log_ratio(S, zs, zt)
            out[idx] = chunk_value(div, S, ratio, lambda far, s=s, zt=zt: (s[far], torch.log_softmax(zt[far], dim=-1)))
            del zs, zt, s, S, ratio
        ctx.save_for_backward(student, teacher, rows)
        ctx.div, ctx.tau, ctx.chunk = div, tau, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        student, teacher, rows = ctx.saved_tensors
        div, tau, chunk = ctx.div, ctx.tau, ctx.chunk
        dtype = _compute_dtype(student.dtype)
        grad = torch.zeros_like(student)
        for start in range(0, rows.numel(), chunk):
            idx = rows[start : start + chunk]
            s = _log_probs(student.index_select(0, idx), tau, dtype)
            t = _log_probs(teacher.index_select(0, idx), tau, dtype)
            if div.grad_jumps_at_equality and dtype != torch.float64:
                _settle_ties(s, t, student.index_select(0, idx), teacher.index_select(0, idx), tau)
            g, S = div.rows_grad(s, t)
            del s, t
            g.addcmul_(S, g.sum(-1, keepdim=True), value=-1.0)  # G - S * sum(G)
            g.mul_(grad_out[idx].to(dtype).unsqueeze(-1) / tau)
            grad.index_copy_(0, idx, g.to(grad.dtype))
        return grad, None, None, None, None, None


def full_divergence(
    div: Divergence,
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} is out of range; allowed: > 0")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ; slice both to the shared vocabulary first"
        )
    lead, V = student_logits.shape[:-1], student_logits.shape[-1]
    student = student_logits.reshape(-1, V)
    teacher = teacher_logits.detach().reshape(-1, V)
    if mask is None:
        rows = torch.arange(student.shape[0], device=student.device)
    else:
        rows = mask.reshape(-1).bool().nonzero().squeeze(-1)
    chunk = chunk_size or default_chunk_size(V)
    out = _FullDivergence.apply(student, teacher, rows, div, float(temperature), int(chunk))
    return out.reshape(lead)
