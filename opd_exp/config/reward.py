"""``reward.*``: the task's verifier as a sequence reward beside the distillation term.

The loss minimises ``loss.kl_coef * E[sum_t D_t] - reward.coef * E[r]`` (docs/training.md,
"Reward + distillation"); ``reward.coef=0`` (the default) leaves a run exactly as it was, and
``loss.kl_coef=0`` with ``reward.coef > 0`` is reward-only RL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.guards import LARGE_COEF  # above it a coefficient scales the loss past float range


class RewardBaseline(Enum):
    # mean of the OTHER samples of the same prompt (RLOO): the reward's expected gradient is exact
    loo = "loo"
    # mean of the prompt's samples, the sample itself included (GRPO): the reward's expected
    # gradient is scaled by (n-1)/n, n = rollout.n_samples
    group = "group"
    # no baseline: the advantage is the reward itself (exact, highest variance)
    none = "none"


@dataclass
class RewardConfig:
    """The reward term: advantage reward.coef * (r - baseline) [/ group std] on every response token."""

    # scale of the reward term; 0: off. 0 <= coef <= 1e6 (above 1: ExOPD's reward extrapolation)
    coef: float = 0.0
    # loo (leave-one-out, unbiased) | group (GRPO's mean, scales the gradient by (n-1)/n) | none
    baseline: RewardBaseline = RewardBaseline.loo
    # divide each prompt's advantages by its samples' reward std + 1e-6 (GRPO; not an unbiased gradient)
    std_normalize: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.coef, (int, float)) and math.isfinite(self.coef) and 0 <= self.coef <= LARGE_COEF):
            _fail("reward.coef", self.coef, f"0 <= reward.coef <= {LARGE_COEF:g} (0: off; larger scales the loss past float range)")

    @property
    def active(self) -> bool:
        return self.coef > 0


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r} is not allowed; allowed: {allowed}")


def validate_reward(cfg) -> None:
    """The reward's combinations with the rest of a ``TrainConfig`` (one line each)."""
    rw, lo, ro = cfg.reward, cfg.loss, cfg.rollout
    if lo.kl_coef > LARGE_COEF:  # its lower bound and finiteness: LossConfig
        _fail("loss.kl_coef", lo.kl_coef, f"0 <= loss.kl_coef <= {LARGE_COEF:g} (larger scales the loss past float range)")
    if not rw.active:
        if lo.kl_coef == 0:
            _fail("loss.kl_coef", lo.kl_coef, "> 0, or 0 with reward.coef > 0 (reward-only RL)")
        return
    if rw.baseline is not RewardBaseline.none and ro.n_samples < 2:
        _fail(
            "reward.baseline",
            rw.baseline.value,
            f"none with rollout.n_samples={ro.n_samples} (a group baseline needs at least 2 samples of each prompt), "
            "or rollout.n_samples >= 2",
        )
    if rw.std_normalize and rw.baseline is RewardBaseline.none:
        _fail("reward.std_normalize", True, "false with reward.baseline=none (the std is taken over a prompt's group)")
    positions = getattr(cfg, "positions", None)
    if positions is not None and positions.name.value == "first_n":
        _fail(
            "positions.name",
            "first_n",
            f"all, first, last, iw_opd or entropy_gate with reward.coef={rw.coef!r} (first_n stops the rollouts early: "
            "the verifier would score cut responses)",
        )
    if ro.on_policy_fraction < 1.0:
        _fail(
            "rollout.on_policy_fraction",
            ro.on_policy_fraction,
            f"1.0 with reward.coef={rw.coef!r} (the reward's REINFORCE term needs the student's own samples)",
        )
