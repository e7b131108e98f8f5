"""The per-step monitors in one pass over the vocabulary.

Beside its estimate, every step logs exact quantities of its own rollout: the exact divergences
(``exact/*``), both entropies and the top-k agreement of student and teacher (``overlap/*``).
Each needs log-softmax of both logit tensors over the whole vocabulary; computed one by one they
would take that log-softmax a dozen times per step, which at small models costs more than the
training pass itself. Here each chunk of response positions is normalised once and every
monitor is read off the same buffers, with the same formulas as the standalone definitions
(``full.chunk_value``, ``scoring.entropy``), so the values are those of
``d.full(student_z, teacher_z)`` and friends. Only the masked positions are computed: the
other ones count nowhere.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from opd_exp.divergences.catalog import Divergence
from opd_exp.divergences.full import chunk_value, log_ratio

# Order of the values ``agreement`` returns (per position).
AGREEMENT = ("teacher/entropy", "overlap/teacher_mass", "overlap/student_mass", "overlap/ratio")
# ~32 MiB of fp32 per [chunk, V] buffer, as the full-vocabulary divergence.
_CHUNK_ELEMENTS = 1 << 23


@torch.no_grad()
def step_monitors(
    student_z: torch.Tensor,
    teacher_z: torch.Tensor,
    mask: torch.Tensor,
    *,
    divergences: Mapping[str, Divergence],
    k: int,
    chunk_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per position ``[...]`` (0 outside ``mask``): ``student/entropy``, the ``AGREEMENT``
    values at top-``k`` (``k=0``: only ``teacher/entropy``), and D per position for each
    ``divergences`` entry (name -> divergence).

    ``student_z``/``teacher_z`` are the logits ``[..., V]`` of the distributions compared (the
    student's sampling logits, the teacher's tempered ones); both are normalised in fp32 (fp64
    stays fp64)."""
    lead, V = student_z.shape[:-1], student_z.shape[-1]
    zs, zt = student_z.detach().reshape(-1, V), teacher_z.detach().reshape(-1, V)
    rows = mask.reshape(-1).bool().nonzero().squeeze(-1)
    dtype = torch.float64 if zs.dtype == torch.float64 else torch.float32
    names = ("student/entropy", *(AGREEMENT if k else AGREEMENT[:1]), *divergences)
    out = {n: torch.zeros(zs.shape[0], dtype=dtype, device=zs.device) for n in names}
    k = min(int(k), V)
    chunk = chunk_rows or max(1, _CHUNK_ELEMENTS // max(V, 1))
    lowest = torch.finfo(dtype).min
    for start in range(0, rows.numel(), chunk):
        idx = rows[start : start + chunk]
        zs_c, zt_c = zs.index_select(0, idx).to(dtype), zt.index_select(0, idx).to(dtype)
        s, t = torch.log_softmax(zs_c, -1), torch.log_softmax(zt_c, -1)
        S, T = s.exp(), t.exp()
        # log T/S from the logits' difference: the divergences' values near convergence
        ratio = log_ratio(S, zs_c, zt_c) if divergences else None
        del zs_c, zt_c
        values = {"student/entropy": -(S * s).sum(-1), "teacher/entropy": -(T * t.clamp(min=lowest)).sum(-1)}
        if k:
            # each top-k set is taken within its distribution's support: under a filter that keeps
            # fewer than k entries, the rest tie at zero mass and topk would pick among them by index
            top_s, top_t = s.topk(k, dim=-1).indices, t.topk(k, dim=-1).indices
            in_s, in_t = S.gather(-1, top_s) > 0, T.gather(-1, top_t) > 0
            values["overlap/teacher_mass"] = torch.where(in_s, T.gather(-1, top_s), 0.0).sum(-1)
            values["overlap/student_mass"] = torch.where(in_t, S.gather(-1, top_t), 0.0).sum(-1)
            shared = ((top_s.unsqueeze(-1) == top_t.unsqueeze(-2)) & in_t.unsqueeze(-2)).any(-1) & in_s
            smaller = torch.minimum(in_s.sum(-1), in_t.sum(-1)).clamp(min=1)
            values["overlap/ratio"] = shared.to(dtype).sum(-1) / smaller.to(dtype)
        del T
        for name, d in divergences.items():
            values[name] = chunk_value(d, S, ratio, lambda far, s=s, t=t: (s[far], t[far]))
        for name, v in values.items():
            out[name][idx] = v.to(dtype)
    return {n: v.reshape(lead) for n, v in out.items()}


def agreement(student_z: torch.Tensor, teacher_z: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Per position (every position): the teacher's entropy and the top-k agreement of the two
    distributions: the teacher's mass on the student's top-k (``overlap/teacher_mass``), the
    student's mass on the teacher's top-k (``overlap/student_mass``), and the share of entries
    the two top-k sets have in common (``overlap/ratio``). A top-k set holds only entries of
    nonzero mass (fewer than k when a top-k / top-p filter keeps fewer); the share is of the
    smaller set."""
    if k < 1:
        raise ValueError(f"agreement: k={k} is out of range; allowed: k >= 1")
    every = torch.ones(student_z.shape[:-1], dtype=torch.bool, device=student_z.device)
    got = step_monitors(student_z, teacher_z, every, divergences={}, k=k)
    return tuple(got[n] for n in AGREEMENT)
