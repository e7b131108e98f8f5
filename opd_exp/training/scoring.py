"""Scoring: teacher and student forward passes over the same response positions.

``logits[:, i]`` predicts token ``i+1``, so the logits for the R response tokens of a
batch whose responses start at column P are those at columns P-1 .. P+R-2. Both models see
the same ids, attention mask and position ids; logits are sliced to the tokenizer's
vocabulary (embedding tables may be padded: 151936 vs 152064 rows for Qwen2.5).

A teacher scorer returns ``TeacherScores``: dense logits (``InProcessTeacher``) or a sparse
top-k payload (a served teacher, ``training/teacher_served.py``); ``training/teachers.py``
picks one from the ``teacher`` config group.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from opd_exp.training.phases import NullClock
from opd_exp.training.rollout import Batch
from opd_exp.training.sampling import SamplingSpec


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


def student_logits(model, batch: Batch, vocab_size: int, sampling: SamplingSpec) -> torch.Tensor:
    """The student's sampling-distribution logits (tempered + filtered, fp32), with grad."""
    return sampling.logits(response_logits(model, batch, vocab_size))


def response_hidden(model, batch: Batch) -> torch.Tensor:
    """Final hidden states ``[N, R, H]`` at the positions that predict the response tokens
    (the backbone's output, before the LM head: what ``response_logits`` multiplies by W)."""
    R = batch.response_ids.shape[1]
    out = model.base_model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    return out.last_hidden_state[:, -(R + 1) : -1]


def lm_head_logits(hidden: torch.Tensor, head: torch.nn.Linear, vocab_size: int) -> torch.Tensor:
    """``hidden @ W[:V].T + b[:V]``: the head's logits over the tokenizer's vocabulary only."""
    bias = None if head.bias is None else head.bias[:vocab_size]
    return torch.nn.functional.linear(hidden, head.weight[:vocab_size], bias)


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
    dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32  # fp32 at least; fp64 stays fp64
    out = torch.empty(flat.shape[0], dtype=dtype, device=flat.device)
    for start in range(0, flat.shape[0], chunk_rows):
        lp = torch.log_softmax(flat[start : start + chunk_rows].to(dtype), dim=-1)
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


class Feed(enum.Enum):
    """What a teacher's scores can feed: the objective, the monitors and the start-up checks ask
    this, never which scorer made them."""

    dense = "dense"  # logits over the whole vocabulary: every estimator and exact metric
    topk = "topk"  # top-k ids + log-probs and the sampled token's log-prob (a served teacher)
    sampled = "sampled"  # the sampled token's log-prob only


@dataclass(frozen=True)
class TeacherScores:
    """What a teacher scorer returns for the R response positions of a batch.

    Dense (in-process): ``logits`` ``[N, R, V]``, the teacher's logits divided by the divergence
    temperature (fp32, no grad). Sparse (a served teacher): per position the ids ``[N, R, k]`` of
    the teacher's top-k tokens (by rank), their log-probs normalised over the WHOLE vocabulary,
    and the log-prob of the sampled token ``[N, R]``: what ``divergences.topk_estimate`` needs,
    exact on the top-k and unbiased in the tail at any k. Positions outside the response mask
    hold finite filler."""

    logits: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    sampled_logprobs: torch.Tensor | None = None

    @property
    def dense(self) -> bool:
        return self.logits is not None

    @property
    def feeds(self) -> Feed:
        if self.logits is not None:
            return Feed.dense
        return Feed.topk if self.topk_ids is not None else Feed.sampled

    @property
    def k(self) -> int:
        """Top-k size of a sparse payload."""
        return int(self.topk_ids.shape[-1])

    def token_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """log T(y_t) of the sampled tokens ``ids`` ``[N, R]``."""
        return token_logprobs(self.logits, ids) if self.dense else self.sampled_logprobs

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, ids) of the teacher's top-k, normalised over the whole vocabulary."""
        if self.dense:
            return teacher_topk(self.logits, k)
        if k > self.k:
            raise ValueError(f"TeacherScores: top-{k} asked of a payload that holds the top-{self.k}")
        return self.topk_logprobs[..., :k], self.topk_ids[..., :k]

    def against(self, student_z: torch.Tensor) -> TeacherScores:
        """The scores the objective uses beside the student's logits ``student_z``: these scores
        themselves, except a payload completed with the student's own distribution (a teacher over
        another vocabulary, ``training/shared_vocab.py``)."""
        return self

    def finite_check(self) -> torch.Tensor:
        """The tensor whose entries must all be finite for the loss to be."""
        if self.dense:
            return self.logits
        return torch.cat([x.flatten() for x in (self.topk_logprobs, self.sampled_logprobs) if x is not None])  # a sampled-only payload too

    def to(self, device) -> TeacherScores:
        move = lambda x: None if x is None else x.to(device)
        return TeacherScores(move(self.logits), move(self.topk_ids), move(self.topk_logprobs), move(self.sampled_logprobs))


