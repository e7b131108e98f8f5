"""PPO with several updates per rollout: ``loss.ppo_epochs`` passes over the rollout, each cut
into ``loss.ppo_mini_batches`` disjoint sets of rows, one optimizer step per set.

Per rollout:
1. The scoring pass, before any update: per micro-batch, the teacher scores once and the student's forward (no
   grad, the trainer's sampling transform) goes through the ``Objective``: the advantages A
   (the behaviour policy's costs, fixed across epochs), the behaviour log-probs
   log S_old(y) (the policy that sampled the tokens, recomputed by the trainer; they differ from
   the engine's by ``rollout/logprob_gap``), the positions the loss counts, and the step's
   metrics (the values a one-update step logs on the same rollout).
2. Per epoch, the rows in an order drawn from (seed, step, epoch) (epoch 0: the order of the scoring pass,
   so the first update forwards the very micro-batches it scored and its ratio is exactly 1),
   cut into mini-batches; per mini-batch the student's forward with grad, the loss
   sum over counted tokens of -min(A r, A clip(r, 1-eps, 1+eps)) / the mini-batch's response-token
   count, r = exp(log S(y) - log S_old(y)); gradient clip, guard, optimizer step.

The teacher is never asked again after the scoring pass, and the learning-rate scheduler steps once per
rollout (in the trainer): every update of a rollout uses the same lr. A non-finite loss or
gradient skips that update only; the step counts as skipped (``guard/skipped_steps``) when none
of its updates was applied.

Logged over all updates of the step, on the counted tokens whose ratio is finite and positive:
``ppo/clip_frac`` (share where the clip is active: the clipped term is the smaller, so the token
gives no gradient), ``ppo/approx_kl`` (the k3 estimator (r - 1) - log r of KL(S_old || S), >= 0),
``ppo/ratio_mean``, ``ppo/ratio_max``, ``ppo/ratio_min``; ``ppo/filtered_out_frac``: the share of
counted tokens an update pushed out of the sampling filter (r = 0: no finite KL term; under
rollout.top_k / top_p only); and ``ppo/skipped_updates``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from opd_exp.config.schema import TrainConfig, whole_groups
from opd_exp.metric_names import PPO_METRICS as PPO_METRICS  # the names PPO logs, owned there
from opd_exp.training.monitors import Tally
from opd_exp.training.objective import loss_normalizer
from opd_exp.training.rollout import Batch


def select_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """The rows ``rows`` of ``batch`` (whole sequences, same padding): ``Batch.select``."""
    return batch.select(rows)


def mini_batch_rows(n_rows: int, mini_batches: int, generator: torch.Generator, group: int = 1) -> list[torch.Tensor]:
    """A random partition of ``range(n_rows)`` into ``mini_batches`` near-equal sets of whole groups of
    ``group`` consecutive rows (a prompt's samples, kept together for a leave-one-out baseline; 1: rows)."""
    groups = torch.randperm(n_rows // group, generator=generator).tensor_split(mini_batches)
    return [(g[:, None] * group + torch.arange(group)).reshape(-1) for g in groups] if group > 1 else list(groups)


@dataclasses.dataclass
class Piece:
    """One micro-batch of an update, with what the scoring pass fixed for its rows."""

    batch: Batch
    old_logprobs: torch.Tensor  # [n, R] log S_old(y)
    advantages: torch.Tensor  # [n, R]
    counted: torch.Tensor  # [n, R] bool


class PpoUpdates:
    """The updates of one rollout: the schedule (epochs, mini-batches, the order of the rows) and the
    ratio statistics. The forwards go through the trainer's LM head (``training/heads.py``: the
    materialised or the fused one), which scores the rollout once (``behaviour``) and runs each
    update's ratio loss and backward (``ratio_backward``); the trainer hands in the head, its teacher
    check, the optimizer and the trainable parameters."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        head,
        check_teacher: Callable[[torch.Tensor], None],
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        warn: Callable[[str], None],
        after_update: Callable[[], None] = lambda: None,
    ):
        self.cfg, self.head, self.check_teacher = cfg, head, check_teacher
        self.optimizer, self.params, self.warn = optimizer, params, warn
        self.last_updates: list[dict[str, float]] = []  # per update of the last step (tests, debugging)
        self.after_update = after_update  # every applied update: a teacher made from the student follows it

    def _order(self, n_rows: int, step: int, epoch: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + step * 1009 + epoch) % (2**63))
        group = whole_groups(self.cfg)  # the scoring pass's micro-batches hold a prompt's samples whole
        return mini_batch_rows(n_rows, self.cfg.loss.ppo_mini_batches, g, group[1] if group else 1)

    def _micro(self, rows: torch.Tensor) -> list[torch.Tensor]:
        size = self.cfg.trainer.micro_batch_size
        return list(rows.split(size)) if size > 0 else [rows]

    def step(self, batch: Batch, n_tokens: int, step: int) -> tuple[float, Tally, float, str | None]:
        """All updates of the rollout ``batch`` (``n_tokens`` response tokens; ``step`` 1-based):
        (mean loss over updates, the step's metrics, mean gradient norm, problem or None)."""
        lo = self.cfg.loss
        first = [self._micro(r) for r in self._order(batch.num_sequences, step, 0)]
        total = loss_normalizer(self.cfg, n_tokens, batch.num_sequences)  # loss.normalizer: tokens, or rows x max_new_tokens
        tally, pieces = self._behaviour(batch, [m for mb in first for m in mb], total, step)
        # what the scoring pass fixed, per row of the rollout (later epochs regroup the rows)
        rows = torch.cat([m for mb in first for m in mb])
        where = torch.empty_like(rows)
        where[rows] = torch.arange(rows.numel())
        old, adv, counted = (torch.cat(x) for x in zip(*((p.old_logprobs, p.advantages, p.counted) for p in pieces)))

        def piece(r: torch.Tensor) -> Piece:
            at = where[r].to(old.device)
            return Piece(select_rows(batch, r.to(batch.input_ids.device)), old[at], adv[at], counted[at])

        stats = {"tokens": 0.0, "filtered_out": 0.0, "clipped": 0.0, "ratio": 0.0, "kl": 0.0, "max": -math.inf, "min": math.inf}
        loss_total, norms, problems = 0.0, [], []
        self.last_updates = []
        step_one = iter(pieces)  # epoch 0 forwards the scoring pass's own micro-batches: its first ratio is exactly 1
        for epoch in range(lo.ppo_epochs):
            order = first if epoch == 0 else [self._micro(r) for r in self._order(batch.num_sequences, step, epoch)]
            for micro in order:
                group = [next(step_one) for _ in micro] if epoch == 0 else [piece(r) for r in micro]
                loss, norm, problem, record = self._update(group, stats)
                self.last_updates.append(record)
                if problem is None:
                    loss_total, norms = loss_total + loss * record["tokens_all"], [*norms, norm]
                else:
                    problems.append(problem)
        skipped = len(problems)
        n_updates = lo.ppo_updates
        if skipped:
            self.warn(
                f"opd-train: warning: step {step}: {skipped} of {n_updates} PPO updates skipped (no update from them): {problems[-1]}"
            )
        n = max(stats["tokens"], 1.0)
        tally.counts.update(
            {
                "ppo/clip_frac": stats["clipped"] / n,
                "ppo/approx_kl": stats["kl"] / n,
                "ppo/ratio_mean": stats["ratio"] / n,
                "ppo/ratio_max": stats["max"] if stats["tokens"] else 1.0,
                "ppo/ratio_min": stats["min"] if stats["tokens"] else 1.0,
                "ppo/skipped_updates": float(skipped),
                # of the counted tokens over all updates, the share an update pushed out of the filter (ratio 0)
                "ppo/filtered_out_frac": stats["filtered_out"] / max(stats["tokens"] + stats["filtered_out"], 1.0),
            }
        )
        if not norms:  # nothing applied: the step is skipped
            return float("nan"), tally, float("nan"), f"every one of the {n_updates} PPO updates: {problems[-1]}"
        # the loss over the rollout's tokens, averaged over the epochs (one update: the one-step loss)
        return loss_total / max(total, 1) / lo.ppo_epochs, tally, sum(norms) / len(norms), None

    def _behaviour(self, batch: Batch, micro: list[torch.Tensor], n_tokens: float, step: int) -> tuple[Tally, list[Piece]]:
        """The scoring pass: the teacher's scores, the advantages and the behaviour log-probs, once."""
        mbs = [select_rows(batch, r.to(batch.input_ids.device)) for r in micro]
        tally, fixed = self.head.behaviour(mbs, n_tokens=n_tokens, check_teacher=self.check_teacher)
        return tally, [Piece(mb, f.old_logprobs, f.advantages, f.counted) for mb, f in zip(mbs, fixed)]

    def _update(self, group: list[Piece], stats: dict[str, float]) -> tuple[float, float, str | None, dict[str, Any]]:
        """One optimizer step on a mini-batch: (loss, grad norm, problem or None, this update's record)."""
        tc, eps = self.cfg.trainer, self.cfg.loss.clip_eps
        # the mini-batch's own normaliser (its trained tokens, or its rows x max_new_tokens)
        n_mb = loss_normalizer(self.cfg, sum(p.batch.num_trained_tokens for p in group), sum(p.batch.num_sequences for p in group))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, n_counted, n_finite, clipped_n, r_lo, r_hi = 0.0, 0, 0, 0, math.inf, -math.inf
        for p in group:
            loss, ratio, clip_active = self.head.ratio_backward(p.batch, p, eps=eps, normalizer=n_mb)
            with torch.no_grad():
                # a token an update pushed out of the sampling filter has S(y) = 0, r = 0: no KL term of
                # it is finite (k3 would add ~707 per token), so the ratio statistics are over the rest
                # and those tokens are counted apart (ppo/filtered_out_frac)
                m = p.counted & (ratio > 0)
                r = ratio[m]
                loss_sum += loss
                n_counted += int(p.counted.sum())
                n_finite += int(m.sum())
                clipped_n += int((clip_active & m).sum())
                if r.numel():
                    r_lo, r_hi = min(r_lo, float(r.min())), max(r_hi, float(r.max()))
                    stats["ratio"] += float(r.double().sum())
                    r64 = r.double()
                    stats["kl"] += float(((r64 - 1) - torch.log(r64)).sum())  # k3 estimate of KL(S_old || S)
        record = {"tokens": float(n_finite), "tokens_all": float(n_mb), "clip_frac": clipped_n / max(n_finite, 1)}
        record["filtered_out"] = float(n_counted - n_finite)
        record.update(ratio_min=r_lo, ratio_max=r_hi, loss=loss_sum)
        stats["tokens"] += n_finite
        stats["filtered_out"] += n_counted - n_finite
        stats["clipped"] += clipped_n
        stats["min"], stats["max"] = min(stats["min"], r_lo), max(stats["max"], r_hi)
        max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        record["grad_norm"] = norm
        problem = None
        if not (math.isfinite(loss_sum) and math.isfinite(norm)):
            problem = f"loss={loss_sum}, grad/norm={norm}"
        elif n_counted:  # no counted token: no gradient, and AdamW's momentum would still move the weights
            self.optimizer.step()
            self.after_update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm, problem, record
