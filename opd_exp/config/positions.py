"""The ``positions`` config group: which response positions the loss counts, and with what weight.

One option per line of work on where the distillation signal sits along a response (the math,
each option's gradient and its source: ``opd_exp/training/positions.py`` and docs/training.md,
"Position weighting"):

- ``all``          every response token, weight 1 (the default; what every run did before)
- ``first``        each response's first ceil(fraction * L) tokens (IW-OPD's prefix study)
- ``last``         each response's last ceil(fraction * L) tokens (its suffix control)
- ``first_n``      early-stopped rollouts (ESR, arXiv 2605.27028): training rollouts stop after
                   ``tokens`` response tokens; evaluation keeps rollout.max_new_tokens
- ``iw_opd``       IW-OPD weights (arXiv 2606.22600): w_t = 1 + gamma (1 - P_t / P), P_t the
                   row's summed |log T(y_k) - log S(y_k)| before t, P over the whole response
- ``entropy_gate`` EOPD (arXiv 2603.07079): exact forward KL added (``gate=add``) or swapped in
                   (``gate=replace``) where the teacher's entropy exceeds ``threshold`` nats

The loss stays a sum over the counted tokens divided by the step's global response-token count
(never by the weight mass), and the metrics still cover every response token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from opd_exp.config.choices import RegistryChoice
from opd_exp.runtime.errors import ConfigError

# positions.name, a registry (training/positions.py; register_position_rule adds one). Built in:
# all (every response token, weight 1) | first / last (each response's first / last
# ceil(fraction * length) tokens) | first_n (early-stopped rollouts: the first `tokens` response
# tokens are all there is) | iw_opd (IW-OPD weights from the accumulated teacher-student log-ratio)
# | entropy_gate (forward KL where the teacher's entropy exceeds `threshold`)
PositionsName = RegistryChoice("PositionsName", [(n, n) for n in ("all", "first", "last", "first_n", "iw_opd", "entropy_gate")])


class GateMode(Enum):
    add = "add"  # EOPD's wording: the run's divergence everywhere, plus forward KL at gated positions
    replace = "replace"  # forward KL at gated positions, the run's divergence elsewhere


# the fields each option reads (W&B logs only these; the others are another option's), and the
# options whose weights are not 0/1 or that add a term (later PPO updates cannot carry them); a
# registered rule adds its own (training/positions.py, register_position_rule)
OPTION_KEYS: dict[str, tuple[str, ...]] = {
    "all": (),
    "first": ("fraction",),
    "last": ("fraction",),
    "first_n": ("tokens",),
    "iw_opd": ("gamma",),
    "entropy_gate": ("threshold", "gate"),
}
FLOAT_WEIGHTS: set[str] = {"iw_opd", "entropy_gate"}
# iw_opd's largest gamma: its weights reach 1 + gamma, and beyond this they scale the loss, not shape it
GAMMA_MAX = 1e3


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r} is not allowed; allowed: {allowed}")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class PositionsConfig:
    """Position weighting of the per-token loss (conf/positions/*; docs/training.md)."""

    # all | first | last | first_n | iw_opd | entropy_gate | a registered rule (docs/extending.md)
    name: PositionsName = PositionsName.all
    # first/last: the share of each response's tokens that count, ceil(fraction * length), in (0, 1]
    fraction: float = 0.3
    # first_n: response tokens per training rollout (the rollout stops there; eval does not)
    tokens: int = 16
    # iw_opd: the weight of the first token, 1 + gamma, falling to ~1 at the last (IW-OPD's 0.5)
    gamma: float = 0.5
    # entropy_gate: teacher entropy (nats, of its tempered distribution) above which forward KL acts
    threshold: float = 0.5
    # entropy_gate: add (forward KL on top of the run's divergence) | replace (instead of it)
    gate: GateMode = GateMode.add

    def __post_init__(self) -> None:
        if not (_finite(self.fraction) and 0.0 < self.fraction <= 1.0):
            _fail("positions.fraction", self.fraction, "0 < fraction <= 1")
        if not (isinstance(self.tokens, int) and self.tokens >= 1):
            _fail("positions.tokens", self.tokens, "integer >= 1")
        if not (_finite(self.gamma) and 0.0 <= self.gamma <= GAMMA_MAX):
            _fail(
                "positions.gamma",
                self.gamma,
                f"0 <= gamma <= {GAMMA_MAX:g} (0: every weight 1, plain OPD; the first token's weight is 1 + gamma)",
            )
        if not (_finite(self.threshold) and self.threshold >= 0.0):
            _fail("positions.threshold", self.threshold, ">= 0 (nats)")

    @property
    def weighted(self) -> bool:
        """The loss is not the plain sum over every token (``positions/weight_mean`` is logged)."""
        return self.name.value != "all"

    @property
    def float_weights(self) -> bool:
        """Weights other than 0/1 per position (iw_opd), or a second loss term (entropy_gate)."""
        return self.name.value in FLOAT_WEIGHTS


def chosen_positions(group: Mapping[str, Any]) -> dict[str, Any]:
    """A plain ``positions`` group (a logged config) with only ``name`` and the keys its option reads."""
    keys = OPTION_KEYS.get(group.get("name"))
    return dict(group) if keys is None else {k: v for k, v in group.items() if k == "name" or k in keys}


def validate_positions(cfg) -> None:
    """Combinations of ``positions`` with the rest of a TrainConfig that cannot work."""
    pos, lo, ro = cfg.positions, cfg.loss, cfg.rollout
    name = pos.name.value
    if pos.float_weights and lo.ppo_updates > 1:
        key, value = ("loss.ppo_epochs", lo.ppo_epochs) if lo.ppo_epochs > 1 else ("loss.ppo_mini_batches", lo.ppo_mini_batches)
        _fail(
            key,
            value,
            f"1 with positions={name} (later PPO updates reuse the scoring pass's advantages and never see the teacher "
            "again, so they cannot carry its weights or forward-KL term); allowed: positions=all, first, last or first_n",
        )
    if name == "entropy_gate" and ro.filtered:
        key, value = ("rollout.top_k", ro.top_k) if ro.top_k > 0 else ("rollout.top_p", ro.top_p)
        _fail(
            key,
            value,
            f"{'0' if key.endswith('top_k') else '1.0'} (off) with positions=entropy_gate: its forward KL(T||S) is infinite "
            "where the teacher has mass the filter removes",
        )


def positions_notices(cfg) -> list[str]:
    """Settings of the ``positions`` group that change nothing in this run, one line each: a key
    set away from its default that the chosen option does not read (a sweep may set it for all its
    arms, so this is said, not refused), and ``first_n`` at or above the rollout length (nothing
    is cut: the same run as ``positions=all``)."""
    pos, name = cfg.positions, cfg.positions.name.value
    reads, lines = OPTION_KEYS.get(name, ()), []
    default = PositionsConfig()
    for key in ("fraction", "tokens", "gamma", "threshold", "gate"):
        value = getattr(pos, key)
        if key not in reads and value != getattr(default, key):
            users = ", ".join(n for n, keys in OPTION_KEYS.items() if key in keys)
            shown = value.value if isinstance(value, Enum) else value
            lines.append(
                f"opd-train: notice: positions.{key}={shown} is not read by positions={name} (only by {users}); it changes nothing"
            )
    if "tokens" in reads and name == "first_n" and pos.tokens >= cfg.rollout.max_new_tokens:
        lines.append(
            f"opd-train: notice: positions.tokens={pos.tokens} >= rollout.max_new_tokens={cfg.rollout.max_new_tokens}: "
            "positions=first_n cuts no rollout (the same run as positions=all)"
        )
    return lines
