"""Greedy, batched evaluation of any HF causal LM on any Task (accuracy and format rate)."""

from __future__ import annotations

from typing import Any, Sequence

from opd_exp.tasks.base import Problem, Task


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int):
    """(input_ids, attention_mask) tensors, padded on the left so every prompt ends at the edge."""
    import torch

    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if len(s):
            ids[i, width - len(s):] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def generate_greedy(
    model: Any, tokenizer: Any, prompts: Sequence[str], batch_size: int = 64, max_new_tokens: int = 64
) -> list[str]:
    """Greedy completions (text after the prompt, cut at the first EOS) for ``prompts``."""
    import torch

    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        with torch.inference_mode():
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start:start + batch_size]
                # Chat templates already carry their special tokens; never add a second BOS.
                encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in chunk]
                ids, mask = left_pad(encoded, pad_id)
                gen = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos_id,
                    pad_token_id=pad_id,
                )
                for row in gen[:, ids.shape[1]:].tolist():
                    if eos_id is not None and eos_id in row:
                        row = row[: row.index(eos_id)]
                    out.append(tokenizer.decode(row, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return out


def evaluate_accuracy(
    model: Any,
    tokenizer: Any,
    task: Task,
    problems: Sequence[Problem],
    batch_size: int = 64,
    max_new_tokens: int = 64,
    return_completions: bool = False,
) -> dict:
    """Greedy accuracy and format rate (share of completions with a parsable ``#### n``).

    Returns ``{"accuracy", "format_rate", "n"}`` (plus ``"completions"`` when asked).
    """
    if not problems:
        return {"accuracy": 0.0, "format_rate": 0.0, "n": 0}
    prompts = [task.render_prompt(p, tokenizer) for p in problems]
    completions = generate_greedy(model, tokenizer, prompts, batch_size, max_new_tokens)
    correct = sum(task.verify(c, p.answer) for c, p in zip(completions, problems))
    formatted = sum(task.extract_answer(c) is not None for c in completions)
    result = {"accuracy": correct / len(problems), "format_rate": formatted / len(problems), "n": len(problems)}
    if return_completions:
        result["completions"] = completions
    return result
