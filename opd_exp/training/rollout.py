"""Rollout: sample responses with HF ``generate`` and lay them out as a training ``Batch``.

Layout: prompts are left-padded to a common length P, so column P is the first response
token of every row and ``logits[:, i]`` (which predicts token i+1) lines up across rows.
The response mask is positional: every token up to and including the first EOS counts,
nothing after it does (masking by token id would let the student emit padding for free).

The sampling distribution is ``sampling_logits``: logits / temperature, then top-k, then
top-p (HF's order and rules). The trainer scores the student's tokens under this same
transform, so the log-probs in every REINFORCE/PPO term are those of the distribution the
tokens were drawn from (tests compare them with generate's own processed scores).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

# Filtered-out entries get this logit instead of -inf: exp() still gives exactly 0, and
# 0 * log-prob stays finite (no NaN) in the divergence code.
FILTERED_LOGIT = -1e9


def sampling_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The logits of the distribution actually sampled from (fp32, or fp64 for fp64 logits):
    tempered, then filtered."""
    z = logits if logits.dtype == torch.float64 else logits.float()
    if temperature != 1.0:
        z = z / temperature
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, FILTERED_LOGIT)
    if top_p < 1.0:
        # HF TopPLogitsWarper: drop the lowest tokens whose cumulative mass is <= 1 - top_p,
        # always keeping the most likely one.
        sorted_z, order = torch.sort(z, dim=-1, descending=False)
        cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, FILTERED_LOGIT)
    return z