def dense_from_topk(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[..., V]`` log-probs from a top-k payload whose k covers the whole vocabulary: exact
    (log-probs are logits whose log-softmax is themselves). Refuses a payload with a gap."""
    out = torch.full((*topk_ids.shape[:-1], vocab_size), float("nan"), dtype=topk_logprobs.dtype, device=topk_logprobs.device)
    out.scatter_(-1, topk_ids, topk_logprobs)
    if torch.isnan(out).any():
        raise ValueError(f"dense_from_topk: the top-{topk_ids.shape[-1]} payload does not cover all {vocab_size} tokens at every position")
    return out


class Pending:
    """A teacher score on its way: ``result()`` waits for it (and raises its error)."""

    def __init__(self, compute: Callable[[], TeacherScores]):
        self._compute = compute

    def result(self) -> TeacherScores:
        return self._compute()

    def cancel(self) -> None:
        """Give up on a score not yet needed (a step that stops early)."""


class TeacherScorer(abc.ABC):
    """Scores a batch with the teacher at the positions that predict every response token.

    A scorer may hold state that changes with the student (a teacher made from it: EMA, lagged;
    ``training/teacher_student.py``): ``sync`` is called after every applied update (each PPO
    update counts), and ``state_dict`` / ``load_state_dict`` travel in every checkpoint, so a
    resumed run scores as the uninterrupted one would. A frozen teacher keeps the defaults."""

    # the scores cover the teacher's whole distribution (dense, or k >= V): exact metrics exist
    full_distribution: bool = True
    # times the teacher's work (perf/teacher_s; training/phases.py); set by the trainer
    clock = NullClock()

    def set_clock(self, clock) -> None:
        self.clock = clock

    def sync(self, student, step: int) -> None:  # noqa: B027 - a frozen teacher has nothing to follow
        """After the update that made ``step`` (the student's weights as they are now)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors a checkpoint must carry (empty: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint holds teacher state ({len(state)} tensors)")

    def metrics(self) -> dict[str, float]:
        """Per-step readings of the scorer itself (``self/*``: a teacher made from the student)."""
        return {}

    @abc.abstractmethod
    def score(self, batch: Batch) -> TeacherScores:
        """The batch's ``TeacherScores`` on the batch's device."""

    def submit(self, batch: Batch) -> Pending:
        """Start scoring ``batch``; the default scores when the result is asked for (an
        in-process teacher holds no [N, R, V] logits before they are needed). A served teacher
        sends the request now, so the trainer's work on earlier micro-batches overlaps it."""
        return Pending(lambda: self.score(batch))

    def identity(self) -> dict[str, Any]:
        """What identifies the teacher beyond the config (fingerprinted, in the run record)."""
        return {}

    def close(self) -> None:  # noqa: B027 - most scorers hold nothing to release
        """Release connections and threads."""


class InProcessTeacher(TeacherScorer):
    """The teacher as a module in this process, possibly on another device than the student."""

    def __init__(self, model, vocab_size: int, *, temperature: float, device, autocast=contextlib.nullcontext):
        self.model, self.vocab_size, self.temperature = model, vocab_size, temperature
        self.device, self.autocast = torch.device(device), autocast
        self._gain = [0.0, 0]  # self/privileged_gain: sum over the student's tokens, count

    def score(self, batch: Batch) -> TeacherScores:
        z = self.logits(batch)
        if batch.teacher_view is not None:  # what the privileged context adds: log T(y | x, c) - log T(y | x)
            with torch.no_grad():
                y, m = batch.response_ids, batch.trained_mask.bool()
                gain = token_logprobs(z, y) - token_logprobs(self.logits(batch, view=False), y)
                self._gain[0] += float(gain[m].double().sum())
                self._gain[1] += int(m.sum())
        return TeacherScores(logits=z)

    def metrics(self) -> dict[str, float]:
        total, n = self._gain
        self._gain = [0.0, 0]
        return {"self/privileged_gain": total / n} if n else {}

    def logits(self, batch: Batch, *, view: bool = True) -> torch.Tensor:
        """``[N, R, V]`` teacher logits divided by the divergence temperature (fp32, no grad),
        on the batch's device, of the teacher's view of the rows (``Batch.teacher_input``; with
        ``view=False``: of the student's own prompt)."""
        batch = batch.teacher_input if view else batch
        where = batch.input_ids.device
        with self.clock("teacher"), self.autocast():
            if where == self.device:
                return teacher_logits(self.model, batch, self.vocab_size, temperature=self.temperature)
            return teacher_logits(self.model, batch.to(self.device), self.vocab_size, temperature=self.temperature).to(where)

    # The fused head's view of the same teacher (training/fused.py): the backbone's output at the
    # response positions, then the head a chunk of positions at a time (no [N, R, V] logits).
    @torch.no_grad()
    def hidden(self, batch: Batch) -> torch.Tensor:
        batch = batch.teacher_input
        with self.clock("teacher"), self.autocast():
            return response_hidden(self.model, batch if batch.input_ids.device == self.device else batch.to(self.device))

    @torch.no_grad()
    def chunk_logits(self, hidden: torch.Tensor, where) -> torch.Tensor:
        """Teacher logits of a chunk divided by the divergence temperature (fp32, no grad)."""
        with self.clock("teacher"), self.autocast():
            z = lm_head_logits(hidden, self.model.get_output_embeddings(), self.vocab_size).float()
        z = z / self.temperature if self.temperature != 1.0 else z
        return z.to(where)
