"""Top-k estimators: exact over the teacher's top-k, plus an unbiased tail.

D = sum_{v in K} phi(s_v, t_v) + sum_{v not in K} phi(s_v, t_v). The first sum is computed
exactly (and differentiated exactly); the tail is estimated from the sampled token y ~ S:

    value     = sum_K phi + [y not in K] * phi(y) / S(y)
    surrogate = sum_K phi + stopgrad([y not in K] * score(y)) * log S(y)

E_y[value] = D and E_y[grad surrogate] = grad D at every k (score = d phi / d S; the tail
has no baseline because sum_{v not in K} S_v grad log S_v != 0).

``renormalize=True`` is the ms-swift / NeMo-RL variant: both distributions renormalised over
the teacher's top-k and D computed there. It is biased (it ignores the tail mass and
distorts the kept part) and is offered only under the explicit name ``topk_renorm``.
(verl's top-k losses are neither: full-vocabulary log-probs summed over the union of the
student's and teacher's top-k, i.e. the exact sum above without the tail term.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .catalog import Divergence


def topk_estimate(
    div: Divergence,
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    sampled_ids: torch.Tensor,
    teacher_sampled_logprobs: torch.Tensor,
    *,
    temperature: float = 1.0,
    renormalize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position (surrogate, value).

    Args:
        student_logits: ``[..., V]`` raw student logits (differentiable).
        teacher_topk_logprobs: ``[..., k]`` teacher log-probs (normalised over the full,
            tempered vocabulary) of its top-k ids ``teacher_topk_ids``.
        sampled_ids: ``[...]`` the token y drawn from the student.
        teacher_sampled_logprobs: ``[...]`` teacher log-prob of y.
        temperature: divides the student logits (the teacher's are tempered by the caller).
    """
    z = student_logits.float() if student_logits.dtype in (torch.float16, torch.bfloat16) else student_logits
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    s_k = z.gather(-1, teacher_topk_ids) - lse  # log S on the teacher's top-k
    t_k = teacher_topk_logprobs.to(s_k.dtype)
    if renormalize:
        s_k = torch.log_softmax(s_k, dim=-1)
        t_k = torch.log_softmax(t_k, dim=-1)
        d = div.pointwise(s_k, t_k).sum(-1)
        return d, d.detach()
    head = div.pointwise(s_k, t_k).sum(-1)
    s_y = (z.gather(-1, sampled_ids.unsqueeze(-1)) - lse).squeeze(-1)
    t_y = teacher_sampled_logprobs.to(s_y.dtype)
    in_tail = ~(teacher_topk_ids == sampled_ids.unsqueeze(-1)).any(-1)
    zero = torch.zeros((), dtype=s_y.dtype, device=s_y.device)
    score = torch.where(in_tail, div.token_score(s_y.detach(), t_y), zero)
    tail_value = torch.where(in_tail, div.pointwise_over_prob(s_y.detach(), t_y), zero)
    surrogate = head + score * s_y
    value = head.detach() + tail_value
    return surrogate, value
