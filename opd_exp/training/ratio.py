"""PPO's ratio loss against a fixed behaviour, for the updates after a rollout's scoring pass;
one definition for both LM heads (``training/heads.py``, ``training/fused.py``)."""

from __future__ import annotations

import torch

from opd_exp.training.objective import ppo_surrogate


def ratio_terms(s: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, counted: torch.Tensor, eps: float, normalizer: float):
    """PPO's clipped loss on positions ``[.., R]`` from log S(y) ``s`` (with grad): (loss, ratio, clip
    active). Only counted positions: a pad or filtered-out token scored -1e9 before an update may be
    inside the filter after it, and exp(+1e9) = inf would turn the masked gradient NaN."""
    ratio = torch.exp(torch.where(counted, s - old, torch.zeros_like(s)))
    per_token, clip_active = ppo_surrogate(ratio, adv.to(s.dtype), eps)
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    return torch.where(counted, per_token, zero).sum() / max(float(normalizer), 1.0), ratio, clip_active


class Fixed:
    """What a PPO scoring pass fixes for a micro-batch's rows: log S_old(y), advantages, counted."""

    def __init__(self, old_logprobs: torch.Tensor, advantages: torch.Tensor, counted: torch.Tensor):
        self.old_logprobs, self.advantages, self.counted = old_logprobs, advantages, counted
