"""Position weighting: which response positions the loss counts, and with what weight
(the ``positions`` config group, ``opd_exp/config/positions.py``).

Notation, per micro-batch: l_t is the run's per-token loss term at response position t (the
divergence x estimator x loss form of ``objective.py``: for estimator=full and token credit,
l_t = kl_coef * D_t with D_t = D(S_theta(.|x, y_<t), T(.|x, y_<t)) exact over the vocabulary,
the prefix frozen), C the positions the loss counts (a subset of the response tokens the
objective keeps), N the step's GLOBAL response-token count. The normaliser stays N for every
option (never the weight mass or |C|), so micro-batches and ranks still add up to one batch's
gradient, and a weighting changes the loss's scale as well as its direction. Weights and gates
are constants to autograd (computed without grad); the metrics still cover every token. A
reward term (``reward.coef > 0``) is added by the objective after the weights: unweighted, on C.

- ``all``:   L = (1/N) sum_{t in R} l_t, R the kept response tokens. grad L = (1/N) sum_t grad l_t.
- ``first``/``last`` (fraction f): C = each row's first / last ceil(f * L_row) tokens;
  L = (1/N) sum_{t in C} l_t, grad L = (1/N) sum_{t in C} grad l_t (l_t untouched elsewhere:
  sequence-credit returns still sum the whole future). The study of IW-OPD (arXiv 2606.22600).
- ``first_n`` (tokens n): early-stopped rollouts (ESR, arXiv 2605.27028): the training rollouts
  (student's and teacher's engines) stop after n response tokens, so the step's tokens, its N and
  its metrics are those of the shortened responses; C = the first n tokens (all of them).
  Evaluation decodes to rollout.max_new_tokens as before.
- ``iw_opd`` (gamma): our reading of IW-OPD (arXiv 2606.22600, Algorithm 1; TRL's
  ``IWOPDTrainer`` computes the same): with a_k = |log T(y_k) - log S(y_k)| over the row's counted
  tokens (S the trainer's sampling distribution, T the tempered teacher), P_t = sum_{k<t} a_k
  and P = max(sum_k a_k, 1e-8),
      w_t = 1 + gamma * (1 - P_t / P)            (1 + gamma at the first token, >= 1 everywhere)
  L = (1/N) sum_{t in C} w_t l_t with w held constant (stop-gradient), so
  grad L = (1/N) sum_t w_t grad l_t. The paper weights the sampled reverse-KL advantage
  (estimator=sampled, divergence=rkl); here w_t multiplies whatever l_t the run uses.
- ``entropy_gate`` (threshold tau, gate): EOPD (arXiv 2603.07079), with g_t = 1[H(T_t) > tau]
  (H the entropy of the tempered teacher at t, in nats) and F_t = KL(T_t || S_t) exact over
  the vocabulary (full-vocabulary, prefix frozen, whatever the estimator):
      gate=add     (the paper's "augmenting reverse KL with forward KL"):
                   L = (1/N) sum_{t in C} [l_t + kl_coef g_t F_t]
      gate=replace (forward KL where the teacher is uncertain, the run's term elsewhere):
                   L = (1/N) sum_{t in C} [(1 - g_t) l_t + kl_coef g_t F_t]
  grad F_t w.r.t. the student's logits z_t is S_t - T_t (exactly; ``Divergence.full``). EOPD
  trains reverse KL: pick divergence=rkl for the paper's objective. No threshold is given in the
  abstract; 0.5 nats is our default (docs/training.md has the share of tokens it opens on the
  embedded pair). Sequence-credit returns (estimator=sampled|topk with loss=reinforce|ppo) are
  the run's divergence's: the gated term is a per-token one.

Metrics (per response token, objective's, listed in ``monitors.TOKEN_METRICS``):
``positions/weight_mean`` the mean weight on l_t (the share of counted tokens for
first/last/first_n, the mean w_t for iw_opd, 1 - gate rate for gate=replace), logged when
positions != all; ``positions/gate_rate`` the share of tokens whose gate is open (entropy_gate).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from opd_exp.config.positions import GateMode
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.scoring import entropy

# IW-OPD's floor on a row's summed log-ratio (TRL's iw_opd_epsilon): a row with no discrepancy
# at all gets P_t / P = 0, i.e. every weight 1 + gamma
IW_OPD_EPS = 1e-8
WEIGHT_MEAN, GATE_RATE = "positions/weight_mean", "positions/gate_rate"


def position_mask(mask: torch.Tensor, positions: str, fraction: float) -> torch.Tensor:
    """The response positions that count in the loss: ``all`` of them, or the ``first`` /
    ``last`` ceil(fraction * L) of each row's L response tokens (``mask`` is [N, R], a prefix
    of each row: whole rows, never a chunk of positions gathered from several)."""
    m = mask.bool()
    if positions == "all":
        return m
    length = m.sum(-1, keepdim=True)
    n = torch.ceil(fraction * length.to(torch.float64)).to(length.dtype)
    index = torch.cumsum(m.long(), -1) - 1  # 0-based index among the row's response tokens
    keep = index < n if positions == "first" else index >= length - n
    return m & keep


def first_n_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """Each row's first ``n`` response tokens (``mask`` [N, R], whole rows)."""
    m = mask.bool()
    return m & (torch.cumsum(m.long(), -1) <= n)


