"""Sequence-level credit: per-token returns for the objective summed along student prefixes.

With per-token costs only, REINFORCE follows the gradient of sum_t D_t with the prefix
frozen (the GKD objective). The sequence objective J = E_{y~S}[sum_t D_t(y_<t)] also
moves the prefix distribution, which adds the future divergence as a return:

    R_t = c_t + sum_{t' > t} gamma^(n(t, t')) * v_t'

n(t, t') the masked (trained) positions in (t, t']: positions outside the mask (an episode's
environment tokens) neither add a value nor advance the discount, so gamma discounts by the
student's own tokens. With v_t' an unbiased *value* estimate of D_t' (for rkl v = c, so R is the usual reward-to-go
of the sequence KL; for jsd v != c because JSD has no chain rule). gamma=1 gives the exact
gradient of J, gamma=0 the prefix-frozen one. J equals the divergence between whole-sequence
distributions only for rkl (KL's chain rule); for the others it is J itself that is followed.
Under a top-k / top-p filter the values must include the filtered mass (``filtered_value``).
"""

from __future__ import annotations

import torch


def sequence_returns(
    costs: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token returns ``R_t = c_t + sum_{t'>t, same sequence} gamma^(n(t,t')) v_t'``, n(t, t')
    the masked positions in (t, t'] (a gap in the mask, e.g. environment tokens, is not a step).

    Args:
        costs, values, mask: ``[B, T]`` (padded rows; mask marks the trained response tokens).
        gamma: discount in [0, 1].
        segment_ids: ``[B, T]`` ids of packed sequences; the future sum never crosses a
            change of id. ``None`` means one sequence per row.

    Returns ``[B, T]`` returns, 0 at masked positions.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} is out of range; allowed: 0 <= gamma <= 1")
    mask = mask.bool()
    zero = torch.zeros((), dtype=costs.dtype, device=costs.device)
    if gamma == 0.0:
        return torch.where(mask, costs, zero)
    v = torch.where(mask, values, zero).detach()
    T = costs.shape[-1]
    future = torch.zeros_like(v)
    acc = torch.zeros_like(v[..., 0])  # A_{t+1} = sum_{t' >= t+1} gamma^(n(t+1, t')) v_t'
    for i in range(T - 1, -1, -1):
        if i < T - 1:
            if segment_ids is not None:
                acc = torch.where(segment_ids[..., i] == segment_ids[..., i + 1], acc, zero)
            future[..., i] = gamma * acc
        # a masked-out position passes the sum through undiscounted (its own value is 0)
        acc = torch.where(mask[..., i], v[..., i] + future[..., i], acc)
    return torch.where(mask, costs + future, zero)
