"""Scoring: teacher and student forward passes over the same response positions.

``logits[:, i]`` predicts token ``i+1``, so the logits for the R response tokens of a
batch whose responses start at column P are those at columns P-1 .. P+R-2. Both models see
the same ids, attention mask and position ids; logits are sliced to the tokenizer's
vocabulary (embedding tables may be padded: 151936 vs 152064 rows for Qwen2.5).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch

from opd_exp.training.rollout import Batch, sampling_logits


def response_logits(model, batch: Batch, vocab_size: int) -> torch.Tensor:
    """Raw logits ``[N, R, V]`` at the positions that predict the response tokens."""
    R = batch.response_ids.shape[1]
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=R + 1,  # only the positions we need go through the LM head
        use_cache=False,
    )
    logits = out.logits[:, -(R + 1) : -1]
    return logits[..., :vocab_size]


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at ``ids`` without materialising the [.., V] log-probs."""
    return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def student_logits(model, batch: Batch, vocab_size: int, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The student's sampling-distribution logits (tempered + filtered, fp32), with grad."""
    return sampling_logits(response_logits(model, batch, vocab_size), temperature, top_k, top_p)


@torch.no_grad()
def teacher_logits(model, batch: Batch, vocab_size: int, *, temperature: float) -> torch.Tensor:
    """The teacher's logits divided by the divergence temperature (fp32, no grad)."""
    z = response_logits(model, batch, vocab_size).float()
    return z / temperature if temperature != 1.0 else z


def teacher_topk(teacher_z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher log-probs (normalised over the whole vocabulary) and ids of its top-k."""
    k = min(k, teacher_z.shape[-1])
    vals, ids = torch.topk(teacher_z, k, dim=-1)
    return vals - torch.logsumexp(teacher_z, dim=-1, keepdim=True), ids


@torch.no_grad()
def entropy(logits: torch.Tensor, chunk_rows: int = 4096) -> torch.Tensor:
    """Exact entropy per position of softmax(logits), computed a chunk of rows at a time."""
    lead, V = logits.shape[:-1], logits.shape[-1]
    flat = logits.detach().reshape(-1, V)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], chunk_rows):
        lp = torch.log_softmax(flat[start : start + chunk_rows].float(), dim=-1)
        out[start : start + chunk_rows] = -(lp.exp() * lp).sum(-1)
    return out.reshape(lead)


def _checkpointed(module) -> bool:
    return bool(getattr(module, "gradient_checkpointing", False))


@contextlib.contextmanager
def dropout_off(model) -> Iterator[None]:
    """Score with dropout off while keeping gradients: every module in eval mode (nn.Dropout,
    LoRA dropout and the attention dropout HF gates on ``self.training``) except the layers
    that checkpoint activations, which check ``self.training`` to recompute in backward.
    Wrap forward AND backward: the recompute must see the same modes. Restores each
    module's own mode afterwards (generate and evaluation toggle the whole model)."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in modes:
            m.training = _checkpointed(m) and m.training
        yield
    finally:
        for m, mode in modes:
            m.training = mode


class TeacherScorer(abc.ABC):
    """Scores a batch with the frozen teacher: the logits that predict every response token."""

    @abc.abstractmethod
    def logits(self, batch: Batch) -> torch.Tensor:
        """``[N, R, V]`` teacher logits divided by the divergence temperature (fp32, no grad),
        on the batch's device."""


class InProcessTeacher(TeacherScorer):
    """The teacher as a module in this process, possibly on another device than the student."""

    def __init__(self, model, vocab_size: int, *, temperature: float, device, autocast=contextlib.nullcontext):
        self.model, self.vocab_size, self.temperature = model, vocab_size, temperature
        self.device, self.autocast = torch.device(device), autocast

    def logits(self, batch: Batch) -> torch.Tensor:
        where = batch.input_ids.device
        with self.autocast():
            if where == self.device:
                return teacher_logits(self.model, batch, self.vocab_size, temperature=self.temperature)
            return teacher_logits(self.model, batch.to(self.device), self.vocab_size, temperature=self.temperature).to(where)