@torch.no_grad()
def iw_opd_weights(counted: torch.Tensor, s: torch.Tensor, t: torch.Tensor, gamma: float) -> torch.Tensor:
    """IW-OPD's w_t = 1 + gamma (1 - P_t / P) over each row's ``counted`` tokens ([N, R], whole
    rows), from the sampled tokens' log-probs ``s`` (student) and ``t`` (teacher); 0 elsewhere."""
    c = counted.bool()
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    a = torch.where(c, (t.to(s.dtype) - s).abs(), zero)  # a masked -1e9 log-prob never enters
    before = torch.cumsum(a, -1) - a  # P_t: the row's discrepancy strictly before t
    total = a.sum(-1, keepdim=True).clamp_min(IW_OPD_EPS)
    return torch.where(c, 1.0 + gamma * (1.0 - before / total), zero)


class PositionRule:
    """One ``positions`` option, registered under ``positions.name`` (``register_position_rule``):
    which positions of each row's whole response count (``counted``), the weighted per-token loss
    terms over them (``terms``), and its limits. The objective and the fused head call it once per
    micro-batch and never ask which rule they have."""

    name: ClassVar[str]
    keys: ClassVar[tuple[str, ...]] = ()  # the positions.* fields it reads (W&B logs only these)
    by_row: ClassVar[bool] = False  # its weights read a row's whole response: the fused head cuts whole rows
    float_weights: ClassVar[bool] = False  # weights other than 0/1, or an added term (one PPO update only)
    dense_teacher: ClassVar[bool] = False  # needs the teacher's whole distribution (not a served top-k)

    def __init__(self, positions_cfg):
        self.cfg = positions_cfg

    def counted(self, mask: torch.Tensor) -> torch.Tensor:
        """The positions the loss may count, from each row's whole response ``mask`` [N, R]."""
        return mask.bool()

    def terms(
        self, per_token: torch.Tensor, counted: torch.Tensor, *, s, t, student_z, teacher_z, kl_coef: float, chunk_size=None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The weighted per-token loss terms (summed over ``counted`` by the objective) and the
        per-position values of ``positions/*`` (detached). A rule that only picks positions returns
        ``per_token`` itself: the loss is bit-identical to the plain masked sum."""
        return per_token, ({WEIGHT_MEAN: counted.to(s.dtype)} if self.cfg.weighted else {})

    def max_new_tokens(self, max_new_tokens: int) -> int:
        """The training rollouts' length cap (evaluation always decodes to rollout.max_new_tokens)."""
        return max_new_tokens


POSITION_RULES: dict[str, type[PositionRule]] = {}


def register_position_rule(cls: type[PositionRule]) -> type[PositionRule]:
    """Register ``cls`` under ``positions.name=cls.name`` (a class decorator); its ``keys`` must be
    fields of the ``positions`` group (``config/positions.py``)."""
    from opd_exp.config.positions import FLOAT_WEIGHTS, OPTION_KEYS, PositionsConfig, PositionsName

    if not getattr(cls, "name", "").isidentifier():
        raise ValueError(f"register_position_rule: {cls.__name__}.name must be an identifier (it becomes positions.name)")
    fields = {f.name for f in dataclasses.fields(PositionsConfig)} - {"name"}
    unknown = [k for k in cls.keys if k not in fields]
    if unknown:
        raise ValueError(
            f"register_position_rule: {cls.__name__} reads {', '.join(unknown)}, which the config cannot set; "
            f"allowed: {', '.join(sorted(fields))} (keys of positions.)"
        )
    POSITION_RULES[cls.name] = cls
    OPTION_KEYS[cls.name] = tuple(cls.keys)
    if cls.float_weights:
        FLOAT_WEIGHTS.add(cls.name)
    PositionsName._add(cls.name)
    return cls


def build_position_rule(cfg, *, sparse: bool = False) -> PositionRule:
    """``positions`` built once for a run; ``sparse``: the teacher's scores miss part of the vocabulary."""
    rule = POSITION_RULES[cfg.positions.name.value]
    if sparse and rule.dense_teacher:
        raise ConfigError(
            f"positions.name={rule.name!r} is not allowed with a served teacher whose top-k misses the vocabulary "
            "(it needs the teacher's whole distribution); allowed: teacher=in_process, teacher.k covering the vocabulary, "
            f"or positions={', '.join(n for n, r in POSITION_RULES.items() if not r.dense_teacher)}"
        )
    return rule(cfg.positions)


def training_rollout_config(cfg):
    """The config the training rollouts sample with: a rule that stops them early (``first_n``)
    caps rollout.max_new_tokens; ``cfg`` itself otherwise (evaluation always uses ``cfg``)."""
    ro = cfg.rollout
    cap = POSITION_RULES[cfg.positions.name.value](cfg.positions).max_new_tokens(ro.max_new_tokens)
    if cap >= ro.max_new_tokens:
        return cfg
    return dataclasses.replace(cfg, rollout=dataclasses.replace(ro, max_new_tokens=cap))


@register_position_rule
class All(PositionRule):
    name = "all"


@register_position_rule
class First(PositionRule):
    name, keys = "first", ("fraction",)

    def counted(self, mask):
        return position_mask(mask, "first", self.cfg.fraction)


@register_position_rule
class Last(PositionRule):
    name, keys = "last", ("fraction",)

    def counted(self, mask):
        return position_mask(mask, "last", self.cfg.fraction)


@register_position_rule
class FirstN(PositionRule):
    name, keys = "first_n", ("tokens",)

    def counted(self, mask):
        return first_n_mask(mask, self.cfg.tokens)

    def max_new_tokens(self, max_new_tokens: int) -> int:
        return min(max_new_tokens, self.cfg.tokens)


@register_position_rule
class IwOpd(PositionRule):
    name, keys, by_row, float_weights = "iw_opd", ("gamma",), True, True

    def terms(self, per_token, counted, *, s, t, student_z, teacher_z, kl_coef, chunk_size=None):
        w = iw_opd_weights(counted.bool(), s.detach(), t.detach(), self.cfg.gamma)
        return per_token * w.to(per_token.dtype), {WEIGHT_MEAN: w}


@register_position_rule
class EntropyGate(PositionRule):
    name, keys, float_weights, dense_teacher = "entropy_gate", ("threshold", "gate"), True, True

    def __init__(self, positions_cfg):
        super().__init__(positions_cfg)
        from opd_exp.divergences import get_divergence

        self.fkl = get_divergence("fkl")

    def terms(self, per_token, counted, *, s, t, student_z, teacher_z, kl_coef, chunk_size=None):
        c = counted.bool()
        with torch.no_grad():
            gate = c & (entropy(teacher_z) > self.cfg.threshold)
        forward = self.fkl.full(student_z, teacher_z, mask=gate, chunk_size=chunk_size).to(per_token.dtype)
        metrics = {GATE_RATE: gate.to(s.dtype)}
        if self.cfg.gate is GateMode.replace:
            metrics[WEIGHT_MEAN] = (c & ~gate).to(s.dtype)
            return torch.where(gate, kl_coef * forward, per_token), metrics
        metrics[WEIGHT_MEAN] = c.to(s.dtype)
        return per_token + kl_coef * forward, metrics
