"""``teacher.align_vocab=shared``: a teacher with another tokenizer feeding ``estimator=full`` or
``topk`` through a vocabulary map and a tail bucket at the aligned one-to-one positions
(``divergences/shared_vocab.py`` has the math, what it estimates and why it is biased).

The map is built once per pair from each token's key (``token_keys``): its BYTES for a text token, its
content for a special token. Byte-level BPE (a ``ByteLevel`` decoder: GPT-2, SmolLM2, Qwen) writes
each byte as one printable character ('Ġ' for a space, 'Ċ' for a newline): those characters are read
back to their bytes, so a token that is part of a UTF-8 character keeps its bytes. SentencePiece
(Gemma) writes a space as '▁' and a byte-fallback token as '<0xHH>': '▁' becomes a space, '<0xHH>' the
byte HH, and a byte-fallback token gives way to a regular token with the same bytes (the tokenizer
never emits the fallback for a byte it has a token for). Each side's end of turn is pinned to the
other's. The teacher scores its own canonical tokens of the student's text (``teacher_align.py``); at
a one-to-one chunk (student token i, teacher token j) its log-probs at j go out projected on the map
(``SharedVocabScores``), completed over the student's vocabulary by the objective with the student's
own distribution (``TeacherScores.against``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from opd_exp.divergences.chunks import alignment_counts
from opd_exp.divergences.shared_vocab import SharedVocab, build_shared_vocab, complete_teacher, project_teacher
from opd_exp.training.batch import Batch
from opd_exp.training.scoring import Pending, TeacherScores, teacher_logits
from opd_exp.training.teacher_align import ByteAlignedTeacher, end_of_turn_id, same_tokenizer

_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_chars() -> dict[str, int]:
    """Byte-level BPE's character for each byte: printable Latin-1 bytes stand for themselves, the
    others (controls, space, ...) for the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(0x100 + n)] = b
            n += 1
    return out


def byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE's (its tokens are written in ``_byte_chars``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()


def token_keys(tokenizer) -> list:
    """Per id (``len(tokenizer)``): ("bytes", b) for a text token, ("special", content) for a special
    one, ("fallback", b) for a SentencePiece byte-fallback token (module docstring), None for a hole."""
    chars = _byte_chars() if byte_level(tokenizer) else None
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    keys = []
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if piece is None:
            keys.append(None)
        elif i in special:
            keys.append(("special", piece))
        elif chars is not None and all(c in chars for c in piece):
            keys.append(("bytes", bytes(chars[c] for c in piece)))
        elif m := _FALLBACK.fullmatch(piece):
            keys.append(("fallback", bytes([int(m[1], 16)])))
        else:
            keys.append(("bytes", piece.replace("\u2581", " ").encode("utf-8")))
    # a fallback byte maps only where no regular token has that byte
    text = {k[1] for k in keys if k is not None and k[0] == "bytes"}
    return [("bytes", k[1]) if k is not None and k[0] == "fallback" and k[1] not in text else k for k in keys]


def pair_vocab(student_tokenizer, teacher_tokenizer) -> SharedVocab:
    """The pair's map: equal keys, and the student's end of turn pinned to the teacher's."""
    pinned = []
    s_end, t_end = end_of_turn_id(student_tokenizer), end_of_turn_id(teacher_tokenizer)
    if s_end is not None and t_end is not None:
        pinned.append((s_end, t_end))
    return build_shared_vocab(token_keys(student_tokenizer), token_keys(teacher_tokenizer), pinned)


@dataclass(frozen=True)
class SharedVocabScores(TeacherScores):
    """The teacher projected on the map at each position ``[N, R]`` whose chunk is one-to-one:
    ``shared`` ``[N, R, M]`` its log-probs on the mapped ids, ``tail`` ``[N, R]`` the log of its mass
    on the rest, both up to one constant per position (filler elsewhere). ``against`` writes them over
    the student's vocabulary."""

    shared: torch.Tensor | None = None
    tail: torch.Tensor | None = None
    one_to_one: torch.Tensor | None = None
    vocab: SharedVocab | None = None

    def against(self, student_z: torch.Tensor) -> TeacherScores:
        return TeacherScores(logits=complete_teacher(student_z, self.shared, self.tail, self.one_to_one, self.vocab))

    def finite_check(self) -> torch.Tensor:
        return torch.cat([self.shared.flatten(), self.tail[self.tail != float("-inf")]])  # an empty tail bin is -inf by right

    def to(self, device) -> SharedVocabScores:
        return replace(self, shared=self.shared.to(device), tail=self.tail.to(device), one_to_one=self.one_to_one.to(device))