class _VocabLimit:
    """Logits processor: no mass on ids >= vocab_size (runs before HF's temperature/top-k/top-p)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, input_ids, scores):
        if scores.shape[-1] > self.vocab_size:
            scores = scores.clone()
            scores[:, self.vocab_size :] = float("-inf")
        return scores


class RowKeyedSampler:
    """Logits processor that samples each row from its own generator (Gumbel-max over
    ``sampling_logits``) and hands generate a one-hot choice (run with ``do_sample=False``).

    Row i's tokens depend only on ``seeds[i]`` and its own logits, never on which other rows
    share the batch: a global batch split across ranks samples the same tokens as one process
    (up to float-level ties between logits computed at different batch shapes)."""

    def __init__(self, seeds: Sequence[int], device, vocab_size: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        self.gens = [torch.Generator(device=device).manual_seed(int(s) % (2**63)) for s in seeds]
        self.vocab_size, self.temperature, self.top_k, self.top_p = vocab_size, temperature, top_k, top_p

    def __call__(self, input_ids, scores):
        V = self.vocab_size
        z = sampling_logits(scores[:, :V], self.temperature, self.top_k, self.top_p)
        u = torch.stack([torch.rand(V, generator=g, device=z.device) for g in self.gens])
        gumbel = -torch.log(-torch.log(u.clamp(min=1e-20, max=1.0 - 1e-7)))
        choice = (z + gumbel).argmax(-1, keepdim=True)  # a draw from softmax(z)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, choice, 0.0)


@dataclass
class Batch:
    """Prompt+response token ids of N sequences, response-aligned at column ``prompt_len``."""

    input_ids: torch.Tensor  # [N, P+R]
    attention_mask: torch.Tensor  # [N, P+R]: 0 on left padding of the prompt
    position_ids: torch.Tensor  # [N, P+R]: positions as generate used them
    prompt_len: int  # P
    response_mask: torch.Tensor  # [N, R] bool: up to and including the first EOS
    prompt_index: torch.Tensor  # [N] index of each row's problem in the step's prompt list
    source: str = "student"  # who sampled the responses: "student" or "teacher"
    # [N, R] log-probs of the sampled tokens as the rollout ENGINE computed them (vLLM only;
    # None for HF generate, whose distribution is the trainer's own): compared, not trained on
    sampling_logprobs: torch.Tensor | None = None

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    def micro_batches(self, size: int) -> Iterator[Batch]:
        """Whole sequences in slices of ``size`` rows (0: one slice); sequence credit stays intact."""
        n = self.num_sequences
        size = n if size <= 0 else size
        for start in range(0, n, size):
            sl = slice(start, start + size)
            yield replace(
                self,
                input_ids=self.input_ids[sl],
                attention_mask=self.attention_mask[sl],
                position_ids=self.position_ids[sl],
                response_mask=self.response_mask[sl],
                prompt_index=self.prompt_index[sl],
                sampling_logprobs=None if self.sampling_logprobs is None else self.sampling_logprobs[sl],
            )

    def to(self, device) -> Batch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            response_mask=self.response_mask.to(device),
            prompt_index=self.prompt_index.to(device),
            sampling_logprobs=None if self.sampling_logprobs is None else self.sampling_logprobs.to(device),
        )


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding (what generate uses for a left-padded batch)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def response_mask_from_ids(response_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """True up to and including the first EOS of each row (all True when there is none)."""
    eos = torch.tensor(list(eos_ids), device=response_ids.device)
    is_eos = torch.isin(response_ids, eos).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # EOS strictly before this position
    return eos_before == 0


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
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    source: str = "student",
    vocab_size: int | None = None,
    return_scores: bool = False,
    row_seeds: Sequence[int] | None = None,
    synced_gpus: bool = False,
):
    """Sample ``n_samples`` responses per prompt (rows ordered prompt-major).

    ``vocab_size``: ids at or above it (padded embedding rows, absent from the tokenizer and
    from the other model) are never sampled; the trainer slices logits to the same size.
    ``row_seeds`` (one per row, rows = len(prompts) * n_samples): sample each row from its own
    generator (``RowKeyedSampler``) instead of torch's global RNG; the distribution is the same
    ``sampling_logits``. ``synced_gpus``: keep every rank stepping until all ranks finish
    (FSDP: each forward is a collective).
    Returns a ``Batch`` (and, with ``return_scores``, generate's processed scores
    ``[N, R, V]``, for tests only: they cost N*R*V floats).
    """
    from transformers import GenerationConfig, LogitsProcessorList

    device = next(model.parameters()).device
    ids, mask = encode_prompts(tokenizer, prompts, max_prompt_tokens)
    if n_samples > 1:
        ids = ids.repeat_interleave(n_samples, 0)
        mask = mask.repeat_interleave(n_samples, 0)
    eos = eos_token_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        do_sample=do_sample,
        return_dict_in_generate=True,
        output_scores=return_scores,
    )
    processors = [_VocabLimit(vocab_size)] if vocab_size else []
    if do_sample and row_seeds is not None:
        if len(row_seeds) != ids.shape[0]:
            raise ValueError(f"row_seeds has {len(row_seeds)} seeds for {ids.shape[0]} rows")
        V = vocab_size or model.get_output_embeddings().weight.shape[0]
        processors = [RowKeyedSampler(row_seeds, device, V, temperature, top_k, top_p)]
        kwargs["do_sample"] = False  # the processor has drawn the token: generate takes the argmax
    elif do_sample:
        # top_k=0 and top_p=1.0 switch those filters off (HF's own defaults would apply top_k=50).
        kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p)
    gen_cfg = GenerationConfig(**kwargs)
    was_training = model.training
    model.eval()
    extra = {"synced_gpus": True} if synced_gpus else {}
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        generation_config=gen_cfg,
        logits_processor=LogitsProcessorList(processors) if processors else None,
        **extra,
    )
    model.train(was_training)
    seq = out.sequences
    P = ids.shape[1]
    response = seq[:, P:]
    full_mask = torch.cat([mask.to(device), torch.ones_like(response)], dim=1)
    batch = Batch(
        input_ids=seq,
        attention_mask=full_mask,
        position_ids=positions_from_mask(full_mask),
        prompt_len=P,
        response_mask=response_mask_from_ids(response, eos),
        prompt_index=torch.arange(len(prompts), device=device).repeat_interleave(n_samples),
        source=source,
    )
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

    source: str = "student"

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[str], seeds: Sequence[int] | None = None, *, n_samples: int = 1, greedy: bool = False
    ) -> Batch: ...

    def sync(self, model, version: int) -> None:  # noqa: B027 - optional hook: in-process engines need none
        """Make the engine sample ``model``'s current weights (``version``: the trainer step).
        In-process engines sample the live module and need nothing."""


class HfRollout(RolloutEngine):
    """In-process sampling with Hugging Face ``generate`` over the trainer's own module."""

    def __init__(
        self,
        model,
        tokenizer,
        rollout_cfg,
        vocab_size: int,
        *,
        source: str = "student",
        autocast=contextlib.nullcontext,
        synced_gpus: bool = False,
    ):
        self.model, self.tokenizer, self.cfg, self.vocab_size = model, tokenizer, rollout_cfg, vocab_size
        self.source, self.autocast, self.synced_gpus = source, autocast, synced_gpus

    def generate(self, prompts, seeds=None, *, n_samples=1, greedy=False) -> Batch:
        ro = self.cfg
        with self.autocast():
            return generate(
                self.model,
                self.tokenizer,
                prompts,
                n_samples=n_samples,
                do_sample=not greedy,
                max_new_tokens=ro.max_new_tokens,
                max_prompt_tokens=ro.max_prompt_tokens,
                temperature=ro.temperature,
                top_k=ro.top_k,
                top_p=ro.top_p,
                source=self.source,
                vocab_size=self.vocab_size,
                row_seeds=None if greedy else seeds,
                synced_gpus=self.synced_gpus and not greedy,
            )
