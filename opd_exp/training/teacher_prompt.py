"""The teacher's own view of a batch (``teacher.privileged``): the problem plus privileged context
(the task's worked solution or final answer) in the TEACHER's prompt, the student's response
tokens unchanged after it. The student samples and is trained on its own prompt; only the teacher
scorer reads ``Batch.teacher_view``.

Alignment: the view is laid out exactly as a rollout (left-padded prompts, response at column
P'), so ``logits[:, P'-1 .. P'+R-2]`` of the view predict the same R response tokens as the
student's ``logits[:, P-1 .. P+R-2]``: every response position is scored exactly once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opd_exp.training.batch import Batch, positions_from_mask

PROMPT_CAP_FACTOR = 4  # the teacher's prompt may hold this many times rollout.max_prompt_tokens


def with_context(problem, kind: str):
    """``problem`` whose prompt carries the privileged context (``solution`` | ``answer``) before the
    problem, so it ends as the student's does (the default teacher prompt, and the embedded
    self-distillation world's SFT data: opd_exp/pairs/embedded/privileged.py)."""
    context = {"solution": f"Reference solution: {problem.solution}", "answer": f"Reference answer: {problem.answer}"}[kind]
    return dataclasses.replace(problem, prompt=f"{context}\n\n{problem.prompt}")


def privileged_prompt(task, problem, kind: str, tokenizer) -> str:
    """The teacher's rendered prompt: the task's own (``task.privileged_prompt``) or the default
    (``with_context``)."""
    own = getattr(task, "privileged_prompt", None)
    if own is not None:
        return own(problem, kind, tokenizer)
    return task.render_prompt(with_context(problem, kind), tokenizer)


def own_template(student_tokenizer, teacher_tokenizer):
    """The tokenizer whose chat template renders a teacher's prompt: the teacher's own where it has a
    template that is not the student's (Qwen's system turn); None: the student's rendering (one
    template, or a teacher without one, such as a base model)."""
    template = getattr(teacher_tokenizer, "chat_template", None)
    return teacher_tokenizer if template and template != getattr(student_tokenizer, "chat_template", None) else None


class TeacherPrompt:
    """Attaches ``teacher_view`` to a batch whose rows come from ``problems`` (by ``prompt_index``):
    the privileged context (``teacher.privileged``), and a teacher with another tokenizer's own chat
    template (``render_with``: row's teacher index -> the tokenizer that renders its prompt, None for
    the student's). The view's ids are the student tokenizer's of that text, which a byte-aligned
    teacher decodes back to it (``training/teacher_align.py``). With neither, the batch as it is."""

    def __init__(
        self,
        task,
        tokenizer,
        kind: str,
        max_prompt_tokens: int,
        warn: Callable[[str], None] = print,
        render_with: Callable[[int], Any] | None = None,
    ):
        self.task, self.tokenizer, self.kind = task, tokenizer, kind
        self.cap, self.warn, self._warned = PROMPT_CAP_FACTOR * max_prompt_tokens, warn, False
        self._render_with, self._rendering = render_with or (lambda k: None), {}

    def render_with(self, k: int):
        """Teacher ``k``'s rendering tokenizer, asked once (comparing vocabularies is not per-step work)."""
        if k not in self._rendering:
            self._rendering[k] = self._render_with(k)
        return self._rendering[k]

    @classmethod
    def from_config(cls, cfg, task, tokenizer, warn=print, render_with=None) -> TeacherPrompt:
        out = cls(task, tokenizer, cfg.teacher.privileged.value, cfg.rollout.max_prompt_tokens, warn, render_with)
        out.preflight(len(cfg.teachers.map) if cfg.teachers.active else 1)
        return out

    def preflight(self, n_teachers: int) -> None:
        """Every train and eval problem rendered for each teacher with a template of its own, checked now
        (before the first step) rather than when its row first comes up."""
        for k in range(n_teachers):
            tok = self.render_with(k)
            if tok is not None:
                for problem in [*self.task.train_problems(), *self.task.eval_problems()]:
                    self._check_kept(self.text(problem, tok))

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def attach(self, batch: Batch, problems: Sequence[Any]) -> Batch:
        routes = [0] * batch.num_sequences if batch.route is None else batch.route.tolist()
        render = [self.render_with(int(k)) for k in routes]
        if not self.active and all(tok is None for tok in render):
            return batch
        from opd_exp.training.rollout import encode_prompts

        rows = batch.prompt_index.tolist()
        rendered: dict[tuple[int, int], str] = {}  # a prompt's n samples share one rendering (kept text: preflight)
        for i, tok in zip(rows, render):
            if (i, id(tok)) not in rendered:
                rendered[i, id(tok)] = self.text(problems[i], tok or self.tokenizer)
        texts = [rendered[i, id(tok)] for i, tok in zip(rows, render)]
        ids, mask = encode_prompts(self.tokenizer, texts, self.cap)
        if not self._warned and any(len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) > self.cap for t in texts):
            self._warned = True
            self.warn(
                f"opd-train: warning: {f'teacher.privileged={self.kind}' if self.active else 'the teacher chat template'}: a teacher "
                f"prompt is longer than {self.cap} tokens "
                f"({PROMPT_CAP_FACTOR} x rollout.max_prompt_tokens) and loses its first tokens (the context)"
            )
        device = batch.input_ids.device
        ids, mask = ids.to(device), mask.to(device)
        response = batch.response_ids
        full_mask = torch.cat([mask, torch.ones_like(response)], dim=1)
        view = Batch(
            input_ids=torch.cat([ids, response], dim=1),
            attention_mask=full_mask,
            position_ids=positions_from_mask(full_mask),
            prompt_len=ids.shape[1],
            response_mask=batch.response_mask,
            prompt_index=batch.prompt_index,
            source=batch.source,
            loss_mask=batch.loss_mask,
        )
        return dataclasses.replace(batch, teacher_view=view)

    def _check_kept(self, text: str) -> None:
        """A prompt rendered by another tokenizer's template travels as the student's ids and is decoded
        back by the byte-aligned teacher: it must come back unchanged (a byte-level BPE keeps any text)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        back = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if back != text:
            from opd_exp.runtime.errors import ConfigError

            raise ConfigError(
                f"the teacher's chat template renders a prompt the student's tokenizer does not keep ({text[:60]!r} comes back "
                f"as {back[:60]!r}); allowed: a student tokenizer that keeps any text (byte-level BPE) or a teacher tokenizer "
                "without a chat template (it then reads the student's rendering)"
            )

    def text(self, problem, tokenizer) -> str:
        """The teacher's rendered prompt of ``problem`` through ``tokenizer``'s chat template."""
        if self.active:
            return privileged_prompt(self.task, problem, self.kind, tokenizer)
        return self.task.render_prompt(problem, tokenizer)
