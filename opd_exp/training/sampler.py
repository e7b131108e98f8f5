"""A lean in-process sampler: our own decode loop over the KV cache instead of HF ``generate``.

``generate`` runs a stack of per-token machinery (logits processors, stopping criteria,
stream and cache bookkeeping, ``torch.multinomial``) that costs about as much as the model
forwards at the embedded size. This loop does only what a rollout needs: one prefill forward,
then one forward per token over the cache, a draw from exactly the ``SamplingSpec``'s logits
(temperature, then top-k, then top-p), and a stop once every row has emitted an EOS.

Draws are Gumbel-max over the processed logits: argmax(z + G), G = -log(-log U), is a draw
from softmax(z), and filtered entries (``FILTERED_LOGIT``) are never chosen. With row seeds,
row i's noise comes from its own generator, exactly as ``RowKeyedSampler`` draws it, so the
``hf`` engine with seeds and this one pick the same tokens from the same logits. Without seeds
the noise comes from torch's global RNG (seeded per step by the trainer).

The result has ``generate``'s layout (left-padded prompts, responses from column P, pad after
a row's first EOS, positional mask up to and including it) plus the engine's log-probs of its
samples, which the trainer compares with its own recomputation (``rollout/logprob_gap``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from opd_exp.training.rollout import Batch, encode_prompts, eos_token_ids, positions_from_mask
from opd_exp.training.sampling import SamplingSpec, draw, row_generators


def _cache_key(model) -> str:
    """The forward's KV-cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [..., heads, d] with the Llama/Qwen2 half-split convention
    (x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)); ``cos``/``sin`` [..., 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _full_precision(cache, device: torch.device) -> bool:
    """Whether decoding runs in fp32/fp64: an fp32/fp64 key/value cache and no autocast."""
    if torch.is_autocast_enabled(device.type):
        return False
    return bool(cache.layers) and cache.layers[0].keys.dtype in (torch.float32, torch.float64)


class _Norm:
    """A Llama-style RMSNorm as one call: ``F.rms_norm`` where the module computes in fp32 on fp32
    weights (the same arithmetic); the module itself otherwise."""

    def __init__(self, module):
        self.module, self.weight = module, module.weight
        self.eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        self.fast = self.eps is not None and module.weight.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast and x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.module(x)


class StaticDecoder:
    """One-token decode steps of a Llama-style decoder (Qwen2, Llama) straight over its weights
    and a preallocated KV cache: the same arithmetic as the model's forward without the
    per-call machinery (mask building, cache objects, output capture), which at small sizes
    costs more than the arithmetic. Per layer the q/k/v and the gate/up projections run as one
    matmul each (their weights concatenated once per rollout; the weights do not change while
    it samples), rotary embedding runs once over the query and key heads together, and grouped
    query heads attend to their shared key/value head without copying it.
    ``StaticDecoder.covers(model)`` says where it applies."""

    MODEL_TYPES = ("qwen2", "llama")

    @classmethod
    def covers(cls, model) -> bool:
        cfg = getattr(model, "config", None)
        if getattr(cfg, "model_type", None) not in cls.MODEL_TYPES or getattr(cfg, "use_sliding_window", False):
            return False
        if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
            return False
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
            return False
        base = getattr(model, "base_model", None)
        layers = getattr(base, "layers", None)
        if layers is None or not hasattr(base, "rotary_emb") or not isinstance(model.get_output_embeddings(), torch.nn.Linear):
            return False
        attn = ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")
        mlp = ("gate_proj", "up_proj", "down_proj")
        linear = all(
            isinstance(getattr(layer.self_attn, a), torch.nn.Linear) for layer in layers for a in ("q_proj", "k_proj", "v_proj", "o_proj")
        ) and all(isinstance(getattr(layer.mlp, a, None), torch.nn.Linear) for layer in layers for a in mlp)
        return linear and all(hasattr(layer.self_attn, a) for layer in layers for a in attn)

    def __init__(self, model, cache, key_mask: torch.Tensor, max_new_tokens: int, vocab_size: int):
        self.model, self.base, self.V = model, model.base_model, vocab_size
        self.head = model.get_output_embeddings()
        self.final_norm = _Norm(self.base.norm)
        P = key_mask.shape[1]
        self.layers = []
        for layer, cached in zip(self.base.layers, cache.layers):
            a, mlp = layer.self_attn, layer.mlp
            k, v = cached.keys, cached.values  # [N, kv heads, P, d]
            K = k.new_zeros(k.shape[0], k.shape[1], P + max_new_tokens, k.shape[3])
            Vb = v.new_zeros(v.shape[0], v.shape[1], P + max_new_tokens, v.shape[3])
            K[:, :, :P], Vb[:, :, :P] = k, v
            projections = (a.q_proj, a.k_proj, a.v_proj)
            bias = None if a.q_proj.bias is None else torch.cat([m.bias for m in projections])
            self.layers.append(
                dict(
                    attn_norm=_Norm(layer.input_layernorm),
                    mlp_norm=_Norm(layer.post_attention_layernorm),
                    qkv=torch.cat([m.weight for m in projections]),
                    qkv_bias=bias,
                    o=a.o_proj,
                    gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    down=mlp.down_proj,
                    keys=K,
                    values=Vb,
                    d=a.head_dim,
                    kv_heads=k.shape[1],
                    heads=a.q_proj.out_features // a.head_dim,
                    scale=a.scaling,
                )
            )
        keep = torch.cat([key_mask.bool(), key_mask.new_ones(key_mask.shape[0], max_new_tokens).bool()], dim=1)
        dtype = self.layers[0]["keys"].dtype if self.layers else torch.float32
        self.mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
        self.length = P

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, V]`` after feeding ``tokens`` [N] at ``positions`` [N, 1]."""
        t = self.length
        h = self.base.embed_tokens(tokens)  # [N, hidden]
        cos, sin = self.base.rotary_emb(h[:, None], positions)  # [N, 1, d]
        mask = self.mask[:, None, None, : t + 1]  # additive: 0 or -inf (padded prompt keys)
        N = h.shape[0]
        for L in self.layers:
            d, kvh, heads = L["d"], L["kv_heads"], L["heads"]
            qkv = F.linear(L["attn_norm"](h), L["qkv"], L["qkv_bias"]).view(N, heads + 2 * kvh, d)
            qk = _rotate(qkv[:, : heads + kvh], cos, sin)
            L["keys"][:, :, t] = qk[:, heads:]
            L["values"][:, :, t] = qkv[:, heads + kvh :]
            # the query heads of one group as the "query positions" of its key/value head
            q = qk[:, :heads].reshape(N, kvh, heads // kvh, d)
            # attention written out: at one query token the fused SDPA kernel's setup costs more than the product
            scores = torch.matmul(q, L["keys"][:, :, : t + 1].transpose(-1, -2)).mul_(L["scale"]).add_(mask)
            o = torch.matmul(scores.softmax(-1), L["values"][:, :, : t + 1])
            h = h + L["o"](o.reshape(N, heads * d))
            gate, up = F.linear(L["mlp_norm"](h), L["gate_up"]).chunk(2, dim=-1)
            h = h + L["down"](F.silu(gate) * up)
        self.length = t + 1
        return self.head(self.final_norm(h))[:, : self.V]


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
    sampling: SamplingSpec = SamplingSpec(),
    source: str = "student",
    vocab_size: int | None = None,
    row_seeds: Sequence[int] | None = None,
    min_new_tokens: int = 0,
    static: bool | None = None,
    encoded: tuple[torch.Tensor, torch.Tensor] | None = None,
    stop_ids: Sequence[Sequence[int]] = (),
) -> Batch:
    """Sample ``n_samples`` responses per prompt (rows prompt-major) with a KV-cache decode loop.

    Arguments as ``rollout.generate``. Greedy (``do_sample=False``) takes the argmax of the raw
    logits over the first ``vocab_size`` ids, as ``generate`` does. ``min_new_tokens``: EOS is
    not allowed before that many tokens (benchmarks use it to fix the response length; the
    distribution is then no longer ``sampling``'s, so the trainer never sets it).
    ``static``: decode with ``StaticDecoder`` (None: where it covers the model; False: the
    model's own forward over its cache every token). ``encoded``: left-padded prompt ids and mask
    given as tokens (an episode's next turn; ``prompts`` unused). ``stop_ids``: token sequences
    that end a row as EOS does (pad after them; the layout's mask still runs to EOS: the caller
    cuts)."""
    device = next(model.parameters()).device
    ids, mask = encoded if encoded is not None else encode_prompts(tokenizer, prompts, max_prompt_tokens)
    if n_samples > 1:
        ids = ids.repeat_interleave(n_samples, 0)
        mask = mask.repeat_interleave(n_samples, 0)
    ids, mask = ids.to(device), mask.to(device)
    N = ids.shape[0]
    eos = eos_token_ids(tokenizer, model)
    eos_t = torch.tensor(eos, device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    V = vocab_size or model.get_output_embeddings().weight.shape[0]
    gens = None
    if do_sample and row_seeds is not None:
        if len(row_seeds) != N:
            raise ValueError(f"row_seeds has {len(row_seeds)} seeds for {N} rows")
        gens = row_generators(row_seeds, device)

    was_training = model.training
    model.eval()
    try:
        attn = mask
        pos = positions_from_mask(mask)
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        key = _cache_key(model)
        cache, last_pos = getattr(out, key), pos[:, -1:]
        if static is None:
            # fp32/fp64 only: in half precision (bf16/fp16 weights or autocast) the fused matmuls and
            # the written-out attention round differently from the model's own forward (~1e-3), so
            # there the model's forward over its cache decodes and samples follow it to the bit
            static = StaticDecoder.covers(model) and hasattr(cache, "layers") and _full_precision(cache, ids.device)
        decoder = StaticDecoder(model, cache, mask, max_new_tokens, V) if static else None
        raw = out.logits[:, -1, :V]
        done = torch.zeros(N, dtype=torch.bool, device=device)
        stops = [torch.tensor(list(s), device=device) for s in stop_ids if len(s)]
        tokens, logprobs = [], []
        for i in range(max_new_tokens):
            if i < min_new_tokens:
                raw = raw.float().index_fill(-1, eos_t, float("-inf"))
            if do_sample:
                z = sampling.logits(raw)
                nxt, lp = draw(z, gens)
                logprobs.append(lp)
            else:
                nxt = raw.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            tokens.append(nxt)
            done = done | torch.isin(nxt, eos_t)
            for s in stops:  # a stop sequence just completed (rows already done are padded: never match)
                if len(tokens) >= len(s):
                    done = done | (torch.stack(tokens[-len(s) :], dim=1) == s).all(-1)
            if i == max_new_tokens - 1 or bool(done.all()):
                break
            last_pos = last_pos + 1
            if decoder is not None:
                raw = decoder.step(nxt, last_pos)
                continue
            attn = torch.cat([attn, attn.new_ones(N, 1)], dim=1)
            out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos, use_cache=True, **{key: cache})
            cache = getattr(out, key)
            raw = out.logits[:, -1, :V]
    finally:
        model.train(was_training)

    response, sampled_lp = torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1) if do_sample else None
    return Batch.from_responses(ids, mask, response, eos, n_samples=n_samples, source=source, sampling_logprobs=sampled_lp)
