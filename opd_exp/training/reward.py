"""Reward + distillation: the task's verifier as a sequence reward, one more advantage term.

Per sampled response i of a prompt with n samples (``rollout.n_samples``), r_i is the task's
score of the decoded response (``task.score(text, problem)`` where the task defines one, else
1 if ``task.verify`` accepts it, 0 if not). Its advantage

    A_i = reward.coef * (r_i - b_i) [/ (std_group(r) + 1e-6)]
    b_i = mean_{j != i} r_j (loo) | mean_j r_j (group) | 0 (none)

is put on every response position of row i (``Batch.reward_advantages``) and added to the
distillation advantage there (-loss.kl_coef * cost for estimator=sampled). Its loss term is
REINFORCE's -A_i log S(y_t) at every counted position, whatever the distillation estimator and
loss form; for loss=ppo it sits inside the clipped surrogate of the combined advantage (PPO's
later updates reuse that stored sum). Signs: the loss minimises

    loss.kl_coef * E[sum_t D_t] - reward.coef * E[r]

so with ``loo`` or ``none`` the reward's expected gradient is exactly -reward.coef * grad E[r];
with ``group`` it is (n-1)/n times that (the sample's own reward in its baseline); with
``std_normalize`` it is GRPO's direction, not a gradient of E[r]. tests/test_reward.py checks all
three by enumeration on a tabular model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from opd_exp.config.reward import RewardBaseline
from opd_exp.runtime import distributed as dist_util
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.rollout import Batch, decode_responses

STD_EPS = 1e-6  # verl's epsilon under the group std
REWARD_METRICS = ("reward/mean", "reward/std", "reward/advantage_mean")


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, baseline: RewardBaseline | str, std_normalize: bool = False
) -> torch.Tensor:
    """Per-row advantage r_i - b_i (see the module docstring) of ``rewards`` [N]; rows with the same
    ``groups`` [N] value are samples of one prompt."""
    baseline = RewardBaseline(baseline)
    r = rewards.double()
    if baseline is RewardBaseline.none:
        return r
    inv = torch.unique(groups, return_inverse=True)[1].to(r.device)

    def per_group(x: torch.Tensor) -> torch.Tensor:  # the group's sum of x, on each of its rows
        return torch.zeros(int(inv.max()) + 1, dtype=r.dtype, device=r.device).index_add_(0, inv, x)[inv]

    size, total = per_group(torch.ones_like(r)), per_group(r)
    if bool((size < 2).any()):
        raise ValueError("group_advantages: a group baseline needs at least 2 samples of every prompt")
    mean = total / size
    adv = r - (total - r) / (size - 1) if baseline is RewardBaseline.loo else r - mean
    if std_normalize:  # the unbiased group std, as torch.std (TRL, verl)
        adv = adv / ((per_group((r - mean) ** 2) / (size - 1)).sqrt() + STD_EPS)
    return adv


def with_reward(
    per_token: torch.Tensor, advantages: torch.Tensor, reward_advantages: torch.Tensor, s: torch.Tensor, *, ppo: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward's term added to the objective's per-token loss and advantages ([N, R] each; ``s``
    = log S(y_t) with grad). REINFORCE: -A_r log S(y_t). PPO: -A_r r with r = exp(s - s.detach()),
    which is 1 here (the objective's forward is the sampling policy): the clipped surrogate of the
    combined advantage has the same value and gradient at r = 1 (min's tie splits the gradient
    evenly between two equal terms), so the sum is exact without re-running the clip."""
    a = reward_advantages.to(s.dtype)
    term = a * (torch.exp(s - s.detach()) if ppo else s)
    return per_token - term, advantages + a.to(advantages.dtype)


def sequence_rewards(task: Any, texts: Sequence[str], problems: Sequence[Any]) -> list[float]:
    """The task's score of each response text against its problem (1/0 from ``verify``, or the
    task's own ``score(text, problem)``)."""
    score = getattr(task, "score", None)
    out = []
    for text, p in zip(texts, problems):
        r = float(score(text, p)) if callable(score) else float(bool(task.verify(text, p.answer)))
        if not math.isfinite(r):
            raise ValueError(f"{type(task).__name__}.score gave {r!r} for a response: a reward must be finite")
        out.append(r)
    return out


class RewardTerm:
    """Scores a step's sampled rows and attaches their advantages to the batch; off (the batch
    returned as it came) when ``reward.coef`` is 0. ``metrics``: the last step's ``reward/*``
    over all ranks (``reward/mean`` is the sampled rollouts' accuracy for a 0/1 verifier)."""

    def __init__(self, cfg, task: Any, tokenizer: Any, dist: Any = None):
        self.cfg, self.task, self.tokenizer, self.dist = cfg.reward, task, tokenizer, dist
        self.n_samples, self.batch_size = cfg.rollout.n_samples, cfg.trainer.batch_size
        self.metrics: dict[str, float] = {}

    def __call__(self, batch: Batch, problems: Sequence[Any]) -> Batch:
        """``batch`` with ``reward_advantages`` [N, R] (0 outside each row's response); ``problems``:
        the step's prompt list, indexed by ``batch.prompt_index``."""
        rw = self.cfg
        if not rw.active:
            return batch
        rows = batch.prompt_index.tolist()
        rewards = torch.tensor(sequence_rewards(self.task, decode_responses(self.tokenizer, batch), [problems[i] for i in rows]))
        if rw.baseline is not RewardBaseline.none:
            self._check_groups(rows)
        adv = rw.coef * group_advantages(rewards, batch.prompt_index.cpu(), rw.baseline, rw.std_normalize)
        r64 = rewards.double()
        sums = [float(r64.sum()), float((r64 * r64).sum()), float(r64.numel()), float(adv.sum())]
        if self.dist is not None and self.dist.active:
            sums = [float(x) for x in dist_util.all_reduce_sum(sums, self.dist)]
        total, sq, n, adv_total = sums
        mean = total / max(n, 1.0)
        self.metrics = {
            "reward/mean": mean,
            "reward/std": math.sqrt(max(sq / max(n, 1.0) - mean * mean, 0.0)),  # over the step's rows
            "reward/advantage_mean": adv_total / max(n, 1.0),  # per row, reward.coef included
        }
        mask = batch.trained_mask  # the reward is credited to the student's own tokens
        per_position = adv.to(device=mask.device, dtype=torch.get_default_dtype()).unsqueeze(-1) * mask.to(torch.get_default_dtype())
        return dataclasses.replace(batch, reward_advantages=per_position)

    def _check_groups(self, rows: list[int]) -> None:
        """Every prompt's n samples in this process's rows (ranks split a step's rows evenly)."""
        counts: dict[int, int] = {}
        for i in rows:
            counts[i] = counts.get(i, 0) + 1
        if any(c != self.n_samples for c in counts.values()):
            world = getattr(self.dist, "world_size", 1)
            raise ConfigError(
                f"trainer.batch_size={self.batch_size} is not allowed with reward.baseline={self.cfg.baseline.value} over {world} "
                f"ranks (a prompt's {self.n_samples} samples would be split between ranks); allowed: a multiple of {world}"
            )
