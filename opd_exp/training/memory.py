"""Pre-flight memory estimate of one training step, checked once the models are loaded.

A ``trainer.batch_size x rollout.n_samples`` far beyond the device's memory would otherwise
fail minutes later, inside ``generate`` or the first backward, with an out-of-memory
traceback (or, on CPU, the OOM killer's SIGKILL). The estimate counts only the two largest
tensors a step surely builds for full-length responses, so it stays below what the step
really needs: the rollout's KV cache (every row, prompt plus response) and the fp32 logits of
one micro-batch for the student and the teacher (``[rows, max_new_tokens, vocab]`` each). They
are not alive at the same time; the larger one is compared with the memory free on the
student's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from opd_exp.runtime.errors import ConfigError

GIB = 1024**3


@dataclass
class StepMemory:
    rows: int  # sequences per step: batch_size * n_samples
    micro_rows: int  # sequences per forward/backward
    kv_cache: int  # bytes: the rollout's KV cache of the student
    logits: int  # bytes: student + teacher fp32 logits of one micro-batch
    teacher_copy: int = 0  # bytes: a teacher made from the student (ema, lagged) is a second copy of its weights

    @property
    def peak(self) -> int:
        return max(self.kv_cache, self.logits) + self.teacher_copy


def _dims(model) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) from a transformers config."""
    c = getattr(model, "config", None)
    c = getattr(c, "text_config", None) or c
    layers = int(getattr(c, "num_hidden_layers", 0) or 0)
    heads = int(getattr(c, "num_attention_heads", 0) or 0)
    kv = int(getattr(c, "num_key_value_heads", 0) or heads)
    hidden = int(getattr(c, "hidden_size", 0) or 0)
    head_dim = int(getattr(c, "head_dim", 0) or (hidden // heads if heads else 0))
    return layers, kv, head_dim


def estimate(cfg, student, vocab_size: int, *, world_size: int = 1, teacher_here: bool = True) -> StepMemory:
    """``world_size``: ranks that share the batch (each samples and scores its rows);
    ``teacher_here``: the teacher's logits live on the student's device too."""
    ro, tc = cfg.rollout, cfg.trainer
    rows = -(-tc.batch_size * ro.n_samples // max(world_size, 1))  # this rank's rows
    micro = min(tc.micro_batch_size or rows, rows)
    layers, kv_heads, head_dim = _dims(student)
    itemsize = next(student.parameters()).element_size()
    seq = ro.max_prompt_tokens + ro.max_new_tokens
    kv_cache = 2 * layers * rows * seq * kv_heads * head_dim * itemsize
    logits = (2 if teacher_here else 1) * micro * ro.max_new_tokens * vocab_size * 4
    copy = sum(p.numel() * p.element_size() for p in student.parameters()) if cfg.teacher.name.value in ("ema", "lagged") else 0
    return StepMemory(rows, micro, kv_cache, logits, copy)


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on ``device`` (None: unknown, no check)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def check_step_memory(cfg, student, vocab_size: int, device: torch.device, **kw) -> StepMemory:
    """One ``ConfigError`` line when a step cannot fit, before the first rollout (``kw``: ``estimate``'s)."""
    need = estimate(cfg, student, vocab_size, **kw)
    free = available_bytes(device)
    if free is not None and need.peak > free:
        ro, tc = cfg.rollout, cfg.trainer
        total = tc.batch_size * ro.n_samples
        mine = f" ({need.rows} on this rank)" if need.rows != total else ""
        raise ConfigError(
            f"trainer.batch_size x rollout.n_samples: {tc.batch_size} x {ro.n_samples} = {total} sequences{mine} need at least "
            f"{need.peak / GIB:.1f} GiB per step on {device} (rollout KV cache {need.kv_cache / GIB:.1f} GiB for "
            f"{ro.max_prompt_tokens}+{ro.max_new_tokens} tokens; student+teacher logits of {need.micro_rows} rows "
            f"{need.logits / GIB:.1f} GiB{f'; teacher={cfg.teacher.name.value} copy of the student {need.teacher_copy / GIB:.1f} GiB' if need.teacher_copy else ''}), but {free / GIB:.1f} GiB are free; allowed: a smaller trainer.batch_size or "
            f"rollout.n_samples, a trainer.micro_batch_size > 0 below {need.micro_rows}, or fewer rollout.max_new_tokens"
        )
    return need
