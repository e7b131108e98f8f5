"""Rollout: sample responses with HF ``generate`` and lay them out as a training ``Batch``.

Layout: prompts are left-padded to a common length P, so column P is the first response
token of every row and ``logits[:, i]`` (which predicts token i+1) lines up across rows.
The response mask is positional: every token up to and including the first EOS counts,
nothing after it does (masking by token id would let the student emit padding for free).

The sampling distribution is a ``SamplingSpec`` (training/sampling.py): logits / temperature,
then top-k, then top-p (HF's order and rules). The trainer scores the student's tokens under this same
transform, so the log-probs in every REINFORCE/PPO term are those of the distribution the
tokens were drawn from (tests compare them with generate's own processed scores).

Nothing else touches it: transformers fills every generation setting a call leaves unset from
the checkpoint's ``generation_config`` (repetition_penalty, no_repeat_ngram_size, min_p,
bad_words_ids, do_sample, top_k=50, ...), which the trainer would not recompute. ``generate``
runs with a blank generation config in place of the model's, applies the ``SamplingSpec``
itself (one logits processor), and greedy decoding is plain argmax. The log-prob of each
sampled token under generate's processed scores is kept (``Batch.sampling_logprobs``) for the
trainer's ``rollout/logprob_gap``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# FILTERED_LOGIT and sampling_logits: imported from here as well as from training/sampling.py
from opd_exp.training.batch import Batch as Batch
from opd_exp.training.batch import Source
from opd_exp.training.batch import positions_from_mask as positions_from_mask
from opd_exp.training.batch import response_mask_from_ids as response_mask_from_ids
from opd_exp.training.sampling import FILTERED_LOGIT as FILTERED_LOGIT
from opd_exp.training.sampling import SamplingSpec, draw, row_generators
from opd_exp.training.sampling import sampling_logits as sampling_logits


class _StopSequences:
    """A stopping criterion: a row ends once its newest tokens are one of ``stop_ids`` (an episode's
    stop strings as tokens); generate pads it from then on, as after EOS."""

    def __init__(self, stop_ids: Sequence[Sequence[int]], device):
        self.stops = [torch.tensor(list(s), device=device) for s in stop_ids if len(s)]

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for s in self.stops:
            if input_ids.shape[1] >= len(s):
                done |= (input_ids[:, -len(s) :] == s).all(-1)
        return done


class _VocabLimit:
    """Logits processor: no mass on ids >= vocab_size (runs before HF's temperature/top-k/top-p)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, input_ids, scores):
        if scores.shape[-1] > self.vocab_size:
            scores = scores.clone()
            scores[:, self.vocab_size :] = float("-inf")
        return scores


class _SamplingTransform:
    """Logits processor: the ``SamplingSpec`` on the tokenizer's ids, nothing on the padded rows
    (the only transform between the model's logits and generate's multinomial draw)."""

    def __init__(self, vocab_size: int | None, sampling: SamplingSpec = SamplingSpec()):
        self.vocab_size, self.sampling = vocab_size, sampling

    def __call__(self, input_ids, scores):
        V = min(self.vocab_size or scores.shape[-1], scores.shape[-1])
        z = self.sampling.logits(scores[:, :V])
        if scores.shape[-1] == V:
            return z
        out = torch.full(scores.shape, float("-inf"), dtype=z.dtype, device=z.device)
        out[:, :V] = z
        return out


class _SampledLogprobs:
    """Logits processor, last in the list: log softmax of generate's processed scores at the
    token generate then draws (seen at the next call, or in ``finish``). Holds one step's
    scores and an [N] column per step, never the [N, R, V] scores."""

    def __init__(self):
        self.columns: list[torch.Tensor] = []
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def _take(self, ids: torch.Tensor) -> None:
        if self._last is not None:
            scores, lse = self._last
            self.columns.append(scores.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse)
            self._last = None

    def __call__(self, input_ids, scores):
        self._take(input_ids[:, -1])
        self._last = (scores, torch.logsumexp(scores.float(), dim=-1))
        return scores

    def finish(self, sequences: torch.Tensor, n_new: int) -> torch.Tensor:
        self._take(sequences[:, -1])
        cols = self.columns[:n_new]
        if not cols:
            return torch.zeros(sequences.shape[0], 0, device=sequences.device)
        return torch.stack(cols, dim=1).float()


class RowKeyedSampler:
    """Logits processor that samples each row from its own generator (Gumbel-max over the
    ``SamplingSpec``'s logits) and hands generate a one-hot choice (run with ``do_sample=False``).

    Row i's tokens depend only on ``seeds[i]`` and its own logits, never on which other rows
    share the batch: a global batch split across ranks samples the same tokens as one process
    (up to float-level ties between logits computed at different batch shapes)."""

    def __init__(self, seeds: Sequence[int], device, vocab_size: int, sampling: SamplingSpec = SamplingSpec()):
        self.gens = row_generators(seeds, device)
        self.vocab_size, self.sampling = vocab_size, sampling
        self.columns: list[torch.Tensor] = []  # [N] log-prob of each step's draw under softmax(z)

    def __call__(self, input_ids, scores):
        V = self.vocab_size
        choice, logprob = draw(self.sampling.logits(scores[:, :V]), self.gens)
        self.columns.append(logprob)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, choice[:, None], 0.0)


