"""A lean in-process sampler: our own decode loop over the KV cache instead of HF ``generate``.

``generate`` runs a stack of per-token machinery (logits processors, stopping criteria,
stream and cache bookkeeping, ``torch.multinomial``) that costs about as much as the model
forwards at the embedded size. This loop does only what a rollout needs: one prefill forward,
then one forward per token over the cache, a draw from exactly ``sampling_logits`` (temperature,
then top-k, then top-p), and a stop once every row has emitted an EOS.

Draws are Gumbel-max over the processed logits: argmax(z + G), G = -log(-log U), is a draw
from softmax(z), and filtered entries (``FILTERED_LOGIT``) are never chosen. With row seeds,
row i's noise comes from its own generator, exactly as ``RowKeyedSampler`` draws it, so the
``hf`` engine with seeds and this one pick the same tokens from the same logits. Without seeds
the noise comes from torch's global RNG (seeded per step by the trainer).

The result has ``generate``'s layout (left-padded prompts, responses from column P, pad after
a row's first EOS, positional mask up to and including it) plus the engine's log-probs of its
samples, which the trainer compares with its own recomputation (``rollout/engine_logprob_gap``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence

import torch

from opd_exp.training.rollout import (
    Batch,
    RolloutEngine,
    encode_prompts,
    eos_token_ids,
    positions_from_mask,
    response_mask_from_ids,
    sampling_logits,
)


def gumbel_noise(shape: tuple[int, int], generators: Sequence[torch.Generator] | None, device) -> torch.Tensor:
    """Standard Gumbel noise [rows, V]: row i from ``generators[i]`` (as ``RowKeyedSampler``), or
    all rows from torch's global RNG."""
    rows, V = shape
    if generators is None:
        u = torch.rand(rows, V, device=device)
    else:
        u = torch.stack([torch.rand(V, generator=g, device=device) for g in generators])
    return -torch.log(-torch.log(u.clamp(min=1e-20, max=1.0 - 1e-7)))


def _cache_key(model) -> str:
    """The forward's KV-cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def lean_generate(
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
    row_seeds: Sequence[int] | None = None,
    min_new_tokens: int = 0,
) -> Batch:
    """Sample ``n_samples`` responses per prompt (rows prompt-major) with a KV-cache decode loop.

    Arguments as ``rollout.generate``. Greedy (``do_sample=False``) takes the argmax of the raw
    logits over the first ``vocab_size`` ids, as ``generate`` does. ``min_new_tokens``: EOS is
    not allowed before that many tokens (benchmarks use it to fix the response length; the
    distribution is then no longer ``sampling_logits``, so the trainer never sets it)."""
    device = next(model.parameters()).device
    ids, mask = encode_prompts(tokenizer, prompts, max_prompt_tokens)
    if n_samples > 1:
        ids = ids.repeat_interleave(n_samples, 0)
        mask = mask.repeat_interleave(n_samples, 0)
    ids, mask = ids.to(device), mask.to(device)
    N, P = ids.shape
    eos = eos_token_ids(tokenizer, model)
    eos_t = torch.tensor(eos, device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    V = vocab_size or model.get_output_embeddings().weight.shape[0]
    gens = None
    if do_sample and row_seeds is not None:
        if len(row_seeds) != N:
            raise ValueError(f"row_seeds has {len(row_seeds)} seeds for {N} rows")
        gens = [torch.Generator(device=device).manual_seed(int(s) % (2**63)) for s in row_seeds]

    was_training = model.training
    model.eval()
    try:
        attn = mask
        pos = positions_from_mask(mask)
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        key = _cache_key(model)
        cache, last_pos = getattr(out, key), pos[:, -1:]
        done = torch.zeros(N, dtype=torch.bool, device=device)
        tokens, logprobs = [], []
        for i in range(max_new_tokens):
            raw = out.logits[:, -1, :V]
            if i < min_new_tokens:
                raw = raw.float().index_fill(-1, eos_t, float("-inf"))
            if do_sample:
                z = sampling_logits(raw, temperature, top_k, top_p)
                nxt = (z + gumbel_noise((N, V), gens, device)).argmax(-1)
                logprobs.append(z.gather(-1, nxt[:, None]).squeeze(-1) - torch.logsumexp(z, -1))
            else:
                nxt = raw.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            tokens.append(nxt)
            done = done | torch.isin(nxt, eos_t)
            if i == max_new_tokens - 1 or bool(done.all()):
                break
            attn = torch.cat([attn, attn.new_ones(N, 1)], dim=1)
            last_pos = last_pos + 1
            out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos, use_cache=True, **{key: cache})
            cache = getattr(out, key)
    finally:
        model.train(was_training)

    response = torch.stack(tokens, dim=1)
    full_mask = torch.cat([mask, torch.ones_like(response)], dim=1)
    response_mask = response_mask_from_ids(response, eos)
    return Batch(
        input_ids=torch.cat([ids, response], dim=1),
        attention_mask=full_mask,
        position_ids=positions_from_mask(full_mask),
        prompt_len=P,
        response_mask=response_mask,
        prompt_index=torch.arange(len(prompts), device=device).repeat_interleave(n_samples),
        source=source,
        sampling_logprobs=torch.stack(logprobs, dim=1).masked_fill(~response_mask, 0.0) if do_sample else None,
    )


class LeanRollout(RolloutEngine):
    """In-process sampling with ``lean_generate`` over the trainer's own module
    (``rollout.engine=lean``). Covers decoder-only HF models whose forward takes
    ``position_ids``, ``past_key_values`` and ``logits_to_keep``; ``hf`` covers the rest."""

    def __init__(self, model, tokenizer, rollout_cfg, vocab_size: int, *, source: str = "student", autocast=contextlib.nullcontext):
        self.model, self.tokenizer, self.cfg, self.vocab_size = model, tokenizer, rollout_cfg, vocab_size
        self.source, self.autocast = source, autocast

    def generate(self, prompts, seeds=None, *, n_samples=1, greedy=False) -> Batch:
        ro = self.cfg
        with self.autocast():
            return lean_generate(
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
            )
