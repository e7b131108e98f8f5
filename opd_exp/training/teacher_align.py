"""A teacher with another tokenizer (``teacher.align=bytes``): the student's sampled text rendered for
the teacher with the teacher's tokenizer, scored on the teacher's own tokens, and aligned by byte
offsets into chunks (``divergences/chunks.py``, where the math and what it estimates are stated).

Per row: the prompt text (the teacher's view of the row where it has one, ``Batch.teacher_input``: the
teacher's own chat template, ``training/teacher_prompt.py``; else the student's rendered prompt),
decoded from its ids, is tokenized by the teacher; the response's text (the student's tokens up to its
end of turn) is tokenized by the teacher as a whole (its canonical tokens) and followed by the
teacher's end of turn where the student's row ended with its own; a teacher tokenizer that prepends a
BOS (Gemma, Llama) gets it at the start of the prompt, exactly once. The teacher scores that sequence
once (in process, or a served teacher: ``teacher=served``, ``training/teacher_served.py``); the payload t~ (the teacher's chunk log-probs placed among the student's tokens,
``teacher.align_placement``) goes back as a sampled-only ``TeacherScores`` for ``estimator=sampled``.

Byte offsets: the student's token boundaries come from decoding its prefixes (a token whose decoded
prefix is not a prefix of the text, a byte inside a multi-byte character, has no boundary of its own
and joins the next chunk); the teacher's from its tokenizer's offsets. EOS: each side's end of turn
is an empty span at the end of the text, aligned with the other's; a teacher with no end of turn the
student's end can map to is refused when the scorer is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from opd_exp.divergences.chunks import Chunk, align_chunks, alignment_counts, chunk_teacher_logprobs, spans_from_boundaries
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.batch import Batch
from opd_exp.training.scoring import InProcessTeacher, Pending, TeacherScorer, TeacherScores

# end-of-turn tokens of the chat templates in use (ChatML, Gemma, Llama 3, Phi)
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")


def end_of_turn_id(tokenizer) -> int | None:
    """The token that ends an assistant turn: the chat template's own end of turn where the template
    uses one, else the tokenizer's EOS (None: none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    for tok in END_OF_TURN:
        if tok in template and tok in vocab:
            return int(vocab[tok])
    return None if tokenizer.eos_token_id is None else int(tokenizer.eos_token_id)


def student_end_ids(tokenizer) -> set[int]:
    """Every id that ends a student row: its EOS and its template's end of turn."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    eot = end_of_turn_id(tokenizer)
    return ids | ({eot} if eot is not None else set())


def bos_prepended(tokenizer) -> int | None:
    """The BOS id the tokenizer puts before a text with ``add_special_tokens`` (Gemma, Llama), else None."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    plain = tokenizer("1", add_special_tokens=False)["input_ids"]
    special = tokenizer("1", add_special_tokens=True)["input_ids"]
    return int(bos) if special[:1] == [bos] and plain[:1] != [bos] else None


def same_tokenizer(a, b) -> bool:
    """One tokenizer for both (the same object, or the same vocabulary)."""
    return a is b or a.get_vocab() == b.get_vocab()


