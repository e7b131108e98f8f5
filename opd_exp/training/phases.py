"""Where a step's time goes, per phase (``perf/*``): every run accounts them.

* ``perf/generate_s``: sampling the rollout (the engine's generate; eval is not counted);
* ``perf/teacher_s``: the teacher's scores: an in-process teacher's forwards (the fused head's
  hidden states and chunk logits too), or the time the learner waited for a served teacher's reply;
* ``perf/train_s``: the student's forwards and backwards, the objective, clipping and the
  optimizer step (the step's accumulate and update, less the teacher time inside it);
* ``perf/sync_s``: weights to where they are sampled or scored after an update (a vLLM engine's
  push, a teacher made from the student);
* ``perf/wait_s``: the learner waiting for a rollout producer (0 when the loop is synchronous);
* ``perf/<phase>_tokens_per_s``: sampled tokens / generate, scored tokens / teacher, trained tokens /
  train seconds; ``perf/peak_memory_gib``: the process's peak resident memory (CPU) or peak CUDA
  allocation so far.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time

import torch

PHASES = ("generate", "teacher", "train", "sync", "wait")


class PhaseClock:
    """Seconds per phase since the last ``take``; phases nest (a teacher call inside the train
    phase is counted as teacher, not train)."""

    def __init__(self):
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._inner = 0.0  # seconds of nested phases inside the one running now

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start, outer_inner, self._inner = time.perf_counter(), self._inner, 0.0
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.totals[phase] += spent - self._inner  # minus the nested phases' own time
            self._inner = outer_inner + spent

    def reset(self) -> None:
        """Forget what was counted outside a step (an eval's teacher calls)."""
        self.totals, self._inner = dict.fromkeys(PHASES, 0.0), 0.0

    def take_for(self, batch, device: torch.device | None = None) -> dict[str, float]:
        """``take`` for a step's ``Batch``: its response tokens sampled and scored, its own tokens trained."""
        return self.take(
            sampled=batch.num_response_tokens, scored=batch.num_response_tokens, trained=batch.num_trained_tokens, device=device
        )

    def take(self, *, sampled: int, scored: int, trained: int, device: torch.device | None = None) -> dict[str, float]:
        t, self.totals = self.totals, dict.fromkeys(PHASES, 0.0)
        out = {f"perf/{p}_s": t[p] for p in PHASES}
        for phase, n in (("generate", sampled), ("teacher", scored), ("train", trained)):
            out[f"perf/{phase}_tokens_per_s"] = n / t[phase] if t[phase] > 0 else 0.0
        out["perf/peak_memory_gib"] = peak_memory_gib(device)
        return out


class NullClock:
    """A clock that counts nothing (a head or scorer used outside a trainer)."""

    @contextlib.contextmanager
    def __call__(self, phase: str):
        yield


def peak_memory_gib(device: torch.device | None = None) -> float:
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)
