"""The teacher scorer, picked once from the ``teacher`` config group: the pair's teacher in this
process (dense logits), or a served one (top-k log-probs from a vLLM server; docs/engines.md)."""

from __future__ import annotations

import contextlib

from opd_exp.training.scoring import InProcessTeacher, TeacherScorer
from opd_exp.training.teacher_served import build_served_teacher


def sparse_teacher_k(cfg, vocab_size: int) -> int | None:
    """The top-k of a served teacher that does not cover the vocabulary (None: the teacher's
    whole distribution is there: in-process, or k >= V)."""
    te = cfg.teacher
    if not te.served:
        return None
    k = te.k if te.k is not None else cfg.estimator.k
    return None if k >= vocab_size else k


def build_teacher_scorer(cfg, model, tokenizer, vocab_size: int, *, device, autocast=contextlib.nullcontext, warn=print) -> TeacherScorer:
    """``teacher``: the pair's teacher in this process, or a served one (connected, checked and
    self-tested against the in-process teacher before training)."""
    local = None
    if model is not None:
        local = InProcessTeacher(model, vocab_size, temperature=cfg.divergence.temperature, device=device, autocast=autocast)
    if not cfg.teacher.served:
        return local
    k = sparse_teacher_k(cfg, vocab_size)
    if k is not None:
        warn(
            f"opd-train: teacher=served sends its top-{k} of {vocab_size} tokens: exact/*, teacher/entropy, overlap/* and the eval "
            "divergences (eval/jsd, eval/kl_*, eval/<divergence>) need its whole distribution and are not logged (docs/engines.md)"
        )
    return build_served_teacher(cfg, vocab_size, tokenizer, local, warn=warn)
