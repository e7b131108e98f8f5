"""The byte-offset aligner (``opd_exp/divergences/chunks.py``) on hand-made spans."""

import pytest
import torch

from opd_exp.divergences.chunks import Chunk, align_chunks, alignment_counts, chunk_teacher_logprobs, spans_from_boundaries


def test_identical_tokenizations_are_one_to_one():
    sp = [(0, 2), (2, 3), (3, 7)]
    chunks = align_chunks(sp, sp)
    assert chunks == [Chunk((0, 1), (0, 1), (0, 2)), Chunk((1, 2), (1, 2), (2, 3)), Chunk((2, 3), (2, 3), (3, 7))]
    assert alignment_counts(chunks) == (3, 3, 3)


def test_chunks_close_only_on_shared_boundaries():
    # text "hello world" (11 bytes); student: "hel" "lo" " wor" "ld"; teacher: "hello" " " "world"
    student = spans_from_boundaries([0, 3, 5, 9], 11)
    teacher = spans_from_boundaries([0, 5, 6], 11)
    chunks = align_chunks(student, teacher)
    assert chunks == [Chunk((0, 2), (0, 1), (0, 5)), Chunk((2, 4), (1, 3), (5, 11))]
    assert alignment_counts(chunks) == (2, 4, 0)


def test_end_of_turn_is_its_own_chunk():
    # "ab" then each side's end of turn (an empty span at the end)
    student = [(0, 1), (1, 2), (2, 2)]
    teacher = [(0, 2), (2, 2)]
    chunks = align_chunks(student, teacher)
    assert chunks == [Chunk((0, 2), (0, 1), (0, 2)), Chunk((2, 3), (1, 2), (2, 2))]
    assert chunks[-1].one_to_one


def test_end_on_one_side_only_is_refused():
    with pytest.raises(ValueError, match="end of turn on one side only"):
        align_chunks([(0, 1), (1, 1)], [(0, 1)])


def test_spans_that_do_not_tile_or_differ_in_length_are_refused():
    with pytest.raises(ValueError, match="must tile"):
        align_chunks([(0, 1), (2, 3)], [(0, 3)])
    with pytest.raises(ValueError, match="cover 3 bytes, the teacher's 4"):
        align_chunks([(0, 3)], [(0, 4)])


def test_payload_sums_to_the_chunk_costs():
    student = spans_from_boundaries([0, 3, 5, 9], 11)
    teacher = spans_from_boundaries([0, 5, 6], 11)
    chunks = align_chunks(student, teacher)
    tlp = torch.tensor([-1.0, -2.0, -4.0], dtype=torch.float64)
    s = torch.tensor([-0.5, -0.25, -0.125, -1.0], dtype=torch.float64)
    by_chunk = chunk_teacher_logprobs(tlp, chunks, 4, "chunk")
    assert by_chunk.tolist() == [0.0, -1.0, 0.0, -6.0]  # each chunk's teacher log-prob at its last student token
    whole = chunk_teacher_logprobs(tlp, chunks, 4, "sequence")
    assert whole.tolist() == [0.0, 0.0, 0.0, -7.0]
    for t in (by_chunk, whole):  # the costs s - t~ sum to log S(y) - log T_canon(x)
        assert float((s - t).sum()) == float(s.sum() - tlp.sum())
    cost = s - by_chunk  # and per chunk to the chunk's log-ratio
    assert float(cost[:2].sum()) == float(s[:2].sum() - tlp[0]) and float(cost[2:].sum()) == float(s[2:].sum() - tlp[1:].sum())
    with pytest.raises(ValueError, match="placement='token' is not allowed; allowed: sequence, chunk"):
        chunk_teacher_logprobs(tlp, chunks, 4, "token")


PIECES = {0: b"ab", 1: b"\xf0\x9f", 2: b"\x98"}  # 1, 2: the first three bytes of a four-byte emoji


class _BytesTokenizer:
    """A student tokenizer whose tokens are raw bytes, decoded with replacement like a byte-level BPE."""

    def decode(self, ids, **_):
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_a_cut_character_whose_last_piece_adds_no_bytes_joins_the_chunk_before_it():
    """A row cut inside a multi-byte character: its last token decodes to nothing new (the
    replacement character is already there), an empty span after the teacher's last token. It
    joins the chunk before it instead of stopping the run (seen on gemma_smollm2 at step ~35)."""
    from opd_exp.training.teacher_align import fold_byteless_tail, student_boundaries, unfold_tail

    text, starts = student_boundaries(_BytesTokenizer(), [0, 1, 2])
    total = len(text.encode("utf-8"))
    assert (text, starts, total) == ("ab\ufffd", [0, 2, 5], 5)
    spans = spans_from_boundaries(starts, total)
    teacher = [(0, 1), (1, 5)]  # "a", "b\ufffd"
    with pytest.raises(ValueError, match="end of turn on one side only"):
        align_chunks(spans, teacher)  # what the scorer did before
    folded, k = fold_byteless_tail(spans, total)
    assert (folded, k) == ([(0, 2), (2, 5)], 1)
    chunks = unfold_tail(align_chunks(folded, teacher), len(starts) - k, k)
    assert chunks == [Chunk((0, 3), (0, 2), (0, 5))]  # every student token in a chunk, once
    # the row ended: both ends of turn still align, one chunk after the folded token
    ended = unfold_tail(align_chunks([*folded, (5, 5)], [*teacher, (5, 5)]), len(starts) - k, k)
    assert ended == [Chunk((0, 3), (0, 2), (0, 5)), Chunk((3, 4), (2, 3), (5, 5))]
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    assert chunk_teacher_logprobs(logprobs, ended, 4, placement="chunk").tolist() == [0.0, 0.0, -3.0, -0.5]
    assert chunk_teacher_logprobs(logprobs, ended, 4).sum().item() == -3.5  # log T_canon of the row
    assert fold_byteless_tail([(0, 0)], 0) == ([(0, 0)], 0)  # a row keeps its first token