@dataclass(frozen=True)
class Draw:
    """Which rows of a step's global batch this process samples (prompt-major), and how:
    ``seeds`` one per row, from (seed, step, global row), so a row's tokens do not depend on which
    rows share the batch (several ranks); or None: torch's RNG, which the trainer seeds per step
    (one process; an engine without a global RNG, vLLM, draws its per-row seeds from it)."""

    rows: range
    seeds: list[int] | None

    @classmethod
    def for_step(cls, seed: int, step: int, n_rows: int, dist) -> Draw:
        from opd_exp.runtime import distributed as dist_util

        rows = range(n_rows)[dist_util.shard(n_rows, dist)]
        return cls(rows, dist_util.row_seeds(seed, step, rows) if dist.row_keyed else None)


def count_truncated(tokenizer, prompts: Sequence[str], cap: int, warn_once=None) -> int:
    """How many rendered prompts are longer than ``cap`` tokens (``encode_prompts`` keeps their last
    ones); ``warn_once(kind, text)``: said once per run, counted per step (rollout/truncated_prompts)."""
    n = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) > cap for p in prompts)
    if n and warn_once is not None:
        warn_once(
            "truncated",
            f"{n} of {len(prompts)} prompts are longer than rollout.max_prompt_tokens={cap} and are cut "
            f"from the left (the last {cap} tokens are kept); counted in rollout/truncated_prompts",
        )
    return n


def eos_token_ids(tokenizer, model=None) -> list[int]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if src is None:
            continue
        ids.extend(src if isinstance(src, (list, tuple)) else [src])
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id: responses could never end")
    return sorted({int(i) for i in ids})