def student_boundaries(tokenizer, ids: Sequence[int]) -> tuple[str, list[int]]:
    """The text of ``ids`` and each token's start byte offset (from decoded prefixes; a token with no
    boundary of its own gets its predecessor's end: an empty span that joins the next chunk)."""
    decode = lambda x: tokenizer.decode(list(x), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    text = decode(ids)
    whole = text.encode("utf-8")
    starts, at = [], 0
    for k in range(len(ids)):
        if k > 0:
            prefix = decode(ids[:k]).encode("utf-8")
            if whole.startswith(prefix) and len(prefix) >= at:
                at = len(prefix)
        starts.append(at)
    return text, starts


def fold_byteless_tail(spans: list[tuple[int, int]], total: int) -> tuple[list[tuple[int, int]], int]:
    """The student's last tokens that add no bytes of their own (a cut multi-byte character whose
    last pieces decode to the replacement character already written): (the spans without them,
    how many). They belong to the chunk before them, which ``unfold_tail`` gives them back to; the
    first token always stays, so a row keeps a chunk."""
    k = 0
    while len(spans) - k > 1 and spans[-1 - k] == (total, total):
        k += 1
    return (spans[: len(spans) - k] if k else spans), k


def unfold_tail(chunks: list[Chunk], at: int, k: int) -> list[Chunk]:
    """``align_chunks``' chunks with the ``k`` folded student tokens put back at index ``at``: in the
    chunk that ends there (their log-probs join its student side; its teacher side is unchanged)
    and every later chunk (the end of turn) moved on by ``k``."""
    if not k:
        return chunks
    out = []
    for c in chunks:
        (a, b) = c.student
        if b == at and a < at:
            out.append(Chunk((a, b + k), c.teacher, c.bytes))
        elif a >= at:
            out.append(Chunk((a + k, b + k), c.teacher, c.bytes))
        else:
            out.append(c)
    return out


def teacher_tokens(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """The teacher's canonical ids of ``text`` and each token's start byte offset (monotone, the
    first at 0), from its tokenizer's character offsets."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    byte_at = [0]
    for ch in text:
        byte_at.append(byte_at[-1] + len(ch.encode("utf-8")))
    starts, at = [], 0
    for k, (a, _b) in enumerate(offsets):
        at = 0 if k == 0 else max(at, byte_at[min(int(a), len(text))])
        starts.append(at)
    return ids, starts


class ByteAlignedTeacher(TeacherScorer):
    """An in-process teacher with its own tokenizer, scored on its own tokens (module docstring)."""

    full_distribution = False  # a sampled-only payload: no teacher distribution over the student's tokens

    def __init__(
        self,
        model,
        student_tokenizer,
        teacher_tokenizer,
        *,
        temperature: float,
        device,
        placement: str = "sequence",
        autocast=contextlib.nullcontext,
        teacher: TeacherScorer | None = None,
    ):
        self.model, self.student_tok, self.teacher_tok = model, student_tokenizer, teacher_tokenizer
        self.temperature, self.device, self.autocast, self.placement = temperature, torch.device(device), autocast, placement
        self.teacher_vocab = len(teacher_tokenizer)
        # what scores the teacher's own tokens: the model here, or a served one (its vocabulary is the teacher's)
        self.scorer = (
            teacher
            if teacher is not None
            else InProcessTeacher(model, self.teacher_vocab, temperature=temperature, device=device, autocast=autocast)
        )
        self.teacher_bos = bos_prepended(teacher_tokenizer)
        self.end_ids = student_end_ids(student_tokenizer)
        self.teacher_end = end_of_turn_id(teacher_tokenizer)
        if not self.end_ids or self.teacher_end is None:
            side = "student's" if not self.end_ids else "teacher's"
            raise ConfigError(
                f"teacher.align='bytes' is not allowed with this pair (the {side} tokenizer has no end of turn, so one side's "
                "end cannot be mapped to the other's); allowed: a pair whose tokenizers both have an EOS or a chat end-of-turn token"
            )
        pad = teacher_tokenizer.pad_token_id
        self.teacher_pad = int(pad) if pad is not None else self.teacher_end
        self._counts = [0, 0, 0, 0]  # chunks, student tokens in them, one-to-one chunks, rows

    # -- the teacher's rows ------------------------------------------------------------------------

    def teacher_rows(self, batch: Batch):
        """The teacher's ``Batch`` (left-padded teacher prompts, the teacher's tokens of each response,
        its end of turn where the row ended) and each row's (student length, chunks)."""
        asked = batch.teacher_input  # the teacher's own prompt where the batch carries one
        P = asked.prompt_len
        prompts, responses, rows = [], [], []
        for i in range(batch.num_sequences):
            pmask = asked.attention_mask[i, :P].bool()
            prompt = self.student_tok.decode(
                asked.input_ids[i, :P][pmask].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            p_ids = self.teacher_tok(prompt, add_special_tokens=False)["input_ids"]
            if self.teacher_bos is not None and p_ids[:1] != [self.teacher_bos]:  # its BOS, once (a template may write it)
                p_ids = [self.teacher_bos, *p_ids]
            prompts.append(p_ids)
            ids = batch.response_ids[i][batch.response_mask[i].bool()].tolist()
            ended = bool(ids) and ids[-1] in self.end_ids
            body = ids[:-1] if ended else ids
            text, s_starts = student_boundaries(self.student_tok, body)
            t_ids, t_starts = teacher_tokens(self.teacher_tok, text)
            total = len(text.encode("utf-8"))
            s_spans, t_spans = spans_from_boundaries(s_starts, total), spans_from_boundaries(t_starts, total)
            s_spans, tail = fold_byteless_tail(s_spans, total)
            if ended:  # each side's end of turn: an empty span at the end
                s_spans, t_spans, t_ids = [*s_spans, (total, total)], [*t_spans, (total, total)], [*t_ids, self.teacher_end]
            rows.append((len(ids), unfold_tail(align_chunks(s_spans, t_spans), len(body) - tail, tail)))
            responses.append(t_ids)
        device = batch.input_ids.device
        Pt, Rt = max(1, max(map(len, prompts))), max(1, max(map(len, responses)))
        p_ids = torch.full((len(prompts), Pt), self.teacher_pad, dtype=torch.long)
        p_mask = torch.zeros_like(p_ids)
        r_ids = torch.full((len(responses), Rt), self.teacher_pad, dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if p:
                p_ids[i, Pt - len(p) :], p_mask[i, Pt - len(p) :] = torch.tensor(p), 1
            if r:
                r_ids[i, : len(r)] = torch.tensor(r)
        lengths = torch.tensor([len(r) for r in responses])
        view = Batch.from_responses(p_ids.to(device), p_mask.to(device), r_ids.to(device), [self.teacher_end], lengths=lengths.to(device))
        # the teacher's own layout: every one of its tokens counts (an end id inside the text included)
        view.response_mask = torch.arange(Rt, device=device)[None, :] < lengths.to(device)[:, None]
        return view, rows

    @torch.no_grad()
    def teacher_token_logprobs(self, view: Batch) -> torch.Tensor:
        """log T of the teacher's own tokens ``[N, Rt]`` (its logits divided by the divergence temperature)."""
        return self.scorer.score(view).token_logprobs(view.response_ids)

    def score(self, batch: Batch) -> TeacherScores:
        return self.submit(batch).result()

    def submit(self, batch: Batch) -> Pending:
        """The teacher's rows now (a served teacher's requests leave at once), the chunk payload when asked;
        both in the teacher phase (perf/teacher_s)."""
        with self.clock("teacher"):
            view, rows = self.teacher_rows(batch)
            pending = self.scorer.submit(view)

        def result() -> TeacherScores:
            with self.clock("teacher"):
                return self._payload(batch, view, rows, pending.result().token_logprobs(view.response_ids))

        out = Pending(result)
        out.cancel = pending.cancel  # a step that stops early gives up on a server's reply too
        return out

    @torch.no_grad()
    def _payload(self, batch: Batch, view: Batch, rows, teacher_lp: torch.Tensor) -> TeacherScores:
        tlp = teacher_lp.to(view.input_ids.device).double()
        out = torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
        for i, (n, chunks) in enumerate(rows):
            if n == 0:
                continue
            m = int(view.response_mask[i].sum())
            t = chunk_teacher_logprobs(tlp[i, :m], chunks, n, self.placement)
            cols = batch.response_mask[i].nonzero().squeeze(-1)[:n]
            out[i, cols] = t.to(out.dtype)
            c, s, o = alignment_counts(chunks)
            self._counts = [self._counts[0] + c, self._counts[1] + s, self._counts[2] + o, self._counts[3] + 1]
        return TeacherScores(sampled_logprobs=out)

    # a served scorer's identity, self-test flag and connections are this scorer's
    def identity(self) -> dict:
        return self.scorer.identity()

    @property
    def self_tested(self) -> bool:
        return getattr(self.scorer, "self_tested", True)

    def close(self) -> None:
        self.scorer.close()

    def counts(self) -> list[int]:
        """The step's alignment counts (chunks, student tokens in them, one-to-one chunks, rows), reset on reading."""
        out, self._counts = self._counts, [0, 0, 0, 0]
        return out

    def metrics(self) -> dict[str, float]:
        return align_metrics(self.counts())


def align_metrics(counts: Sequence[int]) -> dict[str, float]:
    """``align/*`` from ``ByteAlignedTeacher.counts`` (summed over routed teachers: one value over all rows)."""
    chunks, tokens, one, _rows = counts
    if not chunks:
        return {}
    return {"align/chunk_tokens_mean": tokens / chunks, "align/one_to_one_rate": one / chunks}


def build_byte_aligned(ctx, teacher: TeacherScorer | None = None) -> ByteAlignedTeacher:
    """``teacher.align=bytes``: its tokenizer is ``ctx.teacher_tokenizer`` (the pair's own where the pair
    has one), else the pair's shared one (the same-tokenizer check); ``teacher`` scores the teacher's own
    tokens (None: ``ctx.model`` in process; a served one: ``teacher_served.build_served_byte_aligned``)."""
    cfg, te = ctx.cfg, ctx.cfg.teacher
    teacher_tok = getattr(ctx, "teacher_tokenizer", None) or ctx.tokenizer
    same = same_tokenizer(ctx.tokenizer, teacher_tok)
    if te.align_placement == "chunk" and not same and not te.align_biased:
        raise ConfigError(
            "teacher.align_placement='chunk' is not allowed with a teacher whose tokenizer is not the student's (biased where "
            "the teacher's tokenizer looks ahead, as BPE does); allowed: sequence (exact for every pair), or "
            "teacher.align_biased=true"
        )
    ctx.warn(
        "opd-train: teacher.align=bytes: the teacher scores its own tokens; kl/reverse is the sequence KL(S || T_canon) per "
        "student token, while jsd/mean, kl/forward and teacher/logprob_mean are read from the chunk payload and estimate no "
        "per-token divergence; exact/*, entropies, overlap/* and the eval divergences are not logged (docs/training.md)"
    )
    return ByteAlignedTeacher(
        ctx.model,
        ctx.tokenizer,
        teacher_tok,
        temperature=cfg.divergence.temperature,
        device=ctx.device,
        placement=te.align_placement,
        autocast=ctx.autocast,
        teacher=teacher,
    )
