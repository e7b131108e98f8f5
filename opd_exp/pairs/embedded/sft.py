"""Supervised fine-tuning on worked solutions: how the embedded teacher and student are made.

One readable loop: right-padded batches of prompt + solution + EOS, cross-entropy on the
solution tokens only, AdamW with linear warm-up and cosine decay.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from opd_exp.tasks.base import Problem, render_prompt


def encode_sft(tokenizer: Any, problems: Sequence[Problem]):
    """(ids, loss_mask, lengths): right-padded ``prompt + solution + EOS``; mask marks solution+EOS,
    less a problem's ``env_spans`` (character spans of its solution an environment writes)."""
    import itertools

    import torch

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # Prompt and solution are tokenized apart so the loss mask falls exactly on the solution.
    prompts = tokenizer([render_prompt(p.prompt, tokenizer) for p in problems], add_special_tokens=False)["input_ids"]
    targets = tokenizer([p.solution for p in problems], add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id]
    rows = [p + t + eos for p, t in zip(prompts, targets)]
    lengths = torch.tensor([len(r) for r in rows])
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    cols = torch.arange(int(lengths.max()))[None, :]
    inside = cols < lengths[:, None]
    ids = torch.full(inside.shape, pad_id, dtype=torch.long)
    ids[inside] = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.long)  # row-major fill
    mask = inside & (cols >= prompt_lengths[:, None])
    for i, p in enumerate(problems):  # text an environment writes (a tool's result): in the context, never a target
        spans = getattr(p, "env_spans", ())
        if spans:
            offsets = tokenizer(p.solution, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            for j, (a, b) in enumerate(offsets):
                if any(lo <= a and b <= hi for lo, hi in spans):
                    mask[i, len(prompts[i]) + j] = False
    return ids, mask, lengths


def _epoch_batches(lengths, batch_size: int, gen) -> list:
    """One epoch of random batches in random order (fewer problems than one batch: all of
    them). Rows inside a batch are ordered by length: the cached pairs were built this way,
    and the same draws rebuild the same weights."""
    import torch

    order = torch.randperm(len(lengths), generator=gen)
    batches = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    batches = [b[torch.argsort(lengths[b], stable=True)] for b in batches] or [order]
    return [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to lr/10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sft_train(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    warmup_frac: float = 0.05,
    weight_decay: float = 0.01,
    progress: bool | str = False,
    on_step: Callable[[int, float], None] | None = None,
) -> dict:
    """Train ``model`` in place for ``steps`` steps; returns ``{"loss", "steps", "seconds"}``.

    ``progress`` shows a tqdm bar (a string is used
    as its label). Right padding needs no
    attention mask: with causal attention, padding after a sequence never influences it.
    """
    import torch
    import torch.nn.functional as F

    started = time.perf_counter()
    if steps <= 0:
        return {"loss": float("nan"), "steps": 0, "seconds": 0.0}
    ids, mask, lengths = encode_sft(tokenizer, problems)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
    warmup = max(1, int(warmup_frac * steps))
    model.train()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=progress if isinstance(progress, str) else "SFT", unit="step")
    batches: list = []
    ema = None
    for step in range(steps):
        if not batches:
            batches = _epoch_batches(lengths, batch_size, gen)
        idx = batches.pop()
        width = int(lengths[idx].max())
        x, m = ids[idx, :width], mask[idx, :width]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        logits = model(input_ids=x).logits
        # Logits at position i predict token i+1.
        loss = F.cross_entropy(logits[:, :-1][m[:, 1:]], x[:, 1:][m[:, 1:]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if on_step is not None:
            on_step(step, value)
        if bar is not None:
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{ema:.3f}")
    if bar is not None:
        bar.close()
    model.eval()
    return {"loss": ema, "steps": steps, "seconds": time.perf_counter() - started}
