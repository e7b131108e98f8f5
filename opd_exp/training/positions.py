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

import torch

from opd_exp.config.positions import GateMode, PositionsName
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


def training_rollout_config(cfg):
    """The config the training rollouts sample with: ``positions=first_n`` caps
    rollout.max_new_tokens at positions.tokens (early-stopped rollouts); ``cfg`` itself otherwise
    (evaluation always uses ``cfg``)."""
    pos, ro = cfg.positions, cfg.rollout
    if pos.name is not PositionsName.first_n or pos.tokens >= ro.max_new_tokens:
        return cfg
    return dataclasses.replace(cfg, rollout=dataclasses.replace(ro, max_new_tokens=pos.tokens))


class PositionWeights:
    """``positions`` built once: the counted positions of whole rows (``counted``) and the
    per-token loss terms with their weights or gate (``terms``); see the module docstring."""

    def __init__(self, cfg, *, sparse: bool = False):
        self.cfg = cfg.positions
        self.name = self.cfg.name
        # a row's IW-OPD weights need its whole response: the fused head cuts such runs into whole rows
        self.by_row = self.name is PositionsName.iw_opd
        if sparse and self.name is PositionsName.entropy_gate:
            raise ConfigError(
                "positions.name='entropy_gate' is not allowed with a served teacher whose top-k misses the vocabulary "
                "(the teacher's entropy and the forward KL need its whole distribution); allowed: teacher=in_process, "
                "teacher.k covering the vocabulary, or positions=all, first, last, first_n or iw_opd"
            )
        if self.name is PositionsName.entropy_gate:
            from opd_exp.divergences import get_divergence

            self.fkl = get_divergence("fkl")

    def counted(self, mask: torch.Tensor) -> torch.Tensor:
        """The positions the loss may count, from each row's whole response ``mask`` [N, R]."""
        pc = self.cfg
        if self.name in (PositionsName.first, PositionsName.last):
            return position_mask(mask, self.name.value, pc.fraction)
        if self.name is PositionsName.first_n:
            return first_n_mask(mask, pc.tokens)
        return mask.bool()

    def terms(
        self, per_token: torch.Tensor, counted: torch.Tensor, *, s, t, student_z, teacher_z, kl_coef: float, chunk_size=None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The weighted per-token loss terms (summed over ``counted`` by the objective) and the
        per-position values of ``positions/*`` (detached). all/first/last/first_n return
        ``per_token`` itself: the loss is bit-identical to the plain masked sum."""
        c = counted.bool()
        metrics: dict[str, torch.Tensor] = {}
        if self.name is PositionsName.iw_opd:
            w = iw_opd_weights(c, s.detach(), t.detach(), self.cfg.gamma)
            metrics[WEIGHT_MEAN] = w
            return per_token * w.to(per_token.dtype), metrics
        if self.name is PositionsName.entropy_gate:
            with torch.no_grad():
                gate = c & (entropy(teacher_z) > self.cfg.threshold)
            forward = self.fkl.full(student_z, teacher_z, mask=gate, chunk_size=chunk_size).to(per_token.dtype)
            metrics[GATE_RATE] = gate.to(s.dtype)
            if self.cfg.gate is GateMode.replace:
                metrics[WEIGHT_MEAN] = (c & ~gate).to(s.dtype)
                return torch.where(gate, kl_coef * forward, per_token), metrics
            metrics[WEIGHT_MEAN] = c.to(s.dtype)
            return per_token + kl_coef * forward, metrics
        if self.cfg.weighted:
            metrics[WEIGHT_MEAN] = c.to(s.dtype)
        return per_token, metrics
