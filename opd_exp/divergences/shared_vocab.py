"""Cross-tokenizer OPD over a shared vocabulary (GOLD/ULD-style): the dense and top-k estimators fed a
teacher with another tokenizer, at the aligned one-to-one positions only. Biased; what it estimates
and its measured bias are stated here and in docs/training.md ("Teachers with another tokenizer").

The map. A vocabulary map pairs a student id with a teacher id whose tokens have the same key (the
token's bytes, or a special token's content; ``training/shared_vocab.py`` makes the keys). A key is
mapped only where it names ONE id on each side, so the map is one-to-one; pinned pairs (each side's
end of turn) are added whatever their keys. Every other id is unmapped.

The objective. At a one-to-one chunk (one student token i and one teacher token j over the same
bytes) both models predict the next token after the same text. Their distributions are coarsened to
the same bins: one bin per mapped pair, plus ONE tail bin holding each side's mass on its unmapped
ids (S_tail, T_tail). The per-position term is D(S_c || T_c) between the coarsened distributions; a
position that is not one-to-one gets no term (zero value, zero gradient; no fall-back to the chunk
cost, whose sum is a sequence quantity). The estimators treat sum_i D_i as they treat the
same-tokenizer sum of D_t: ``full`` exactly, ``topk`` exact on the top-k plus a sampled tail. With
``loss=direct`` (the GKD form) ``full``'s expected gradient is exactly E_{y~S}[sum over one-to-one
positions i of grad D(S_c || T_c)(y_<i)], S(y) and the set of one-to-one positions held constant
(``tests/test_shared_vocab.py``).

It is NOT the gradient of the sequence-level KL(S || T_canon) (the chunk payload's target,
``chunks.py``), and with another tokenizer not even of E_S[sum over one-to-one positions of D_i]:
whether position i is one-to-one depends on token i itself and on the teacher's look-ahead (after
``a``, a teacher with the merge ``ab`` waits for the next byte), which no credit assignment sees; the
top-k estimator's sampled tail then correlates with that indicator too. Positions that are not
one-to-one are left out, the teacher's next-token distribution is over ITS tokens (one can cover the
bytes of several student tokens), and the tail bin merges tokens. Measured by enumeration on the tiny
pairs (docs/training.md, ``test_bias_against_the_sequence_kl_is_measured``): at ``loss.credit=sequence``
cosine 0.85-1.00 and relative error 0.11-0.59 with the sequence KL's gradient (full), 0.74-0.99 and
0.33-0.68 (topk); identical tokenizers give it exactly.

How the estimators see it (``complete_teacher``): the teacher's coarsened distribution is written
over the STUDENT's vocabulary, each mapped id with its teacher's probability and each unmapped id
with T_tail * S(v) / S_tail (the student's own split of its tail, held constant). For a divergence
that sums a homogeneous term over the vocabulary (every f-divergence: rkl, fkl, jsd, skl, srkl, tvd),
D(S || T') has the value AND the gradient of D(S_c || T_c): within the tail the ratio S/T' is the
constant S_tail/T_tail, so each unmapped id's term and derivative are its share of the tail bin's
(``test_completion_is_the_coarse_divergence``). Positions that are not one-to-one get T' = S. When
the student has no unmapped id the teacher's tail mass has nowhere to go and the estimators'
log-softmax renormalises T' over the mapped ids (for rkl the same gradient, the value off by
log(1 - T_tail)); when the teacher has none, T_tail = 0 and any student mass on unmapped ids makes
rkl infinite (the run stops at its non-finite loss check).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedVocab:
    """A one-to-one map: ``student_ids[k]`` <-> ``teacher_ids[k]`` (sorted by student id)."""

    student_ids: torch.Tensor  # [M] long
    teacher_ids: torch.Tensor  # [M] long
    student_size: int
    teacher_size: int

    @property
    def size(self) -> int:
        return int(self.student_ids.numel())

    def unmapped(self, side: str) -> torch.Tensor:
        """Bool mask over ``side``'s ids (student | teacher) that are in no pair: its tail bin."""
        ids, n = (self.student_ids, self.student_size) if side == "student" else (self.teacher_ids, self.teacher_size)
        out = torch.ones(n, dtype=torch.bool)
        out[ids] = False
        return out


