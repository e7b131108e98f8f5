"""Evaluation: greedy accuracy through a rollout engine, and the exact eval divergences.

One path for every caller: the trainer (``eval/*`` metrics, the teacher's accuracy) and
``opd-prepare`` (the accuracy stored with a prepared pair) decode the same way — prompts
rendered by the task, left padding, the response cut at the first EOS of the model's
generation config or tokenizer — so their numbers agree on any pair.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from opd_exp.divergences import Divergence
from opd_exp.training.rollout import Batch, HfRollout, RolloutEngine, decode_responses
from opd_exp.training.scoring import TeacherScorer

# opd-prepare checks models on short prompts of its own task: no cut needed
UNCAPPED_PROMPT_TOKENS = 1 << 20


def greedy_batches(engine: RolloutEngine, tokenizer, task, problems: Sequence[Any], batch_size: int) -> Iterator[tuple[list, Batch]]:
    """(problems, greedy batch) in chunks of ``batch_size``."""
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start : start + batch_size])
        prompts = [task.render_prompt(p, tokenizer) for p in chunk]
        yield chunk, engine.generate(prompts, greedy=True)


def accuracy(engine: RolloutEngine, tokenizer, task, problems: Sequence[Any], batch_size: int, *, return_completions: bool = False) -> dict:
    """Greedy accuracy and format rate (share of completions whose answer parses)."""
    if not problems:
        return {"accuracy": 0.0, "format_rate": 0.0, "n": 0}
    completions: list[str] = []
    correct = formatted = 0
    for chunk, batch in greedy_batches(engine, tokenizer, task, problems, batch_size):
        texts = decode_responses(tokenizer, batch)
        completions += texts
        correct += sum(bool(task.verify(t, p.answer)) for t, p in zip(texts, chunk))
        formatted += sum(task.extract_answer(t) is not None for t in texts)
    n = len(problems)
    out = {"accuracy": correct / n, "format_rate": formatted / n, "n": n}
    if return_completions:
        out["completions"] = completions
    return out


def evaluate_accuracy(
    model, tokenizer, task, problems: Sequence[Any], batch_size: int = 64, max_new_tokens: int = 64, return_completions: bool = False
) -> dict:
    """Greedy accuracy of a bare model (``opd-prepare``, benchmarks): an HF engine around it."""
    from types import SimpleNamespace

    ro = SimpleNamespace(max_new_tokens=max_new_tokens, max_prompt_tokens=UNCAPPED_PROMPT_TOKENS, temperature=1.0, top_k=0, top_p=1.0)
    engine = HfRollout(model, tokenizer, ro, vocab_size=len(tokenizer))
    return accuracy(engine, tokenizer, task, problems, batch_size, return_completions=return_completions)


class Evaluator:
    """``eval/accuracy`` of the student's greedy responses, and on the same responses the exact
    divergences over the vocabulary (same S and T as the objective), per response token."""

    def __init__(
        self,
        task,
        tokenizer,
        problems: Sequence[Any],
        *,
        batch_size: int,
        divergences: dict[str, Divergence],
        student_logits: Callable[[Batch], torch.Tensor],
        teacher: TeacherScorer,
        chunk_size=None,
        on_prompts: Callable[[list[str]], Any] | None = None,
    ):
        self.task, self.tokenizer, self.problems, self.batch_size = task, tokenizer, list(problems), batch_size
        self.divergences, self.student_logits, self.teacher, self.chunk_size = divergences, student_logits, teacher, chunk_size
        self.on_prompts = on_prompts  # sees every rendered prompt (the trainer counts over-long ones)

    def _batches(self, engine):
        for chunk, batch in greedy_batches(engine, self.tokenizer, self.task, self.problems, self.batch_size):
            if self.on_prompts is not None:
                self.on_prompts([self.task.render_prompt(p, self.tokenizer) for p in chunk])
            yield chunk, batch

    def accuracy(self, engine: RolloutEngine) -> float:
        correct = 0
        for chunk, batch in self._batches(engine):
            texts = decode_responses(self.tokenizer, batch)
            correct += sum(bool(self.task.verify(t, p.answer)) for t, p in zip(texts, chunk))
        return correct / max(len(self.problems), 1)

    @torch.no_grad()
    def __call__(self, engine: RolloutEngine, device) -> dict[str, float]:
        correct, n_tok, sums = 0, 0, defaultdict(float)
        for chunk, batch in self._batches(engine):
            batch = batch.to(device)
            texts = decode_responses(self.tokenizer, batch)
            correct += sum(bool(self.task.verify(t, p.answer)) for t, p in zip(texts, chunk))
            zt = self.teacher.logits(batch)
            zs = self.student_logits(batch)
            m = batch.response_mask.bool()
            for name, d in self.divergences.items():
                sums[name] += float(d.full(zs, zt, mask=m, chunk_size=self.chunk_size).sum())
            n_tok += batch.num_response_tokens
        out = {k: v / max(n_tok, 1) for k, v in sums.items()}
        out["eval/accuracy"] = correct / max(len(self.problems), 1)
        return out