def encode_prompts(tokenizer, prompts: Sequence[str], max_prompt_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask; prompts longer than the cap keep their last tokens."""
    # Rendered prompts (chat templates) carry their own special tokens, as in SFT: add none.
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"][-max_prompt_tokens:] for p in prompts]
    P = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids(tokenizer)[0]
    ids = torch.full((len(rows), P), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, P - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, P - len(r) :] = 1
    return ids, mask


# The neutral value of every generation setting that changes generate's logits processors
# (transformers 5 names); None-valued ones (min_p, bad_words_ids, sequence_bias, ...) stay off
# because the model's generation config is swapped out while generate runs.
NEUTRAL_GENERATION: dict[str, Any] = dict(
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    typical_p=1.0,
    epsilon_cutoff=0.0,
    eta_cutoff=0.0,
    repetition_penalty=1.0,
    encoder_repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    encoder_no_repeat_ngram_size=0,
    min_length=0,
    num_beams=1,
    num_return_sequences=1,
    length_penalty=1.0,
    diversity_penalty=0.0,
    renormalize_logits=False,
    remove_invalid_values=False,
)
_SAMPLING_KEYS = (
    "do_sample",
    "min_p",
    "top_h",
    "bad_words_ids",
    "sequence_bias",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "min_new_tokens",
    "guidance_scale",
    "watermarking_config",
    *NEUTRAL_GENERATION,
)


def checkpoint_sampling_settings(model) -> dict[str, Any]:
    """The settings of ``model.generation_config`` that would change what generate samples
    (e.g. ``{"repetition_penalty": 1.1, "do_sample": True}``): rollouts and evaluation ignore
    them; the trainer says so once."""
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return {}
    found = {}
    for key in _SAMPLING_KEYS:
        value = getattr(gen, key, None)
        if value is None or value is False or value == NEUTRAL_GENERATION.get(key):
            continue
        found[key] = value
    return found


@contextlib.contextmanager
def blank_generation_config(model):
    """While generate runs: a blank ``generation_config`` on every module that carries one (the
    model, and the base model under a peft wrapper), so transformers fills nothing from it."""
    from transformers import GenerationConfig

    held = [(m, m.generation_config) for m in model.modules() if "generation_config" in vars(m)]
    try:
        for m, _ in held:
            m.generation_config = GenerationConfig()
        yield
    finally:
        for m, gen in held:
            m.generation_config = gen


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    n_samples: int = 1,
    max_new_tokens: int = 32,
    max_prompt_tokens: int = 256,
    do_sample: bool = True,
    sampling: SamplingSpec = SamplingSpec(),
    source: Source | str = Source.student,
    vocab_size: int | None = None,
    return_scores: bool = False,
    row_seeds: Sequence[int] | None = None,
    synced_gpus: bool = False,
    encoded: tuple[torch.Tensor, torch.Tensor] | None = None,
    stop_ids: Sequence[Sequence[int]] = (),
):
    """Sample ``n_samples`` responses per prompt (rows ordered prompt-major).

    ``vocab_size``: ids at or above it (padded embedding rows, absent from the tokenizer and
    from the other model) are never sampled; the trainer slices logits to the same size.
    ``row_seeds`` (one per row, rows = len(prompts) * n_samples): sample each row from its own
    generator (``RowKeyedSampler``) instead of torch's global RNG; the distribution is the same
    ``sampling``. ``synced_gpus``: keep every rank stepping until all ranks finish
    (FSDP: each forward is a collective). ``encoded``: left-padded prompt ids and mask given as
    tokens (an episode's next turn; ``prompts`` unused). ``stop_ids``: token sequences that end a
    row as EOS does (pad after them; the layout's mask still runs to EOS: the caller cuts).
    Whatever the model's ``generation_config`` sets is ignored (``blank_generation_config``):
    sampling draws from exactly ``sampling``'s logits, greedy is plain argmax.
    Returns a ``Batch`` (and, with ``return_scores``, generate's processed scores
    ``[N, R, V]``, for tests only: they cost N*R*V floats).
    """
    from transformers import GenerationConfig, LogitsProcessorList

    device = next(model.parameters()).device
    ids, mask = encoded if encoded is not None else encode_prompts(tokenizer, prompts, max_prompt_tokens)
    if n_samples > 1:
        ids = ids.repeat_interleave(n_samples, 0)
        mask = mask.repeat_interleave(n_samples, 0)
    eos = eos_token_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    # Every setting that could reshape the distribution, at its neutral value (and the model's
    # own generation config swapped out below, so no unset field is filled from it).
    kwargs = dict(
        NEUTRAL_GENERATION,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        do_sample=do_sample,
        return_dict_in_generate=True,
        output_scores=return_scores,
    )
    recorder = None
    if do_sample and row_seeds is not None:
        if len(row_seeds) != ids.shape[0]:
            raise ValueError(f"row_seeds has {len(row_seeds)} seeds for {ids.shape[0]} rows")
        V = vocab_size or model.get_output_embeddings().weight.shape[0]
        recorder = RowKeyedSampler(row_seeds, device, V, sampling)
        processors = [recorder]
        kwargs["do_sample"] = False  # the processor has drawn the token: generate takes the argmax
    elif do_sample:
        recorder = _SampledLogprobs()
        processors = [_SamplingTransform(vocab_size, sampling), recorder]
    else:  # greedy: argmax of the model's logits on the tokenizer's ids (no filter changes it)
        processors = [_VocabLimit(vocab_size)] if vocab_size else []
    if not kwargs["do_sample"]:  # sampling-only flags: transformers warns when they are set for argmax
        for key in ("temperature", "top_k", "top_p", "typical_p", "epsilon_cutoff", "eta_cutoff"):
            del kwargs[key]
    gen_cfg = GenerationConfig(**kwargs)
    was_training = model.training
    model.eval()
    extra = {"synced_gpus": True} if synced_gpus else {}
    if stop_ids:
        from transformers import StoppingCriteriaList

        extra["stopping_criteria"] = StoppingCriteriaList([_StopSequences(stop_ids, device)])
    with blank_generation_config(model):
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=gen_cfg,
            logits_processor=LogitsProcessorList(processors) if processors else None,
            **extra,
        )
    model.train(was_training)
    seq = out.sequences
    response = seq[:, ids.shape[1] :]
    sampled_lp = None
    if isinstance(recorder, _SampledLogprobs):
        sampled_lp = recorder.finish(seq, response.shape[1])
    elif recorder is not None:
        sampled_lp = torch.stack(recorder.columns[: response.shape[1]], dim=1).float()
    batch = Batch.from_responses(ids, mask, response, eos, n_samples=n_samples, source=source, sampling_logprobs=sampled_lp)
    if return_scores:
        return batch, torch.stack(out.scores, dim=1)
    return batch


def decode_responses(tokenizer, batch: Batch) -> list[str]:
    """Response text of each row, cut at the first EOS (which is not part of the text)."""
    texts = []
    for ids, m in zip(batch.response_ids.tolist(), batch.response_mask.tolist()):
        kept = [i for i, keep in zip(ids, m) if keep]
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
    return texts


class RolloutEngine(abc.ABC):
    """Samples responses of one model and lays them out as a ``Batch``.

    ``seeds`` (one per row, rows prompt-major): each row is drawn from its own generator, so a
    row's tokens do not depend on which other rows share the batch (ranks, engines); None draws
    from torch's global RNG, seeded per step by the trainer. ``greedy`` is evaluation.
    """

    source: Source | str = Source.student
    # an engine with a copy of the weights of its own (vLLM), loaded by ``push_weights(named tensors,
    # version)``: with rollout.staleness > 0 it is the producer itself (training/producer.py)
    holds_weights: bool = False

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[str], seeds: Sequence[int] | None = None, *, n_samples: int = 1, greedy: bool = False
    ) -> Batch: ...

    def sync(self, model, version: int) -> None:  # noqa: B027 - optional hook: in-process engines need none
        """Make the engine sample ``model``'s current weights (``version``: the trainer step).
        In-process engines sample the live module and need nothing."""

    # what an episode (training/episodes.py) asks of an engine besides ``sample_turns``: the ids that end
    # a turn as EOS, the pad id, and where its batches live
    eos_ids: list[int]
    pad: int
    device: torch.device = torch.device("cpu")

    def sample_turns(self, contexts: list[list[int]], caps: list[int], seeds: list[int] | None, *, greedy: bool, stop_ids) -> Turns:
        """One turn of each episode (``training/episodes.py``): row j continues ``contexts[j]`` (its
        tokens so far, the prompt included) by up to ``caps[j]`` tokens, ending early at EOS or at one
        of ``stop_ids`` where the engine can (the caller cuts each row at its turn's end: tokens after
        it are discarded, a stopping rule). ``seeds``: one per row for this turn, or None (torch's RNG).
        An engine that does not override this cannot run episodes (one line at start-up)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Turns:
    """What ``sample_turns`` returns: each row's new tokens, and the engine's log-probs of them under
    the sampled distribution (None: greedy, or an engine that reports none)."""

    tokens: list[list[int]]
    logprobs: list[list[float]] | None
    dtype: torch.dtype = torch.float32  # the log-probs' dtype in the batch


class ModuleRollout(RolloutEngine):
    """In-process sampling over the trainer's own module by one decoder, a plug-in with
    ``generate``'s signature: Hugging Face ``generate`` (``rollout.engine=hf``, the default
    here) or our KV-cache loop ``sampler.lean_generate`` (``lean``; decoder-only models whose
    forward takes ``position_ids``, ``past_key_values`` and ``logits_to_keep``). Both draw from
    the same ``SamplingSpec`` distribution and build the same ``Batch``.
    ``rollout_cfg``: the lengths (``max_new_tokens``, ``max_prompt_tokens``) and, unless
    ``sampling`` is given, the sampling settings."""

    def __init__(
        self,
        model,
        tokenizer,
        rollout_cfg,
        vocab_size: int,
        *,
        source: Source | str = Source.student,
        autocast=contextlib.nullcontext,
        synced_gpus: bool = False,
        sampling: SamplingSpec | None = None,
        decoder=None,
    ):
        self.model, self.tokenizer, self.cfg, self.vocab_size = model, tokenizer, rollout_cfg, vocab_size
        self.decoder = decoder or generate
        self.sampling = sampling or SamplingSpec.from_rollout(rollout_cfg)
        self.source, self.autocast, self.synced_gpus = source, autocast, synced_gpus

    def generate(self, prompts, seeds=None, *, n_samples=1, greedy=False) -> Batch:
        ro = self.cfg
        # FSDP: every rank keeps stepping until all finish (only HF generate is allowed there)
        synced = {"synced_gpus": True} if self.synced_gpus and not greedy else {}
        with self.autocast():
            return self.decoder(
                self.model,
                self.tokenizer,
                prompts,
                n_samples=n_samples,
                do_sample=not greedy,
                max_new_tokens=ro.max_new_tokens,
                max_prompt_tokens=ro.max_prompt_tokens,
                sampling=self.sampling,
                source=self.source,
                vocab_size=self.vocab_size,
                row_seeds=None if greedy else seeds,
                **synced,
            )

    @property
    def eos_ids(self) -> list[int]:
        return eos_token_ids(self.tokenizer, self.model)

    @property
    def pad(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sample_turns(self, contexts, caps, seeds, *, greedy, stop_ids) -> Turns:
        """The decoder on the episodes so far, left-padded as tokens, every row to the largest cap."""
        width = max(len(c) for c in contexts)
        ctx = torch.full((len(contexts), width), self.pad, dtype=torch.long)
        ctx_mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for j, row in enumerate(contexts):
            if row:
                ctx[j, width - len(row) :] = torch.tensor(row, dtype=torch.long)
                ctx_mask[j, width - len(row) :] = 1
        synced = {"synced_gpus": True} if self.synced_gpus and not greedy else {}
        with self.autocast():
            out = self.decoder(
                self.model,
                self.tokenizer,
                None,
                n_samples=1,
                do_sample=not greedy,
                max_new_tokens=max(caps),
                max_prompt_tokens=width,  # the episode so far is never cut (the budget bounds it)
                sampling=self.sampling,
                source=self.source,
                vocab_size=self.vocab_size,
                row_seeds=None if greedy else seeds,
                encoded=(ctx, ctx_mask),
                stop_ids=stop_ids,
                **synced,
            )
        lp = out.sampling_logprobs
        return Turns(out.response_ids.tolist(), None if lp is None else lp.tolist(), torch.float32 if lp is None else lp.dtype)


def warn_ignored_generation_settings(pair, warn) -> None:
    """One line per model whose ``generation_config`` would change what ``generate`` samples:
    rollouts and evaluation ignore it."""
    for who, model in (("student", pair.student), ("teacher", pair.teacher)):
        if ignored := checkpoint_sampling_settings(model):
            warn(
                f"opd-train: warning: the {who}'s generation_config sets "
                f"{', '.join(f'{k}={v!r}' for k, v in ignored.items())}; rollouts and evaluation ignore it "
                "(they sample exactly rollout.temperature/top_k/top_p, and greedy eval is plain argmax)"
            )
