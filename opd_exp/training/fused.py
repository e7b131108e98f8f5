"""A fused LM-head path: the objective from final hidden states, a chunk of positions at a time.

The materialised path runs both models' LM heads over every response position, so the student's
and the teacher's ``[N, R, V]`` logits (and the student's gradient of that size) exist at once:
~20 GB per tensor in fp32 at 32 x 1024 positions and V=151936. Here the models run only their
backbones (``[N, R, H]`` hidden states); then, per chunk of positions, the student's chunk of
logits is computed with grad from its hidden states and LM-head weight, the teacher's under
no_grad inside the same loop, the SAME ``Objective`` runs on the chunk, and its backward writes
the chunk's gradient into the hidden states' gradient buffer and the LM-head weight's ``.grad``.
A last backward through the student's backbone finishes the step. No tensor larger than a
chunk times V exists for either model.

Exactness: the objective is a sum over response tokens (divided by the step's global count)
and its metrics are sums, so a sum over chunks equals the whole. Per-token terms (token credit,
teacher-sampled batches) are chunked over the flattened response positions; sequence credit
couples a row's positions (returns sum its future), and so do IW-OPD's weights (each reads its
row's whole response: ``positions=iw_opd``), so those are chunked over whole rows.

Covered: decoder-only HF models whose head is a plain ``Linear`` over the backbone's last
hidden state (``model.base_model``), tied or untied, a head with more rows than the tokenizer
(sliced to ``vocab_size``). Models that scale or soft-cap their logits, LoRA students and
multi-process training use the materialised path (``scale.fused_lm_head=auto`` picks it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from opd_exp.config.scale import fused_head_limit
from opd_exp.config.schema import TrainConfig
from opd_exp.divergences.full import default_chunk_size
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.evaluate import ENTROPY
from opd_exp.training.monitors import Monitors, Tally
from opd_exp.training.objective import Objective, Output
from opd_exp.training.ratio import Fixed, ratio_terms
from opd_exp.training.rollout import Batch
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import InProcessTeacher, dropout_off, entropy, lm_head_logits, response_hidden

# Below this vocabulary the [N, R, V] logits are small and the materialised path is faster
# (one LM-head matmul instead of a Python loop over chunks): `auto` keeps it.
AUTO_MIN_VOCAB = 32768

# Config attributes of models whose logits are not plain ``hidden @ W.T + b``.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")


def unsupported_reason(model) -> str | None:
    """Why ``model``'s logits cannot be computed from its hidden states here (None: they can)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return f"its output embedding is {type(head).__name__}, not a Linear LM head"
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for attr in _LOGIT_TRANSFORMS:
        if getattr(text, attr, None) not in (None, 1.0):
            return f"its config sets {attr}={getattr(text, attr)!r} (logits are transformed after the LM head)"
    if getattr(model, "base_model", model) is model:
        return "it has no separate backbone (model.base_model is the model itself)"
    return None