class SharedVocabTeacher(ByteAlignedTeacher):
    """The byte-aligned teacher (``teacher_align.py``) returning ``SharedVocabScores``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab = pair_vocab(self.student_tok, self.teacher_tok)
        self._mass = [0.0, 0]  # align/shared_vocab_mass: sum over one-to-one positions, count

    def submit(self, batch: Batch) -> Pending:
        return Pending(lambda: self.score(batch))  # in process: scored when asked for

    def score(self, batch: Batch) -> TeacherScores:
        with self.clock("teacher"):
            return self._score(batch)

    def _score(self, batch: Batch) -> TeacherScores:
        view, rows = self.teacher_rows(batch)
        where = batch.input_ids.device
        with self.autocast(), torch.no_grad():
            b = view if view.input_ids.device == self.device else view.to(self.device)
            # the logits themselves (log-probs up to a constant per position): with one tokenizer the completion is
            # then today's teacher logits bit for bit, and every reader normalises
            lt = teacher_logits(self.model, b, self.teacher_vocab, temperature=self.temperature)
        N, R = batch.response_ids.shape
        rows_at, s_cols, t_pos = [], [], []
        for i, (n, chunks) in enumerate(rows):
            cols = batch.response_mask[i].nonzero().squeeze(-1)[:n].tolist()
            for c in chunks:
                if c.one_to_one:  # student token c.student[0] and teacher token c.teacher[0]: the same text before them
                    rows_at.append(i)
                    s_cols.append(cols[c.student[0]])
                    t_pos.append(c.teacher[0])
            c, s, o = alignment_counts(chunks) if n else (0, 0, 0)
            self._counts = [self._counts[0] + c, self._counts[1] + s, self._counts[2] + o, self._counts[3] + 1]
        shared = torch.zeros(N, R, self.vocab.size, dtype=lt.dtype, device=where)
        tail = torch.zeros(N, R, dtype=lt.dtype, device=where)
        one = torch.zeros(N, R, dtype=torch.bool, device=where)
        if rows_at:
            sh, tl = project_teacher(lt[rows_at, t_pos], self.vocab)
            idx = (torch.tensor(rows_at, device=where), torch.tensor(s_cols, device=where))
            shared[idx], tail[idx], one[idx] = sh.to(where), tl.to(where), True
            mapped = torch.logsumexp(sh.double(), dim=-1)
            mass = (mapped - torch.logaddexp(mapped, tl.double())).exp()  # the teacher's mass on mapped ids
            self._mass = [self._mass[0] + float(mass.sum()), self._mass[1] + len(rows_at)]
        return SharedVocabScores(shared=shared, tail=tail, one_to_one=one, vocab=self.vocab)

    def metrics(self) -> dict[str, float]:
        total, n = self._mass
        self._mass = [0.0, 0]
        return {**super().metrics(), **({"align/shared_vocab_mass": total / n} if n else {})}


def build_shared_vocab_teacher(ctx) -> SharedVocabTeacher:
    """``teacher.align=bytes teacher.align_vocab=shared`` on the in-process teacher (its tokenizer as in
    ``teacher_align.build_byte_aligned``)."""
    teacher_tok = getattr(ctx, "teacher_tokenizer", None) or ctx.tokenizer
    scorer = SharedVocabTeacher(
        ctx.model, ctx.tokenizer, teacher_tok, temperature=ctx.cfg.divergence.temperature, device=ctx.device, autocast=ctx.autocast
    )
    v = scorer.vocab
    same = same_tokenizer(ctx.tokenizer, teacher_tok)
    ctx.warn(
        f"opd-train: teacher.align_vocab=shared: {v.size} of {v.student_size} student ids map to the teacher's {v.teacher_size}"
        f"{' (one tokenizer: the identity)' if same else ''}; estimator={ctx.cfg.estimator.name.value} trains "
        "D(S || T) over the shared ids + one tail bucket at one-to-one chunks only, BIASED for the sequence KL(S || T_canon) "
        "(docs/training.md); kl/reverse, jsd/mean and teacher/logprob_mean are per one-to-one position (0 elsewhere); exact/*, "
        "entropies, overlap/* and the eval divergences are not logged"
    )
    return scorer
