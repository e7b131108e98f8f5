"""Cross-tokenizer OPD: the student's and the teacher's tokens of one text, aligned by byte offsets
into chunks, and the sampled-token payload whose REINFORCE costs are the chunks' log-ratios.

Alignment. Both tokenizations cover the same bytes; a token is its byte span ``[start, end)``
(a special token such as an end-of-turn has an empty span). A chunk closes at a byte offset where
both tokenizations have a boundary, so each chunk is a run of student tokens and a run of teacher
tokens over the same bytes (``align_chunks``). Identical tokenizations give one token per side per
chunk.

The estimator (what it estimates, exactly). Let y be the student's tokens, x(y) their text (with
the end of turn), and T_canon(x) the teacher's probability of x through its OWN canonical
tokenization: the product of the teacher's log-probs of the tokens its tokenizer makes of x, then
its end of turn. The sequence cost is

    C(y) = log S(y) - log T_canon(x(y)) = sum over chunks (student chunk log-prob - teacher chunk log-prob)

and E_{y~S}[C(y)] = KL(S || T_canon) at the sequence level. When the student's tokenizer gives each
string one tokenization (character level, or a student that only emits its canonical tokens) this is
the KL between the two distributions over strings; otherwise it is E_S[log S(y) - log T_canon(x(y))]
= KL(S_str || T_canon) - H_S(tokens | string), the KL between the student's token sequences and the
teacher's canonical strings, which the student lowers also by spreading its tokenizations (the
enumeration test checks both statements).

The payload (``chunk_teacher_logprobs``) is a teacher "log-prob" t~ per student token, fed to the
objective's ``estimator=sampled`` unchanged (cost c = s - t~ for rkl): t~ = 0 on every student token
but the one where a chunk's teacher log-prob is placed, which holds that log-prob. The per-token
costs then sum to C(y), and REINFORCE with ``loss.credit=sequence`` (gamma=1, returns = the sum of
the future costs) is an unbiased estimate of grad KL(S || T_canon) exactly when the sum of the costs
placed BEFORE each token depends only on the tokens before it (the reward-to-go argument). Where the
teacher log-prob is placed decides that:

* ``placement="sequence"``: the whole teacher log-prob log T_canon(x) at the row's last token. The
  costs before token i are the student's own log-probs of tokens < i: unbiased for EVERY pair of
  tokenizers (``test_cross_tokenizer_enumeration.py::test_sequence_placement_is_exact``).
* ``placement="chunk"``: each chunk's teacher log-prob at the chunk's last student token. Unbiased
  when whether a chunk closes (and its teacher tokens) is decided by the text up to its end: a
  teacher that needs no look-ahead (one that tokenizes byte by byte, or identical tokenizers that map
  each string one way). A teacher whose tokenizer looks ahead (a merge ``ab``: after ``a`` the split
  depends on the next byte; every real BPE) makes the closing of the chunk ending before token i
  depend on token i, and the estimate is BIASED: measured in ``test_chunk_placement_bias_with_lookahead``.
  With identical unambiguous tokenizers it gives the same losses as the same-tokenizer path (each
  chunk one token, t~ the teacher's log-prob of that token).

Which divergences. Only reverse KL: its sequence-level log-ratio is a SUM over chunks (the chain
rule), so chunk costs add up to the sequence cost. The sequence-level forward KL's REINFORCE weight is
the product of the chunks' ratios (-T_canon(x)/S(y)), and JSD, the skew KLs and TVD have no chain
rule; their per-token forms need the teacher's distribution over the STUDENT's next token, which a
teacher with another vocabulary does not have. Fed the chunk payload they estimate neither their
sequence-level divergence nor a per-token one (``test_other_divergences_do_not_hold`` shows jsd's
expected gradient is not grad JSD(S || T_canon)).

Token credit (``loss.credit=token``, gamma=0) follows the gradient of sum_i c_i with the prefix frozen,
which for chunk costs is not the gradient of the sequence KL (nor of a per-token divergence): biased,
measured in ``test_token_credit_is_biased``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PLACEMENTS = ("sequence", "chunk")


@dataclass(frozen=True)
class Chunk:
    """Student tokens ``student[0]:student[1]`` and teacher tokens ``teacher[0]:teacher[1]`` over
    the same bytes ``bytes[0]:bytes[1]``."""

    student: tuple[int, int]
    teacher: tuple[int, int]
    bytes: tuple[int, int]

    @property
    def one_to_one(self) -> bool:
        return self.student[1] - self.student[0] == 1 and self.teacher[1] - self.teacher[0] == 1


def spans_from_boundaries(starts: Sequence[int], total: int) -> list[tuple[int, int]]:
    """Byte spans of tokens from their start offsets and the text's length (token k covers
    ``starts[k]:starts[k+1]``, the last one up to ``total``)."""
    ends = list(starts[1:]) + [total]
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


def _check_spans(spans: Sequence[tuple[int, int]], side: str) -> None:
    at = 0
    for k, (a, b) in enumerate(spans):
        if a != at or b < a:
            raise ValueError(
                f"align_chunks: the {side}'s token {k} spans bytes {a}:{b}, expected to start at {at} (spans must tile the text)"
            )
        at = b


def align_chunks(student_spans: Sequence[tuple[int, int]], teacher_spans: Sequence[tuple[int, int]]) -> list[Chunk]:
    """Chunks of two tokenizations of the same bytes: each closes at the first byte offset past its
    start where both sides have a token boundary (every token at least one per side; an empty-span
    token, such as an end of turn, joins the chunk that starts at its offset)."""
    _check_spans(student_spans, "student")
    _check_spans(teacher_spans, "teacher")
    ns, nt = len(student_spans), len(teacher_spans)
    total_s = student_spans[-1][1] if ns else 0
    total_t = teacher_spans[-1][1] if nt else 0
    if total_s != total_t:
        raise ValueError(f"align_chunks: the student's tokens cover {total_s} bytes, the teacher's {total_t}")
    chunks: list[Chunk] = []
    i = j = 0
    while i < ns or j < nt:
        if i == ns or j == nt:
            side = "teacher" if i == ns else "student"
            raise ValueError(f"align_chunks: the {side} has tokens left after the other side's last (an end of turn on one side only)")
        i0, j0, start = i, j, student_spans[i][0]
        bs, bt = student_spans[i][1], teacher_spans[j][1]
        i, j = i + 1, j + 1
        while bs != bt:
            if bs < bt:
                if i == ns:
                    raise ValueError("align_chunks: the student's tokens end inside a teacher token")
                bs, i = student_spans[i][1], i + 1
            else:
                if j == nt:
                    raise ValueError("align_chunks: the teacher's tokens end inside a student token")
                bt, j = teacher_spans[j][1], j + 1
        # an empty-span token right after the boundary on one side while the other moves on
        # belongs to the next chunk, which the loop's next turn starts with
        chunks.append(Chunk((i0, i), (j0, j), (start, bs)))
    return chunks


def chunk_teacher_logprobs(
    teacher_logprobs: torch.Tensor, chunks: Sequence[Chunk], n_student: int, placement: str = "sequence"
) -> torch.Tensor:
    """The payload t~ ``[n_student]`` of one row: 0 on every student token except where a teacher
    log-prob is placed (``placement``, module docstring), so that with s the student's log-probs
    sum_i (s_i - t~_i) = log S(y) - log T_canon(x) and, for ``chunk``, each chunk's costs sum to its
    log-ratio. ``teacher_logprobs`` ``[n_teacher]``: the teacher's log-probs of its own tokens."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not allowed; allowed: {', '.join(PLACEMENTS)}")
    out = torch.zeros(n_student, dtype=teacher_logprobs.dtype, device=teacher_logprobs.device)
    if n_student == 0:
        return out
    if placement == "sequence":
        out[n_student - 1] = teacher_logprobs.sum()
        return out
    for c in chunks:
        out[c.student[1] - 1] = out[c.student[1] - 1] + teacher_logprobs[c.teacher[0] : c.teacher[1]].sum()
    return out


def alignment_counts(chunks: Sequence[Chunk]) -> tuple[int, int, int]:
    """(chunks, student tokens in them, one-to-one chunks): what ``align/*`` metrics average."""
    return len(chunks), sum(c.student[1] - c.student[0] for c in chunks), sum(c.one_to_one for c in chunks)
