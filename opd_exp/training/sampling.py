"""The sampling distribution of a rollout: logits / temperature, then top-k, then top-p (HF's
order and rules), nothing else.

Every engine draws from it and the trainer scores the student's tokens under it, so the
log-probs in every REINFORCE/PPO term are those of the distribution the tokens were drawn
from. ``SamplingSpec`` carries the three settings from ``rollout`` to every place that needs
them (engines, the LM heads, scoring) as one value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Filtered-out entries get this logit instead of -inf: exp() still gives exactly 0, and
# 0 * log-prob stays finite (no NaN) in the divergence code.
FILTERED_LOGIT = -1e9


def sampling_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The logits of the distribution actually sampled from (fp32, or fp64 if given): tempered,
    then filtered."""
    z = logits if logits.dtype == torch.float64 else logits.float()
    if temperature != 1.0:
        z = z / temperature
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, FILTERED_LOGIT)
    if top_p < 1.0:
        # HF TopPLogitsWarper: drop the lowest tokens whose cumulative mass is <= 1 - top_p,
        # always keeping the most likely one.
        sorted_z, order = torch.sort(z, dim=-1, descending=False)
        cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, FILTERED_LOGIT)
    return z


@dataclass(frozen=True)
class SamplingSpec:
    """What a rollout samples from (the defaults: the model's own distribution). Ranges are
    checked where the ``rollout`` config is built (``RolloutConfig``)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    @classmethod
    def from_rollout(cls, rollout) -> SamplingSpec:
        """The ``rollout`` config's temperature, top_k and top_p."""
        return cls(temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p)

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p removes tokens (the student side of D is then the filtered distribution)."""
        return self.top_p < 1.0 or self.top_k > 0

    def logits(self, raw: torch.Tensor) -> torch.Tensor:
        """The sampling distribution's logits from the model's ``raw`` logits (``sampling_logits``)."""
        return sampling_logits(raw, self.temperature, self.top_k, self.top_p)


def row_generators(seeds: Sequence[int], device) -> list[torch.Generator]:
    """One generator per row, keyed by its seed (taken modulo 2**63, torch's seed range)."""
    return [torch.Generator(device=device).manual_seed(int(s) % (2**63)) for s in seeds]


def gumbel_noise(shape: tuple[int, int], generators: Sequence[torch.Generator] | None, device) -> torch.Tensor:
    """Standard Gumbel noise [rows, V]: row i from ``generators[i]``, or all rows from torch's
    global RNG (seeded per step by the trainer)."""
    rows, V = shape
    if generators is None:
        u = torch.rand(rows, V, device=device)
    else:
        u = torch.stack([torch.rand(V, generator=g, device=device) for g in generators])
    return -torch.log(-torch.log(u.clamp(min=1e-20, max=1.0 - 1e-7)))


def draw(z: torch.Tensor, generators: Sequence[torch.Generator] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The one seeded draw every in-process decoder makes: Gumbel-max over the sampling logits
    ``z`` [N, V] (argmax(z + G) is a draw from softmax(z); filtered entries are never chosen).
    Returns the tokens [N] and their log-probs under softmax(z) [N]."""
    choice = (z + gumbel_noise(tuple(z.shape), generators, z.device)).argmax(-1)
    return choice, z.gather(-1, choice[:, None]).squeeze(-1) - torch.logsumexp(z, -1)
