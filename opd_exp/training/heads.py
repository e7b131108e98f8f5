"""The LM head of a training step, picked once: ``MaterialisedHead`` (both models' ``[N, R, V]``
logits per micro-batch) or the fused one (``training/fused.py``: chunks of positions from hidden
states). Both take a step's micro-batches and return the step's loss and ``Tally``, gradients in
the student's ``.grad``; the trainer never asks which it has.

Gradients equal those of the whole batch: every micro-batch's loss is divided by the step's
GLOBAL response-token count. Under DDP/FSDP each rank's loss is scaled by the world size (they
average gradients), every rank runs the same number of micro-batches (one without response
tokens too), and the teacher check is agreed on by all ranks before any backward (a collective
missed by one rank would hang the others). The student is scored with dropout off (as it
sampled), gradients kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from opd_exp.runtime import distributed as dist_util
from opd_exp.training.fused import build_fused_head
from opd_exp.training.monitors import Monitors, Tally
from opd_exp.training.objective import Objective
from opd_exp.training.ratio import Fixed, ratio_terms
from opd_exp.training.rollout import Batch
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import TeacherScorer, dropout_off, student_logits, token_logprobs


class MaterialisedHead:
    def __init__(
        self,
        objective: Objective,
        monitors: Monitors,
        student,
        train_module,
        teacher_scorer: TeacherScorer,
        dist,
        *,
        rollout,
        vocab_size: int,
        autocast,
    ):
        self.objective, self.monitors, self.teacher_scorer = objective, monitors, teacher_scorer
        self.student, self.train_module, self.dist = student, train_module, dist
        self.vocab_size, self.autocast = vocab_size, autocast
        self.sampling = SamplingSpec.from_rollout(rollout)

    def student_logits(self, module, batch: Batch) -> torch.Tensor:
        """The student's sampling-distribution logits ``[N, R, V]`` (with grad)."""
        with self.autocast():
            return student_logits(module, batch, self.vocab_size, self.sampling)

    def accumulate(self, mbs: list[Batch], *, on_policy: bool, n_tokens: int, check_teacher: Callable) -> tuple[float, Tally]:
        # every micro-batch's teacher scores asked for now (a served teacher scores micro-batch
        # i+1 while this process works on i), used in order; a failure stops before any update
        pending = [self.teacher_scorer.submit(mb) for mb in mbs]
        try:
            return self._accumulate(mbs, pending, on_policy, n_tokens, check_teacher)
        finally:
            for p in pending:
                p.cancel()

    def _accumulate(self, mbs, pending, on_policy: bool, n_tokens: int, check_teacher) -> tuple[float, Tally]:
        ds, module = self.dist, self.train_module
        loss_total, tally = 0.0, Tally()
        for i, mb in enumerate(mbs):
            if mb.num_trained_tokens == 0 and not ds.active:
                continue
            zt = pending[i].result()
            check_teacher(zt.finite_check())
            last = i == len(mbs) - 1
            with dropout_off(self.student):  # forward and backward: a recompute sees the same modes
                with dist_util.no_sync(module, ds, last=last):
                    zs = self.student_logits(module, mb)
                out = self.objective(
                    zs,
                    zt,
                    mb.response_ids,
                    mb.trained_mask,
                    on_policy=on_policy,
                    normalizer=n_tokens,
                    reward_advantages=mb.reward_advantages,
                    behaviour_logprobs=mb.behaviour_logprobs,
                )
                with dist_util.no_sync(module, ds, last=last):
                    (out.loss * ds.world_size if ds.active else out.loss).backward()
            loss_total += float(out.loss.detach())
            tally.add(out)
            tally.add(self.monitors(zs, zt, out, engine_logprobs=mb.sampling_logprobs))
        return loss_total, tally

    # -- several PPO updates per rollout (training/ppo.py): a scoring pass, then ratio losses --------
    def behaviour(self, mbs: list[Batch], *, n_tokens: float, check_teacher: Callable) -> tuple[Tally, list[Fixed]]:
        """The scoring pass, before any update and without gradient: the teacher's scores, the
        objective's advantages and the behaviour log-probs of each micro-batch, and the step's metrics."""
        pending = [self.teacher_scorer.submit(mb) for mb in mbs]
        tally, fixed = Tally(), []
        try:
            for mb, p in zip(mbs, pending):
                scores = p.result()
                check_teacher(scores.finite_check())
                with torch.no_grad(), dropout_off(self.student):
                    zs = self.student_logits(self.train_module, mb)
                    out = self.objective(
                        zs,
                        scores,
                        mb.response_ids,
                        mb.trained_mask,
                        on_policy=True,
                        normalizer=n_tokens,
                        reward_advantages=mb.reward_advantages,
                    )
                tally.add(out)
                tally.add(self.monitors(zs, scores, out, engine_logprobs=mb.sampling_logprobs))
                fixed.append(Fixed(out.logprobs, out.advantages, out.counted))
                del zs, scores
        finally:
            for p in pending:
                p.cancel()
        return tally, fixed

    def ratio_backward(self, batch: Batch, fixed: Fixed, *, eps: float, normalizer: float):
        """One micro-batch's PPO loss against its fixed behaviour, backward into the student:
        (loss, ratio [n, R], clip active [n, R]), both detached."""
        with dropout_off(self.student):
            s = token_logprobs(self.student_logits(self.train_module, batch), batch.response_ids)
            loss, ratio, clip = ratio_terms(s, fixed.old_logprobs, fixed.advantages, fixed.counted, eps, normalizer)
            loss.backward()
        return float(loss.detach()), ratio.detach(), clip


def build_head(cfg, objective, monitors, student, train_module, teacher_scorer, dist, *, vocab_size, autocast):
    """``scale.fused_lm_head``: the fused head where it is picked, else the materialised one."""
    kw = dict(vocab_size=vocab_size, autocast=autocast)
    fused = build_fused_head(cfg, objective, monitors, student, teacher_scorer, **kw)
    materialised = MaterialisedHead(objective, monitors, student, train_module, teacher_scorer, dist, rollout=cfg.rollout, **kw)
    return fused or materialised, materialised
