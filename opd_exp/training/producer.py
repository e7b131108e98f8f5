"""Where a step's rollout comes from: sampled in the loop (``InLoop``), or by a producer that samples
``rollout.staleness`` = k updates ahead of the learner (``Producer``). The trainer asks one object
``generate(step, prompts, seeds, on_policy=)`` and never which it has.

The producer (a thread beside the learner) samples a copy of the student with the lean/HF decoder of
``rollout.engine``. The rollout of step m is sampled by the weights the learner had after
max(0, m - k) updates: the learner publishes its weights at the start of every step, the producer
loads each version it needs and runs at most k + 1 rollouts ahead, so what it samples is a function
of (seed, step, weights), never of timing: each row is drawn from its own generator keyed by (seed,
step, row) and its prompts come from a copy of the learner's data cursor (the learner checks they
are the prompts it drew). The engine's log-probs of its samples are the behaviour policy's
(``Batch.behaviour_logprobs``), which the correction's importance weights read
(``training/staleness.py``).

Resume is exact: a checkpoint after step n holds the rollouts in flight (steps n .. n+k-1, sampled
by weights the checkpoint no longer has: kept, not regenerated) and a resumed producer continues
from step n+k with the checkpoint's weights.

On CPU the thread overlaps sampling with training where torch's ops release the GIL; what that gains
on a given machine is measured, not assumed (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from typing import Any

import torch

from opd_exp.runtime import distributed as dist_util
from opd_exp.training.batch import Batch, Source
from opd_exp.training.state import DataCursor


class InLoop:
    """Today's step: the engine gets the student's weights, then samples (``perf/sync_s``, ``perf/generate_s``)."""

    def __init__(self, engines, student, phases):
        self.engines, self.student, self.phases = engines, student, phases

    def generate(self, step: int, prompts: list[str], seeds, *, on_policy: bool) -> Batch:
        engine = self.engines.student if on_policy else self.engines.teacher
        if on_policy:
            with self.phases("sync"):
                engine.sync(self.student, version=step)  # after every update: the engine samples this student
        with self.phases("generate"):
            return engine.generate(prompts, seeds)

    def metrics(self) -> dict[str, float]:
        return {}

    def state(self, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {}, {}

    def load_state(self, meta: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass
class Produced:
    step: int
    prompts: list[str]
    batch: Batch
    version: int  # the learner's update count whose weights sampled it
    generate_s: float
    wait_s: float  # the producer's wait for those weights


class Producer:
    """A thread that samples the rollout of step m with the weights of update max(0, m - k)."""

    def __init__(self, cfg, student, tokenizer, vocab_size: int, *, engine_factory, plan, cursor: DataCursor, phases):
        self.k, self.seed, self.phases = cfg.rollout.staleness, cfg.seed, phases
        self.student, self.plan, self.cursor = student, plan, cursor
        self.model = copy.deepcopy(student).eval().requires_grad_(False)
        # its own tokenizer: a fast tokenizer shared by two threads can fail ("Already borrowed")
        self.tokenizer = copy.deepcopy(tokenizer)
        self.engine = engine_factory(self.model, self.tokenizer)
        self.cv = threading.Condition()
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.ready: dict[int, Produced] = {}
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.stopping = False
        self.last: Produced | None = None
        self.learner_wait_s = 0.0

    # -- the learner's side ---------------------------------------------------------------
    def generate(self, step: int, prompts: list[str], seeds, *, on_policy: bool) -> Batch:
        with self.phases("sync"):  # the weights after `step` updates, for the rollouts k steps on
            snap = [p.detach().to("cpu", copy=True) for p in self.student.parameters()]
        with self.cv:
            self.snapshots[step] = snap
            if self.thread is None:
                self._start(step, prompts)
            self.cv.notify_all()
            t0 = time.perf_counter()
            with self.phases("wait"):
                while step not in self.ready and self.error is None:
                    self.cv.wait(timeout=1.0)
            self.learner_wait_s = time.perf_counter() - t0
            if self.error is not None:
                raise RuntimeError(f"rollout producer failed: {self.error!r}") from self.error
            for m in [m for m in self.ready if m < step]:
                del self.ready[m]
            item = self.ready[step]
        if item.prompts != list(prompts):
            raise RuntimeError(f"rollout producer: step {step} was sampled from other prompts than the learner drew (a bug)")
        self.phases.totals["generate"] += item.generate_s  # the producer's seconds, overlapped with the learner's
        self.last = item
        return dataclasses.replace(item.batch)

    def metrics(self) -> dict[str, float]:
        item = self.last
        if item is None:
            return {}
        return {
            "async/staleness": float(item.step - item.version),
            "async/learner_wait_s": self.learner_wait_s,
            "async/producer_wait_s": item.wait_s,
        }

    def state(self, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The rollouts in flight after ``step`` updates (steps step .. step+k-1): (JSON, tensors)."""
        wanted = range(step, step + self.k)
        with self.cv:
            if self.thread is None:  # nothing sampled yet in this session: what was loaded
                items = {m: self.ready[m] for m in wanted if m in self.ready}
            else:
                while not all(m in self.ready for m in wanted) and self.error is None:
                    self.cv.wait(timeout=1.0)
                if self.error is not None:
                    raise RuntimeError(f"rollout producer failed: {self.error!r}") from self.error
                items = {m: self.ready[m] for m in wanted}
        meta, tensors = {}, {}
        for m, item in items.items():
            b = item.batch
            meta[str(m)] = {"prompts": item.prompts, "version": item.version, "prompt_len": b.prompt_len, "source": b.source.value}
            for f in dataclasses.fields(b):
                value = getattr(b, f.name)
                if isinstance(value, torch.Tensor):
                    tensors[f"{m}.{f.name}"] = value
        return {"steps": meta}, tensors

    def load_state(self, meta: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> None:
        for m, info in ((meta or {}).get("steps") or {}).items():
            fields = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.split(".", 1)[0] == m}
            batch = Batch(prompt_len=int(info["prompt_len"]), source=Source(info["source"]), **fields)
            self.ready[int(m)] = Produced(int(m), list(info["prompts"]), batch, int(info["version"]), 0.0, 0.0)

    def close(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=30)

    # -- the producer's side ----------------------------------------------------------------
    def _start(self, step: int, prompts: list[str]) -> None:
        """First rollout wanted: ``step`` (its prompts already drawn by the learner; the learner's
        cursor is past them). Loaded rollouts in flight continue the sequence."""
        loaded = sorted(m for m in self.ready if m >= step)
        cursor = DataCursor(self.cursor.n, self.cursor.seed, **self.cursor.state_dict())  # after `step`'s prompts
        for _ in range(max(0, len(loaded) - 1)):
            self.plan(cursor, self.tokenizer)
        first = step + len(loaded)
        pending = {} if loaded else {step: list(prompts)}
        self.thread = threading.Thread(target=self._loop, args=(first, cursor, pending), name="opd-rollout-producer", daemon=True)
        self.thread.start()

    def _loop(self, m: int, cursor: DataCursor, pending: dict[int, list[str]]) -> None:
        loaded_version = None
        try:
            while True:
                version = max(0, m - self.k)
                t0 = time.perf_counter()
                with self.cv:
                    while version not in self.snapshots and not self.stopping:
                        self.cv.wait(timeout=1.0)
                    if self.stopping:
                        return
                    snap = self.snapshots[version]
                    for v in [v for v in self.snapshots if v < version]:
                        del self.snapshots[v]
                wait_s = time.perf_counter() - t0
                if loaded_version != version:
                    with torch.no_grad():
                        for mine, theirs in zip(self.model.parameters(), snap, strict=True):
                            mine.copy_(theirs)
                    loaded_version = version
                prompts = pending.pop(m) if m in pending else self.plan(cursor, self.tokenizer)
                seeds = dist_util.row_seeds(self.seed, m, range(len(prompts)))
                t1 = time.perf_counter()
                batch = self.engine.generate(prompts, seeds)
                generate_s = time.perf_counter() - t1
                batch = dataclasses.replace(batch, behaviour_logprobs=batch.sampling_logprobs.clone())
                with self.cv:
                    self.ready[m] = Produced(m, list(prompts), batch, version, generate_s, wait_s)
                    self.cv.notify_all()
                m += 1
        except BaseException as ex:  # the learner raises it at its next wait
            with self.cv:
                self.error = ex
                self.cv.notify_all()


def build_rollouts(cfg, engines, student, tokenizer, vocab_size: int, *, phases, plan, cursor, engine_factory):
    """``rollout.staleness``: 0 samples in the loop, k > 0 a producer k updates ahead."""
    if not cfg.rollout.staleness:
        return InLoop(engines, student, phases)
    return Producer(cfg, student, tokenizer, vocab_size, engine_factory=engine_factory, plan=plan, cursor=cursor, phases=phases)
