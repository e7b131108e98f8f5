"""Host-side choices that make a CPU training step cheaper without changing what it computes.

Measured on the SmolLM2 pair (one thread, batch 8, docs/benchmarks.md): about a tenth of a CPU
step went to the kernel zero-filling fresh pages, ~220k minor page faults per step. Every
tensor above glibc's mmap threshold (at most 32 MiB, dynamically raised) is mmapped on
allocation and unmapped on free, so the gradients (the 113 MB tied embedding's among them),
the [N, R, V] logits and their gradient, and foreach AdamW's parameter-sized temporary were
faulted in afresh at every step. Two fixes:

* ``keep_freed_memory``: large blocks come from the heap and freed ones stay there for the next
  step (no unmap, no trim). Peak memory is unchanged; the process keeps its peak afterwards.
* ``adamw``: the fused AdamW kernel (one pass per tensor, no temporaries), TRL's default too.
  The same update up to float rounding (fp64 runs agree to ~1e-16).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
_KEEP_BYTES = 1 << 30  # blocks up to 1 GiB from the heap; at most 2 GiB of free heap top kept
_kept = False


def keep_freed_memory() -> bool:
    """Keep freed memory in glibc's heap for reuse (once per process; a no-op elsewhere).
    Returns whether the setting is in force."""
    global _kept
    if _kept:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP_BYTES - 1))
    except (OSError, AttributeError):
        return False
    return _kept


def adamw(params, *, lr: float, weight_decay: float, device: torch.device, fsdp: bool = False) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel for the device (CPU, CUDA); FSDP2's sharded
    parameters keep the default (foreach) implementation."""
    fused = not fsdp and torch.device(device).type in ("cpu", "cuda")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
