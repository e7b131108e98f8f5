"""The ``Batch``: what every rollout engine hands the trainer, and the one place its fields are
sliced and moved (a field added here travels through micro-batches, PPO's mini-batches and the
device move without another edit).

Layout: prompts left-padded to a common length P, so column P is every row's first response
token and ``logits[:, i]`` (which predicts token i+1) lines up across rows.

Two masks over the response columns ``[N, R]``, kept apart because they answer two questions:
- ``response_mask``: the episode's layout, every position the teacher scores (up to and including
  the first EOS; positional, never by token id: masking by id would let the student emit padding
  for free);
- ``loss_mask``: the positions the student wrote itself, the only ones it is trained on. Equal to
  ``response_mask`` for one-turn rollouts; an episode's environment tokens are 0 here (scored,
  never trained).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


class Source(str, enum.Enum):
    """Who sampled a batch's responses: the student (on-policy) or the teacher (GKD's lambda < 1)."""

    student = "student"
    teacher = "teacher"


@dataclass
class Batch:
    """Prompt+response token ids of N sequences, response-aligned at column ``prompt_len``."""

    input_ids: torch.Tensor  # [N, P+R]
    attention_mask: torch.Tensor  # [N, P+R]: 0 on left padding of the prompt
    position_ids: torch.Tensor  # [N, P+R]: positions as generate used them
    prompt_len: int  # P
    response_mask: torch.Tensor  # [N, R] bool: the layout, up to and including the first EOS
    prompt_index: torch.Tensor  # [N] index of each row's problem in the step's prompt list
    source: Source = Source.student
    # [N, R] log-probs of the sampled tokens as the rollout ENGINE computed them (HF: from
    # generate's processed scores; vLLM: its processed log-probs; None for greedy batches):
    # compared with the trainer's (rollout/logprob_gap), never trained on
    sampling_logprobs: torch.Tensor | None = None
    # [N, R] the reward's advantage of each row on its response positions (reward.coef > 0,
    # training/reward.py), added to the distillation advantage; None without a reward
    reward_advantages: torch.Tensor | None = None
    # [N] which teacher scores each row (teachers.map, training/routing.py); None: the one teacher
    route: torch.Tensor | None = None
    # [N, R] bool: the tokens the student wrote (trained); None: every response position
    loss_mask: torch.Tensor | None = None
    # the same rows as the TEACHER is asked them (teacher.privileged: its own prompt, the same
    # response columns); None: the teacher sees what the student sees. The student never reads it
    teacher_view: Batch | None = None
    # [N, R] log B(y) of the policy that sampled a stale rollout (rollout.staleness > 0: the
    # producer's engine log-probs), for the correction's importance weights; None: sampled by the
    # weights being trained
    behaviour_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.source = Source(self.source)  # "student"/"teacher" from older callers
        if self.loss_mask is not None and self.loss_mask.shape != self.response_mask.shape:
            raise ValueError(f"Batch: loss_mask {tuple(self.loss_mask.shape)} is not the response mask's {tuple(self.response_mask.shape)}")

    @classmethod
    def from_responses(
        cls,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response: torch.Tensor,
        eos_ids: Sequence[int],
        *,
        n_samples: int = 1,
        source: Source | str = Source.student,
        sampling_logprobs: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> Batch:
        """The layout every engine hands the trainer, from left-padded prompts ``[N, P]`` (ids and
        mask), the sampled ``response`` ids ``[N, R]`` (pad after a row's end) and the EOS ids;
        rows prompt-major, ``n_samples`` per prompt. ``lengths`` [N]: how many tokens each row
        sampled (an engine whose rows stop early; an empty response counts no token).
        ``sampling_logprobs`` [N, R]: the engine's log-probs of its samples, kept on the response
        mask (0 elsewhere: after a row's end no sample was drawn)."""
        device = response.device
        response_mask = response_mask_from_ids(response, eos_ids)
        if lengths is not None:
            response_mask &= torch.arange(response.shape[1], device=device)[None, :] < lengths.to(device)[:, None]
        full_mask = torch.cat([prompt_mask.to(device), torch.ones_like(response)], dim=1)
        return cls(
            input_ids=torch.cat([prompt_ids.to(device), response], dim=1),
            attention_mask=full_mask,
            position_ids=positions_from_mask(full_mask),
            prompt_len=prompt_ids.shape[1],
            response_mask=response_mask,
            prompt_index=torch.arange(response.shape[0] // n_samples, device=device).repeat_interleave(n_samples),
            source=Source(source),
            sampling_logprobs=None if sampling_logprobs is None else sampling_logprobs.masked_fill(~response_mask, 0.0),
        )

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_response_tokens(self) -> int:
        """Response positions (the layout): what the teacher scores."""
        return int(self.response_mask.sum())

    @property
    def trained_mask(self) -> torch.Tensor:
        """``loss_mask`` where set, else the response mask (one-turn rollouts): what the loss counts."""
        return self.response_mask if self.loss_mask is None else self.loss_mask

    @property
    def num_trained_tokens(self) -> int:
        """The student's own tokens: what the loss is trained on and divided by."""
        return int(self.trained_mask.sum())

    @property
    def on_policy(self) -> bool:
        return self.source is Source.student

    @property
    def teacher_input(self) -> Batch:
        """What a teacher scores: its own view of the rows where it has one, else the rows."""
        return self if self.teacher_view is None else self.teacher_view

    def _map_rows(self, fn) -> Batch:
        """``fn`` applied to every per-row tensor field (dim 0 = rows); the rest kept."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
            elif isinstance(value, Batch):
                changes[f.name] = value._map_rows(fn)
        return dataclasses.replace(self, **changes)

    def select(self, rows: torch.Tensor | slice) -> Batch:
        """The rows ``rows`` (whole sequences, same padding)."""
        return self._map_rows(lambda t: t[rows])

    def to(self, device) -> Batch:
        return self._map_rows(lambda t: t.to(device))

    def micro_batches(self, size: int) -> Iterator[Batch]:
        """Whole sequences in slices of ``size`` rows (0: one slice); sequence credit stays intact."""
        n = self.num_sequences
        size = n if size <= 0 else size
        for start in range(0, n, size):
            yield self.select(slice(start, start + size))


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding (what generate uses for a left-padded batch)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def response_mask_from_ids(response_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """True up to and including the first EOS of each row (all True when there is none)."""
    eos = torch.tensor(list(eos_ids), device=response_ids.device)
    is_eos = torch.isin(response_ids, eos).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # EOS strictly before this position
    return eos_before == 0
