"""Monitors: what every step logs beside the objective's estimates, and the one list of names.

Beside its estimate, every step logs exact quantities of its own rollout: the exact divergences
(``exact/*``), both entropies and the top-k agreement of student and teacher (``overlap/*``),
and how far the rollout engine's log-probs of its samples are from the trainer's
(``rollout/logprob_gap``, with one warning line). ``Monitors`` is built once from
``trainer.exact_metrics``, ``trainer.overlap_k``, the rollout filter and the teacher's kind, is
called beside the ``Objective`` on every micro-batch (no grad), and owns the reduction of a
step's sums, counts and maxima over ranks.

The quantities over the vocabulary each need log-softmax of both logit tensors; computed one by
one they would take that log-softmax a dozen times per step, which at small models costs more
than the training pass itself. ``step_monitors`` normalises each chunk of response positions once
and reads every monitor off the same buffers, with the same formulas as the standalone
definitions (``full.chunk_value``, ``scoring.entropy``), so the values are those of
``d.full(student_z, teacher_z)`` and friends. Only the masked positions are computed: the other
ones count nowhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from opd_exp.config.schema import TrainConfig
from opd_exp.divergences import get_divergence
from opd_exp.divergences.catalog import Divergence
from opd_exp.divergences.full import chunk_value, log_ratio
from opd_exp.runtime import distributed as dist_util
from opd_exp.training.scoring import TeacherScores, entropy

# The one list of a step's per-token metrics (sums over response tokens, divided by the step's
# global token count), in logging order: name -> (who computes it, what it needs). "objective":
# the estimates on the sampled tokens; "monitors": this module. Needs: "exact_metrics" /
# "overlap_k" (their switches on), "unfiltered" (KL(T||S) is infinite under a top-k/top-p filter:
# not logged then, never a large finite stand-in), "whole_teacher" (not logged with a sparse
# teacher, k < V), "topk_estimator" (estimator=topk*: the truncation masses T(K), S(K) of its
# summed set), "loss_clamp" (estimator=topk_verl: share of tokens whose loss the clamp set),
# "baseline" (estimator.baseline on: the mean control variate b subtracted from the sampled cost),
# "weighted" (positions != all: the mean weight on the loss term), "entropy_gate" (the share of
# tokens whose teacher entropy opens the forward-KL gate; training/positions.py).
TOKEN_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "jsd/mean": ("objective", ()),
    "kl/reverse": ("objective", ()),
    "kl/forward": ("objective", ("unfiltered",)),
    "advantages/mean": ("objective", ()),
    "student/logprob_mean": ("objective", ()),
    "teacher/logprob_mean": ("objective", ()),
    "student/entropy": ("monitors", ()),
    "exact/jsd": ("monitors", ("exact_metrics", "whole_teacher")),
    "exact/kl_reverse": ("monitors", ("exact_metrics", "whole_teacher")),
    "exact/kl_forward": ("monitors", ("exact_metrics", "whole_teacher", "unfiltered")),
    "teacher/entropy": ("monitors", ("whole_teacher",)),
    "overlap/teacher_mass": ("monitors", ("overlap_k", "whole_teacher")),
    "overlap/student_mass": ("monitors", ("overlap_k", "whole_teacher")),
    "overlap/ratio": ("monitors", ("overlap_k", "whole_teacher")),
    "estimator/teacher_mass": ("objective", ("topk_estimator",)),
    "estimator/student_mass": ("objective", ("topk_estimator",)),
    "estimator/clamp_rate": ("objective", ("loss_clamp",)),
    "estimator/baseline": ("objective", ("baseline",)),
    "positions/weight_mean": ("objective", ("weighted",)),
    "positions/gate_rate": ("objective", ("entropy_gate",)),
}
# Logged only on the steps that have them: per-token sums (cost/clipped_frac, the gap), a count
# (never divided) and a maximum over tokens.
GAP, GAP_MAX, OUTSIDE = "rollout/logprob_gap", "rollout/logprob_gap_max", "rollout/outside_filter_tokens"
# Order of the values ``agreement`` returns (per position).
AGREEMENT = ("teacher/entropy", "overlap/teacher_mass", "overlap/student_mass", "overlap/ratio")
# The exact divergences by metric name, rkl and fkl first: jsd's rows_value works in place on the
# buffers it gets
EXACT = ("exact/kl_reverse", "exact/kl_forward", "exact/jsd")
# rollout/logprob_gap above this (nats per token): the engine samples another distribution
LOGPROB_GAP_WARN = 1e-3
# ~32 MiB of fp32 per [chunk, V] buffer, as the full-vocabulary divergence.
_CHUNK_ELEMENTS = 1 << 23


def metric_beta(cfg: TrainConfig) -> float:
    """`jsd/mean` is at the configured beta for jsd (and jsd_legacy), and at 0.5 for every other divergence."""
    return cfg.divergence.beta if cfg.divergence.name.value in ("jsd", "jsd_legacy") else 0.5


def exact_divergences(cfg: TrainConfig) -> dict[str, Divergence]:
    """``exact/*`` name -> divergence (in ``EXACT`` order; KL(T||S) left out under a filter)."""
    divs = {"exact/kl_reverse": get_divergence("rkl"), "exact/kl_forward": get_divergence("fkl")}
    divs["exact/jsd"] = get_divergence("jsd", beta=metric_beta(cfg))
    if cfg.rollout.filtered:
        del divs["exact/kl_forward"]
    return divs


def token_metric_names(cfg: TrainConfig, *, sparse: bool = False, by: str | None = None) -> tuple[str, ...]:
    """The per-token metrics a student-sampled step of this run logs (``by``: only the
    objective's or the monitors')."""
    from opd_exp.training.estimators import get_estimator

    logs = get_estimator(cfg.estimator.name.value).metrics  # the estimator says which estimator/* it logs
    off = {
        "exact_metrics": not cfg.trainer.exact_metrics,
        "overlap_k": not cfg.trainer.overlap_k,
        "unfiltered": cfg.rollout.filtered,
        "whole_teacher": sparse,
        "topk_estimator": "estimator/teacher_mass" not in logs,
        "loss_clamp": "estimator/clamp_rate" not in logs,
        "baseline": cfg.estimator.baseline.value == "none",
        "weighted": not cfg.positions.weighted,
        "entropy_gate": cfg.positions.name.value != "entropy_gate",
    }
    return tuple(n for n, (who, needs) in TOKEN_METRICS.items() if by in (None, who) and not any(off[x] for x in needs))


def logprob_gap(engine_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(sum, max) over response tokens of |engine log-prob - trainer log-prob|."""
    m = mask.bool()
    gap = (engine_lp.to(trainer_lp.device).float() - trainer_lp.detach().float()).abs()[m]
    return float(gap.sum()), float(gap.max()) if gap.numel() else 0.0


@dataclass
class Readings:
    """Metrics of one micro-batch: per-token sums, counts (never divided) and maxima."""

    sums: dict[str, float]
    counts: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)


_ORDER = {n: i for i, n in enumerate(TOKEN_METRICS)}


class Tally(dict):
    """A step's metrics over its micro-batches: per-token sums (the dict itself), counts
    (``rollout/outside_filter_tokens``; also values already final, never divided: ``ppo/*``)
    and maxima (``rollout/logprob_gap_max``)."""

    def __init__(self, sums=(), counts=None, maxes=None):
        super().__init__(sums)
        self.counts: dict[str, float] = dict(counts or {})
        self.maxes: dict[str, float] = dict(maxes or {})

    def add(self, out) -> None:
        """Add a ``Readings`` or an objective ``Output`` (anything with sums, counts, maxes)."""
        for k, v in out.sums.items():
            self[k] = self.get(k, 0.0) + v
        for k, v in out.counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + v
        for k, v in out.maxes.items():
            self.maxes[k] = max(self.maxes.get(k, v), v)

    def metrics(self, n_tokens: int) -> dict[str, float]:
        """Per-token means over the step's ``n_tokens`` response tokens (``TOKEN_METRICS`` order
        first), then counts and maxima."""
        sums = sorted(self.items(), key=lambda kv: _ORDER.get(kv[0], len(_ORDER)))
        return {**{k: v / max(n_tokens, 1) for k, v in sums}, **self.counts, **self.maxes}


class Scored(Protocol):
    """What the objective saw of a micro-batch (``objective.Output``)."""

    kept: torch.Tensor  # [N, R] bool: the response tokens the metrics count
    on_policy: bool  # the student sampled the batch
    logprobs: torch.Tensor  # [N, R] the trainer's log S(y) of the sampled tokens
    exact: dict[str, torch.Tensor]  # exact/* values per position the objective already computed


class Monitors:
    """The step's monitors, built once from config (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, *, sparse: bool = False):
        """``sparse``: the teacher sends its top-k only (k < V): only the student's side exists
        over the whole vocabulary."""
        self.exact_metrics, self.k, self.sparse = cfg.trainer.exact_metrics, cfg.trainer.overlap_k, sparse
        self.chunk = cfg.estimator.chunk_size
        self.divergences = exact_divergences(cfg)
        # every per-token metric of a student-sampled step (0 where a step has none; NaN when skipped)
        self.names = token_metric_names(cfg, sparse=sparse)
        # a stale rollout's engine log-probs are an older student's by design (rollout.staleness > 0):
        # the gap is then the policy's drift, which the importance weights correct (async/*), not a fault
        self._gap_warned = cfg.rollout.staleness > 0

    @torch.no_grad()
    def __call__(
        self, student_z: torch.Tensor, teacher: TeacherScores | torch.Tensor, out: Scored, *, engine_logprobs: torch.Tensor | None = None
    ) -> Readings:
        """The monitors' sums over ``out.kept`` (and the log-prob gap of a student-sampled batch
        whose engine reported its log-probs)."""
        m, zs = out.kept, student_z.detach()
        zero = torch.zeros((), dtype=student_z.dtype, device=student_z.device)
        if self.sparse:
            ent = entropy(zs[m])
            values = {"student/entropy": torch.zeros(m.shape, dtype=ent.dtype, device=m.device).masked_scatter_(m, ent)}
        else:
            teacher_z = teacher.logits if isinstance(teacher, TeacherScores) else teacher
            wanted = [n for n in self.divergences if self.exact_metrics and n not in out.exact]
            mon = step_monitors(zs, teacher_z, m, divergences={n: self.divergences[n] for n in wanted}, k=self.k, chunk_rows=self.chunk)
            values = {"student/entropy": mon["student/entropy"]}
            if self.exact_metrics:
                values.update({n: out.exact.get(n, mon.get(n)) for n in self.divergences})
            values.update({n: mon[n] for n in AGREEMENT if n in mon})
        sums = {k: float(torch.where(m, v.to(zero.dtype), zero).sum()) for k, v in values.items()}
        maxes = {}
        if engine_logprobs is not None and out.on_policy:  # the engine's log-probs of its samples vs ours
            sums[GAP], maxes[GAP_MAX] = logprob_gap(engine_logprobs, out.logprobs, m)
        return Readings(sums, {}, maxes)

    def gap_warning(self, metrics: Mapping[str, float], step: int) -> str | None:
        """One line the first time a step's ``rollout/logprob_gap`` exceeds ``LOGPROB_GAP_WARN``."""
        gap = metrics.get(GAP, 0.0)
        if gap <= LOGPROB_GAP_WARN or self._gap_warned:  # once per run: the metric tracks it
            return None
        self._gap_warned = True
        return (
            f"opd-train: warning: step {step}: {GAP}={gap:.2e} > {LOGPROB_GAP_WARN:g} "
            f"(max {metrics.get(GAP_MAX, gap):.2e}): the rollout engine's log-probs of its samples "
            "differ from the trainer's, so the trained distribution is not the sampled one (said once; watch the metric)"
        )

    def reduce(self, loss: float, tally: Tally, dist) -> tuple[float, Tally]:
        """Token-weighted over ranks: sums of per-token values, divided later by the global count;
        counts summed, maxima the largest of any rank."""
        if not dist.active:
            return loss, tally
        keys = self.names
        loss, *vals = dist_util.all_reduce_sum([loss, *(tally.get(k, 0.0) for k in keys)], dist)
        extra = sorted(set(tally) - set(keys))
        counts = dist_util.reduce_sums(tally.counts, sorted(tally.counts), dist)
        maxes = dict(zip(sorted(tally.maxes), dist_util.all_reduce_max([tally.maxes[k] for k in sorted(tally.maxes)], dist)))
        return loss, Tally({**dict(zip(keys, vals)), **dist_util.reduce_sums(tally, extra, dist)}, counts, maxes)


@torch.no_grad()
def step_monitors(
    student_z: torch.Tensor,
    teacher_z: torch.Tensor,
    mask: torch.Tensor,
    *,
    divergences: Mapping[str, Divergence],
    k: int,
    chunk_rows: int | None = None,
    entropies: bool = True,
) -> dict[str, torch.Tensor]:
    """Per position ``[...]`` (0 outside ``mask``): ``student/entropy``, the ``AGREEMENT``
    values at top-``k`` (``k=0``: only ``teacher/entropy``), and D per position for each
    ``divergences`` entry (name -> divergence). ``entropies=False`` (with ``k=0``): the
    divergences alone.

    ``student_z``/``teacher_z`` are the logits ``[..., V]`` of the distributions compared (the
    student's sampling logits, the teacher's tempered ones); both are normalised in fp32 (fp64
    stays fp64)."""
    lead, V = student_z.shape[:-1], student_z.shape[-1]
    zs, zt = student_z.detach().reshape(-1, V), teacher_z.detach().reshape(-1, V)
    rows = mask.reshape(-1).bool().nonzero().squeeze(-1)
    dtype = torch.float64 if zs.dtype == torch.float64 else torch.float32
    names = (*(("student/entropy", *(AGREEMENT if k else AGREEMENT[:1])) if entropies else ()), *divergences)
    out = {n: torch.zeros(zs.shape[0], dtype=dtype, device=zs.device) for n in names}
    k = min(int(k), V)
    chunk = chunk_rows or max(1, _CHUNK_ELEMENTS // max(V, 1))
    lowest = torch.finfo(dtype).min
    for start in range(0, rows.numel(), chunk):
        idx = rows[start : start + chunk]
        zs_c, zt_c = zs.index_select(0, idx).to(dtype), zt.index_select(0, idx).to(dtype)
        s, t = torch.log_softmax(zs_c, -1), torch.log_softmax(zt_c, -1)
        S, T = s.exp(), t.exp()
        # log T/S from the logits' difference: the divergences' values near convergence
        ratio = log_ratio(S, zs_c, zt_c) if divergences else None
        del zs_c, zt_c
        values = {"student/entropy": -(S * s).sum(-1), "teacher/entropy": -(T * t.clamp(min=lowest)).sum(-1)} if entropies else {}
        if k:
            # each top-k set is taken within its distribution's support: under a filter that keeps
            # fewer than k entries, the rest tie at zero mass and topk would pick among them by index
            top_s, top_t = s.topk(k, dim=-1).indices, t.topk(k, dim=-1).indices
            in_s, in_t = S.gather(-1, top_s) > 0, T.gather(-1, top_t) > 0
            values["overlap/teacher_mass"] = torch.where(in_s, T.gather(-1, top_s), 0.0).sum(-1)
            values["overlap/student_mass"] = torch.where(in_t, S.gather(-1, top_t), 0.0).sum(-1)
            shared = ((top_s.unsqueeze(-1) == top_t.unsqueeze(-2)) & in_t.unsqueeze(-2)).any(-1) & in_s
            smaller = torch.minimum(in_s.sum(-1), in_t.sum(-1)).clamp(min=1)
            values["overlap/ratio"] = shared.to(dtype).sum(-1) / smaller.to(dtype)
        del T
        for name, d in divergences.items():
            values[name] = chunk_value(d, S, ratio, lambda far, s=s, t=t: (s[far], t[far]))
        for name, v in values.items():
            out[name][idx] = v.to(dtype)
    return {n: v.reshape(lead) for n, v in out.items()}


def agreement(student_z: torch.Tensor, teacher_z: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Per position (every position): the teacher's entropy and the top-k agreement of the two
    distributions: the teacher's mass on the student's top-k (``overlap/teacher_mass``), the
    student's mass on the teacher's top-k (``overlap/student_mass``), and the share of entries
    the two top-k sets have in common (``overlap/ratio``). A top-k set holds only entries of
    nonzero mass (fewer than k when a top-k / top-p filter keeps fewer); the share is of the
    smaller set."""
    if k < 1:
        raise ValueError(f"agreement: k={k} is out of range; allowed: k >= 1")
    every = torch.ones(student_z.shape[:-1], dtype=torch.bool, device=student_z.device)
    got = step_monitors(student_z, teacher_z, every, divergences={}, k=k)
    return tuple(got[n] for n in AGREEMENT)