def _unique(keys: Sequence[Hashable | None]) -> dict:
    """key -> id for the keys that name exactly one id (None: never mapped)."""
    seen: dict = {}
    for i, k in enumerate(keys):
        if k is not None:
            seen[k] = None if k in seen else i
    return {k: i for k, i in seen.items() if i is not None}


def build_shared_vocab(
    student_keys: Sequence[Hashable | None], teacher_keys: Sequence[Hashable | None], pinned: Iterable[tuple[int, int]] = ()
) -> SharedVocab:
    """The map of ids whose keys are equal and unique on both sides, plus ``pinned`` (student id,
    teacher id) pairs, which replace any pair holding either id."""
    s_index, t_index = _unique(student_keys), _unique(teacher_keys)
    pairs = {s: t_index[k] for k, s in s_index.items() if k in t_index}
    for s, t in pinned:
        pairs = {a: b for a, b in pairs.items() if a != s and b != t}
        pairs[int(s)] = int(t)
    order = sorted(pairs)
    return SharedVocab(
        torch.tensor(order, dtype=torch.long),
        torch.tensor([pairs[s] for s in order], dtype=torch.long),
        len(student_keys),
        len(teacher_keys),
    )


def project_teacher(teacher_logprobs: torch.Tensor, vocab: SharedVocab) -> tuple[torch.Tensor, torch.Tensor]:
    """(log T on the mapped ids ``[..., M]`` in the map's order, log T_tail ``[...]``: the log of the
    teacher's mass on its unmapped ids, -inf where it has none) from its log-probs ``[..., V_t]``
    (or its logits: both outputs are then off by the same constant per position, which the readers'
    normalisation removes)."""
    lt = teacher_logprobs
    shared = lt.index_select(-1, vocab.teacher_ids.to(lt.device))
    unmapped = vocab.unmapped("teacher").to(lt.device)
    if not unmapped.any():
        return shared, torch.full(lt.shape[:-1], float("-inf"), dtype=lt.dtype, device=lt.device)
    return shared, torch.logsumexp(lt[..., unmapped], dim=-1)


def complete_teacher(
    student_z: torch.Tensor, shared: torch.Tensor, tail: torch.Tensor, one_to_one: torch.Tensor, vocab: SharedVocab
) -> torch.Tensor:
    """log T' ``[..., V_s]`` over the student's vocabulary (module docstring): at one-to-one positions
    the teacher's log-probs on the mapped ids and log T_tail + log S(v) - log S_tail on the unmapped
    ones; elsewhere log S (no term). ``student_z`` is read without gradient. ``shared`` and ``tail``
    may share a constant per position (``project_teacher`` of logits): T' then has it too."""
    dtype = torch.promote_types(student_z.dtype, shared.dtype)
    ls = torch.log_softmax(student_z.detach().to(dtype), dim=-1)
    where = one_to_one.bool().unsqueeze(-1)
    out = ls.clone()
    unmapped = vocab.unmapped("student").to(ls.device)
    if unmapped.any():
        ls_u = ls[..., unmapped]
        s_tail = torch.logsumexp(ls_u, dim=-1, keepdim=True)
        # the student's own split of its tail (uniform where it gives the tail no mass at all)
        split = torch.where(torch.isfinite(s_tail), ls_u - s_tail, -torch.log(torch.tensor(float(ls_u.shape[-1]), dtype=dtype)))
        out[..., unmapped] = torch.where(where, tail.to(dtype).unsqueeze(-1) + split, ls_u)
    ids = vocab.student_ids.to(ls.device)
    out[..., ids] = torch.where(where, shared.to(dtype), ls[..., ids])
    return out


def coarse_logprobs(logprobs: torch.Tensor, mapped_ids: torch.Tensor, size: int) -> torch.Tensor:
    """A distribution's log-probs ``[..., V]`` coarsened to the map's bins ``[..., M + 1]``: its
    mapped ids in the map's order, then its tail (the mass on every other id)."""
    unmapped = torch.ones(size, dtype=torch.bool, device=logprobs.device)
    unmapped[mapped_ids] = False
    tail = torch.logsumexp(logprobs[..., unmapped], dim=-1, keepdim=True) if unmapped.any() else logprobs[..., :1] * 0 - float("inf")
    return torch.cat([logprobs.index_select(-1, mapped_ids.to(logprobs.device)), tail], dim=-1)
