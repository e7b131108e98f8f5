"""Token-mean reductions over response positions.

Every metric and loss in opd-exp is a *per-token mean*: sum over response tokens divided by
the number of response tokens (never a per-sequence sum, which grows with length). An
empty mask gives 0, not NaN.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is true; masked entries may hold inf/NaN safely."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | float | None = None) -> torch.Tensor:
    """Per-token mean ``sum(x * mask) / max(count, 1)``.

    ``count`` defaults to ``mask.sum()``; pass the global token count of a step to make
    gradient accumulation over micro-batches equal one large batch.
    """
    if count is None:
        count = mask.sum()
    count = torch.as_tensor(count, dtype=x.dtype, device=x.device)
    return masked_sum(x, mask) / count.clamp(min=1)
