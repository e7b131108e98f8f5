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


class TeacherPrompt:
    """Attaches ``teacher_view`` to a batch whose rows come from ``problems`` (by ``prompt_index``);
    with ``teacher.privileged=none`` it leaves the batch as it is."""

    def __init__(self, task, tokenizer, kind: str, max_prompt_tokens: int, warn: Callable[[str], None] = print):
        self.task, self.tokenizer, self.kind = task, tokenizer, kind
        self.cap, self.warn, self._warned = PROMPT_CAP_FACTOR * max_prompt_tokens, warn, False

    @classmethod
    def from_config(cls, cfg, task, tokenizer, warn=print) -> TeacherPrompt:
        return cls(task, tokenizer, cfg.teacher.privileged.value, cfg.rollout.max_prompt_tokens, warn)

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def attach(self, batch: Batch, problems: Sequence[Any]) -> Batch:
        if not self.active:
            return batch
        from opd_exp.training.rollout import encode_prompts

        rows = batch.prompt_index.tolist()
        texts = [privileged_prompt(self.task, problems[i], self.kind, self.tokenizer) for i in rows]
        ids, mask = encode_prompts(self.tokenizer, texts, self.cap)
        if not self._warned and any(len(self.tokenizer(t, add_special_tokens=False)["input_ids"]) > self.cap for t in texts):
            self._warned = True
            self.warn(
                f"opd-train: warning: teacher.privileged={self.kind}: a teacher prompt is longer than {self.cap} tokens "
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