def _chunks(mask: torch.Tensor, per_token: bool, positions: int):
    """Index sets of the chunks: flattened response positions (per-token terms), or whole rows."""
    N, R = mask.shape
    if per_token:
        flat = mask.reshape(-1).nonzero().squeeze(-1)
        for start in range(0, flat.numel(), positions):
            idx = flat[start : start + positions]
            yield idx // R, idx % R
    else:
        rows = max(1, positions // max(R, 1))
        for start in range(0, N, rows):
            yield torch.arange(start, min(start + rows, N), device=mask.device), None


def fused_accumulate(
    objective: Objective,
    monitors: Monitors,
    student,
    teacher: InProcessTeacher,
    batch: Batch,
    *,
    vocab_size: int,
    sampling: SamplingSpec,
    on_policy: bool,
    normalizer: float,
    chunk_positions: int | None = None,
    autocast=contextlib.nullcontext,
    check_teacher=None,
) -> Output:
    """Objective, monitors and the whole backward of one micro-batch through the fused path.

    Gradients land in the student's ``.grad`` (as ``objective(...).loss.backward()`` would put
    them); the returned loss is detached.
    ``check_teacher(z)``: called on each chunk of teacher logits before its backward (guards)."""
    cfg = objective.cfg
    mask = batch.trained_mask.bool()  # the student's own tokens
    y = batch.response_ids
    positions = chunk_positions or 2 * default_chunk_size(vocab_size)  # ~64 MiB per [chunk, V] fp32 buffer
    per_token = (not on_policy or cfg.loss.credit.value == "token") and not objective.positions.by_row
    head = student.get_output_embeddings()
    # which positions count in the loss is a property of each row's whole response: decided here,
    # before the rows are cut into chunks of positions
    counted = objective.positions.counted(mask)

    with autocast():
        h_student = response_hidden(student, batch)  # graph through the backbone kept for the last backward
    h_teacher = teacher.hidden(batch)
    h_free = h_student.detach()
    grad_h = torch.zeros_like(h_free)
    loss_total = torch.zeros((), dtype=torch.float64)
    tally = Tally()
    engine_lp = batch.sampling_logprobs  # an engine's log-probs of its samples, compared per chunk
    for rows, cols in _chunks(mask, per_token, positions):
        # per-token chunks are one pseudo-row [1, c] of response positions; row chunks keep [n, R]
        def pick(t, rows=rows, cols=cols):
            r = rows.to(t.device)
            return t[r, cols.to(t.device)].unsqueeze(0) if cols is not None else t[r]

        hc = pick(h_free).requires_grad_(True)
        zt = teacher.chunk_logits(pick(h_teacher), mask.device)
        if check_teacher is not None:
            check_teacher(zt)
        with autocast():
            zs = sampling.logits(lm_head_logits(hc, head, vocab_size))
        yc, mc = pick(y), pick(mask)
        lp_c = None if engine_lp is None else pick(engine_lp)
        reward = None if batch.reward_advantages is None else pick(batch.reward_advantages)  # reward.coef > 0
        out = objective(zs, zt, yc, mc, on_policy=on_policy, normalizer=normalizer, counted=pick(counted), reward_advantages=reward)
        out.loss.backward()  # into head.weight.grad (and bias), and hc.grad
        if cols is not None:
            grad_h[rows, cols] += hc.grad.squeeze(0)
        else:
            grad_h[rows] += hc.grad
        loss_total += out.loss.detach().double()
        tally.add(out)
        tally.add(monitors(zs, zt, out, engine_logprobs=lp_c))
        del zs, zt, out, hc
    h_student.backward(grad_h)  # through the backbone (and a tied embedding's input side)
    return Output(loss=loss_total.float(), sums=dict(tally), counts=tally.counts, maxes=tally.maxes)


@torch.no_grad()
def fused_behaviour(objective: Objective, monitors: Monitors, student, teacher: InProcessTeacher, batch: Batch, *, vocab_size: int,
                    sampling: SamplingSpec, normalizer: float, chunk_positions: int | None = None, autocast=contextlib.nullcontext,
                    check_teacher=None):  # fmt: skip
    """PPO's scoring pass through the fused path, without gradient: the objective and monitors a
    chunk at a time (as ``fused_accumulate``, no backward), and per position ``[N, R]`` what the
    updates are fixed to: the behaviour log-probs, the advantages and the counted positions."""
    cfg = objective.cfg
    mask = batch.trained_mask.bool()
    y = batch.response_ids
    positions = chunk_positions or 2 * default_chunk_size(vocab_size)
    per_token = cfg.loss.credit.value == "token" and not objective.positions.by_row
    head = student.get_output_embeddings()
    counted = objective.positions.counted(mask)
    with autocast():
        h_student = response_hidden(student, batch)
    h_teacher = teacher.hidden(batch)
    old = adv = None  # [N, R] in the objective's dtype, from the first chunk
    kept = torch.zeros_like(mask)
    tally = Tally()
    engine_lp = batch.sampling_logprobs
    for rows, cols in _chunks(mask, per_token, positions):

        def pick(t, rows=rows, cols=cols):
            r = rows.to(t.device)
            return t[r, cols.to(t.device)].unsqueeze(0) if cols is not None else t[r]

        def put(full, part, rows=rows, cols=cols):
            if cols is not None:
                full[rows, cols] = part.squeeze(0).to(full.dtype)
            else:
                full[rows] = part.to(full.dtype)

        zt = teacher.chunk_logits(pick(h_teacher), mask.device)
        if check_teacher is not None:
            check_teacher(zt)
        with autocast():
            zs = sampling.logits(lm_head_logits(pick(h_student), head, vocab_size))
        reward = None if batch.reward_advantages is None else pick(batch.reward_advantages)
        out = objective(zs, zt, pick(y), pick(mask), on_policy=True, normalizer=normalizer, counted=pick(counted), reward_advantages=reward)
        if old is None:
            old = torch.zeros(mask.shape, dtype=out.logprobs.dtype, device=mask.device)
            adv = torch.zeros(mask.shape, dtype=out.advantages.dtype, device=mask.device)
        put(old, out.logprobs)
        put(adv, out.advantages)
        put(kept, out.counted)
        tally.add(out)
        tally.add(monitors(zs, zt, out, engine_logprobs=None if engine_lp is None else pick(engine_lp)))
        del zs, zt, out
    if old is None:  # no trained token in the micro-batch
        old = adv = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return tally, old, adv, kept


def fused_ratio_backward(student, batch: Batch, fixed, *, vocab_size: int, sampling: SamplingSpec, eps: float, normalizer: float,
                         chunk_positions: int | None = None, autocast=contextlib.nullcontext):  # fmt: skip
    """One PPO update's loss on a micro-batch through the fused path: log S(y) a chunk of counted
    positions at a time from the hidden states, the clipped ratio loss per chunk, its backward into
    the hidden states' gradient, then one backward through the backbone. (loss, ratio, clip active)."""
    from opd_exp.training.scoring import token_logprobs

    counted = fixed.counted.bool()
    positions = chunk_positions or 2 * default_chunk_size(vocab_size)
    head = student.get_output_embeddings()
    with autocast():
        h_student = response_hidden(student, batch)
    h_free = h_student.detach()
    grad_h = torch.zeros_like(h_free)
    ratio = torch.ones(counted.shape, dtype=fixed.old_logprobs.dtype, device=counted.device)
    clip = torch.zeros_like(counted)
    loss_total = 0.0
    for rows, cols in _chunks(counted, True, positions):  # per-token terms: the advantages are fixed
        hc = h_free[rows, cols].unsqueeze(0).requires_grad_(True)
        with autocast():
            zs = sampling.logits(lm_head_logits(hc, head, vocab_size))
        s = token_logprobs(zs, batch.response_ids[rows, cols].unsqueeze(0))
        at = (rows, cols)
        loss, r, c = ratio_terms(s, fixed.old_logprobs[at].unsqueeze(0), fixed.advantages[at].unsqueeze(0),
                                 torch.ones_like(s, dtype=torch.bool), eps, normalizer)  # fmt: skip
        loss.backward()
        grad_h[rows, cols] += hc.grad.squeeze(0)
        ratio[at], clip[at] = r.detach().squeeze(0).to(ratio.dtype), c.squeeze(0)
        loss_total += float(loss.detach())
        del zs, hc
    h_student.backward(grad_h)
    return loss_total, ratio, clip


@torch.no_grad()
def fused_position_sums(
    student,
    teacher: InProcessTeacher,
    batch: Batch,
    divergences: Mapping,
    with_entropy: bool = False,
    *,
    vocab_size: int,
    sampling: SamplingSpec,
    chunk_positions: int | None = None,
    autocast=contextlib.nullcontext,
) -> dict[str, float]:
    """Evaluation through the fused path: sums over the response positions of each divergence's
    exact value (and with ``with_entropy`` of the student's entropy, key ``ENTROPY``), the logits
    of both models computed a chunk of positions at a time from their hidden states (no
    ``[N, R, V]``): ``Evaluator``'s ``position_sums``."""
    mask = batch.response_mask.bool()
    positions = chunk_positions or 2 * default_chunk_size(vocab_size)
    head = student.get_output_embeddings()
    with autocast():
        h_student = response_hidden(student, batch)
    h_teacher = teacher.hidden(batch) if divergences else None  # the entropy alone needs no teacher
    sums = dict.fromkeys([*divergences, *([ENTROPY] if with_entropy else [])], 0.0)
    for rows, cols in _chunks(mask, True, positions):
        with autocast():
            zs = sampling.logits(lm_head_logits(h_student[rows, cols], head, vocab_size))
        if h_teacher is not None:
            zt = teacher.chunk_logits(h_teacher[rows.to(h_teacher.device), cols.to(h_teacher.device)], mask.device)
            for name, d in divergences.items():
                sums[name] += float(d.full(zs, zt).sum())
        if with_entropy:
            sums[ENTROPY] += float(entropy(zs).sum())
    return sums


class FusedHead:
    """The fused LM-head path, built once where ``scale.fused_lm_head`` picks it: a training
    micro-batch (objective, monitors, whole backward) and eval's position sums, both with dropout
    off, from the student's and the teacher's hidden states."""

    def __init__(self, objective: Objective, monitors: Monitors, student, teacher: InProcessTeacher, *, rollout, autocast):
        self.objective, self.monitors, self.student, self.teacher = objective, monitors, student, teacher
        self.vocab_size, self.autocast = teacher.vocab_size, autocast
        self.sampling = SamplingSpec.from_rollout(rollout)
        self.chunk_positions = objective.cfg.estimator.chunk_size

    def accumulate(self, mbs: list[Batch], *, on_policy: bool, n_tokens: int, check_teacher) -> tuple[float, Tally]:
        """A step's micro-batches (one process: no collectives to keep in step)."""
        loss_total, tally = 0.0, Tally()
        for mb in mbs:
            if mb.num_trained_tokens:
                out = self._accumulate(mb, on_policy=on_policy, normalizer=n_tokens, check_teacher=check_teacher)
                loss_total += float(out.loss)
                tally.add(out)
        return loss_total, tally

    def _accumulate(self, batch: Batch, *, on_policy: bool, normalizer: float, check_teacher) -> Output:
        with dropout_off(self.student):
            return fused_accumulate(
                self.objective,
                self.monitors,
                self.student,
                self.teacher,
                batch,
                vocab_size=self.vocab_size,
                sampling=self.sampling,
                on_policy=on_policy,
                normalizer=normalizer,
                chunk_positions=self.chunk_positions,
                autocast=self.autocast,
                check_teacher=check_teacher,
            )

    def behaviour(self, mbs: list[Batch], *, n_tokens: float, check_teacher):
        """PPO's scoring pass (``MaterialisedHead.behaviour``), a chunk of positions at a time."""
        tally, fixed = Tally(), []
        for mb in mbs:
            with dropout_off(self.student):
                t, old, adv, counted = fused_behaviour(
                    self.objective, self.monitors, self.student, self.teacher, mb, vocab_size=self.vocab_size, sampling=self.sampling,
                    normalizer=n_tokens, chunk_positions=self.chunk_positions, autocast=self.autocast, check_teacher=check_teacher,
                )  # fmt: skip
            tally.add(Output(loss=torch.zeros(()), sums=dict(t), counts=t.counts, maxes=t.maxes))
            fixed.append(Fixed(old, adv, counted))
        return tally, fixed

    def ratio_backward(self, batch: Batch, fixed, *, eps: float, normalizer: float):
        with dropout_off(self.student):
            return fused_ratio_backward(
                self.student, batch, fixed, vocab_size=self.vocab_size, sampling=self.sampling, eps=eps, normalizer=normalizer,
                chunk_positions=self.chunk_positions, autocast=self.autocast,
            )  # fmt: skip

    def position_sums(self, batch: Batch, divergences: Mapping, with_entropy: bool) -> dict[str, float]:
        """Eval's per-position sums through the fused path (``Evaluator``'s ``position_sums``)."""
        with dropout_off(self.student):
            return fused_position_sums(
                self.student,
                self.teacher,
                batch,
                divergences,
                with_entropy,
                vocab_size=self.vocab_size,
                sampling=self.sampling,
                chunk_positions=self.chunk_positions,
                autocast=self.autocast,
            )


def use_fused_lm_head(cfg: TrainConfig, student, teacher, vocab_size: int) -> bool:
    """``scale.fused_lm_head``: on, off, or auto (on for real vocabularies where it is exact)."""
    mode = cfg.scale.fused_lm_head.value
    if mode == "off":
        return False
    reason = next((f"the {who} {r}" for who, m in (("student", student), ("teacher", teacher)) if (r := unsupported_reason(m))), None)
    if mode == "on":
        if reason:
            raise ConfigError(f"scale.fused_lm_head='on' is not allowed; allowed: auto or off here ({reason})")
        return True
    return reason is None and fused_head_limit(cfg) is None and vocab_size >= AUTO_MIN_VOCAB


def build_fused_head(
    cfg, objective: Objective, monitors: Monitors, student, teacher_scorer, *, vocab_size: int, autocast
) -> FusedHead | None:
    """The fused head where ``scale.fused_lm_head`` picks it; it reads the teacher's hidden states,
    so only an ``InProcessTeacher`` (never a served teacher, nor a map of several); None: the
    materialised path."""
    if not isinstance(teacher_scorer, InProcessTeacher):
        if cfg.scale.fused_lm_head.value == "on":
            raise ConfigError(
                f"scale.fused_lm_head='on' is not allowed with a {type(teacher_scorer).__name__} (the fused head reads one "
                "in-process teacher's hidden states); allowed: auto or off"
            )
        return None
    if not use_fused_lm_head(cfg, student, teacher_scorer.model, vocab_size):
        return None
    return FusedHead(objective, monitors, student, teacher_scorer, rollout=cfg.rollout, autocast=autocast)
