"""The teacher scorer, picked once from the ``teacher`` config group through a registry keyed by
``teacher.name``: the pair's teacher in this process (dense logits), a served one (top-k
log-probs from a vLLM server; docs/engines.md), a teacher made from the student (ema, lagged,
live; ``training/teacher_student.py``), or one a plugin registers (docs/extending.md).

A builder gets a ``ScorerContext`` (what the run has: the pair's teacher module or the student,
the tokenizer, the vocabulary, device, autocast, warn) and returns a ``TeacherScorer``; the
trainer never asks which one it has."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opd_exp.training.scoring import InProcessTeacher, TeacherScorer
from opd_exp.training.teacher_served import build_served_teacher
from opd_exp.training.teacher_student import EmaTeacher, LaggedTeacher, LiveTeacher


@dataclass
class ScorerContext:
    cfg: Any  # the run's TrainConfig (a builder reads cfg.teacher and what it needs)
    model: Any  # the module this scorer scores with: the pair's teacher, or the student-made one (None: none here)
    tokenizer: Any
    vocab_size: int
    device: Any
    autocast: Any = contextlib.nullcontext
    warn: Callable[[str], None] = print
    teacher_tokenizer: Any = None  # the teacher's own tokenizer where it is not the pair's (teacher.align=bytes)

    def in_process(self, cls=InProcessTeacher, **kw) -> InProcessTeacher:
        return cls(
            self.model, self.vocab_size, temperature=self.cfg.divergence.temperature, device=self.device, autocast=self.autocast, **kw
        )


Builder = Callable[[ScorerContext], TeacherScorer]
TEACHER_SCORERS: dict[str, Builder] = {}


def register_teacher_scorer(name: str, builder: Builder | None = None):
    """Register ``builder(ctx) -> TeacherScorer`` under ``teacher.name=<name>`` (usable as a
    decorator). A plugin's scorer runs the teacher-scorer check before it trains
    (``opd_exp.cli.plugin_check``)."""

    def add(fn: Builder) -> Builder:
        from opd_exp.config.teacher import TeacherName

        if not name.isidentifier():
            raise ValueError(f"register_teacher_scorer: {name!r} is not an identifier (it becomes teacher.name={name})")
        TEACHER_SCORERS[name] = fn
        TeacherName._add(name)
        return fn

    return add if builder is None else add(builder)


def sparse_teacher_k(cfg, vocab_size: int) -> int | None:
    """The top-k of a served teacher that does not cover the vocabulary (None: the teacher's
    whole distribution is there: in-process, or k >= V)."""
    te = cfg.teacher
    if te.align == "bytes":
        # the chunk payload is sampled-only (training/teacher_align.py): no top-k at all; the shared-vocabulary
        # path completes the teacher over the student's vocabulary (training/shared_vocab.py): dense
        return None if te.align_vocab == "shared" else 0
    if not te.served:
        return None
    k = te.k if te.k is not None else cfg.estimator.k
    return None if k >= vocab_size else k


@register_teacher_scorer("in_process")
def _in_process(ctx: ScorerContext) -> TeacherScorer:
    if ctx.cfg.teacher.align == "bytes":  # the teacher's own tokens, aligned by byte offsets
        if ctx.cfg.teacher.align_vocab == "shared":  # at one-to-one chunks, over the shared vocabulary + a tail
            from opd_exp.training.shared_vocab import build_shared_vocab_teacher

            return build_shared_vocab_teacher(ctx)
        from opd_exp.training.teacher_align import build_byte_aligned

        return build_byte_aligned(ctx)
    return ctx.in_process()


@register_teacher_scorer("served")
def _served(ctx: ScorerContext) -> TeacherScorer:
    """Connected, checked and self-tested against the in-process teacher before training."""
    if ctx.cfg.teacher.align == "bytes":  # the teacher's own tokens, scored by the server, aligned here
        from opd_exp.training.teacher_served import build_served_byte_aligned

        return build_served_byte_aligned(ctx)
    cfg, V = ctx.cfg, ctx.vocab_size
    local = ctx.in_process() if ctx.model is not None else None
    k = sparse_teacher_k(cfg, V)
    if k is not None:
        ctx.warn(
            f"opd-train: teacher=served sends its top-{k} of {V} tokens: exact/*, teacher/entropy, overlap/* and the eval "
            "divergences (eval/jsd, eval/kl_*, eval/<divergence>) need its whole distribution and are not logged (docs/engines.md)"
        )
    return build_served_teacher(cfg, V, ctx.tokenizer, local, warn=ctx.warn)


@register_teacher_scorer("ema")
def _ema(ctx: ScorerContext) -> TeacherScorer:
    return ctx.in_process(EmaTeacher, decay=ctx.cfg.teacher.decay)


@register_teacher_scorer("lagged")
def _lagged(ctx: ScorerContext) -> TeacherScorer:
    return ctx.in_process(LaggedTeacher, refresh_every=ctx.cfg.teacher.refresh_every)


@register_teacher_scorer("live")
def _live(ctx: ScorerContext) -> TeacherScorer:
    return ctx.in_process(LiveTeacher)


def build_teacher_scorer(
    cfg, model, tokenizer, vocab_size: int, *, device, autocast=contextlib.nullcontext, warn=print, teacher_tokenizer=None
) -> TeacherScorer:
    """``teacher.name``'s registered scorer (``teacher_tokenizer``: the teacher's own, where not the pair's)."""
    build = TEACHER_SCORERS[cfg.teacher.name.value]
    return build(ScorerContext(cfg, model, tokenizer, vocab_size, device, autocast, warn, teacher_tokenizer))
