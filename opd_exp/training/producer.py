"""Where a step's rollout comes from: sampled in the loop (``InLoop``), or by a producer that samples
``rollout.staleness`` = k updates ahead of the learner (``Producer``). The trainer asks one object
``generate(step, prompts, seeds, on_policy=)`` and never which it has.

The producer is a process of its own (so sampling and training overlap on two cores, never taking
turns on one interpreter lock) holding a copy of the student and ``rollout.engine``'s in-process
decoder. The rollout of step m is sampled by the weights the learner had after max(0, m - k)
updates: at the start of every step the learner sends its weights, then the jobs they allow (the
prompts of each step, drawn by the learner from a copy of its data cursor running ahead); each row
is drawn from its own generator keyed by (seed, step, row). What is sampled is therefore a function
of (seed, step, weights), never of timing. The engine's log-probs of its samples are the behaviour
policy's (``Batch.behaviour_logprobs``), which the correction's importance weights read
(``training/staleness.py``).

On ``rollout.engine=vllm`` the producer is vLLM itself: its engine already holds a copy of the
student's weights of its own (``RolloutEngine.holds_weights``), so a thread of the learner's process
drives it (vLLM's in-process engine; the thread waits on its forwards, which release the interpreter
lock) under the same protocol: the learner snapshots its weights (HF-named tensors) after each update,
the thread pushes the version a job names into vLLM (``push_weights``, as the in-loop sync does) before
sampling it, and vLLM's processed log-probs of its samples are the behaviour policy's.

Resume is exact: a checkpoint after step n holds the rollouts in flight (steps n .. n+k-1, sampled
by weights the checkpoint no longer has: kept, not regenerated) and a resumed producer continues
from step n+k with the checkpoint's weights.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import queue
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as mp

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
        """Nothing is in flight between steps of the loop: nothing to restore."""

    def close(self) -> None:
        """No process or thread of its own to stop."""


@dataclasses.dataclass
class Produced:
    step: int
    prompts: list[str]
    batch: Batch
    version: int  # the learner's update count whose weights sampled it
    generate_s: float
    wait_s: float  # the producer's wait for those weights


class Producer:
    """A process beside the learner (or, given ``engine``, a thread driving that engine) that samples
    the rollout of step m with the weights of update max(0, m - k). The learner draws every prompt
    (from a copy of its data cursor, running ahead) and sends, in order, its weights after each update
    and the jobs they allow; the producer answers each job with a ``Produced``. Tensors travel through
    shared memory (torch.multiprocessing), or a thread's queues."""

    def __init__(self, cfg, student, tokenizer, vocab_size: int, *, engine_spec, plan, cursor: DataCursor, phases, engine=None):
        self.k, self.seed, self.phases = cfg.rollout.staleness, cfg.seed, phases
        self.engine = engine  # an engine with weights of its own (vLLM): driven by a thread here, no process
        self.student, self.tokenizer, self.plan, self.cursor = student, tokenizer, plan, cursor
        self.engine_spec = engine_spec  # (builder, train config, vocab size, autocast): the producer's engine, built there
        self.ready: dict[int, Produced] = {}
        self.requested = -1  # the last step whose rollout was asked for
        self.pending: dict[int, list[str]] = {}
        self.lookahead: DataCursor | None = None
        self.proc = self.jobs = self.results = None
        self.last: Produced | None = None
        self.learner_wait_s = 0.0

    # -- the learner's side ---------------------------------------------------------------
    def generate(self, step: int, prompts: list[str], seeds, *, on_policy: bool) -> Batch:
        if self.proc is None:
            self._start(step, prompts)
        with self.phases("sync"):  # the weights after `step` updates: they sample the rollout k steps on
            self.jobs.put(("weights", step, self._snapshot()))
        while self.requested < step + self.k:  # every rollout these weights (or older ones) sample
            m = self.requested + 1
            rows = self.pending.pop(m) if m in self.pending else self.plan(self.lookahead, self.tokenizer)
            self.jobs.put(("sample", m, max(0, m - self.k), rows))
            self.requested = m
        t0 = time.perf_counter()
        with self.phases("wait"):
            self._collect(lambda: step in self.ready)
        self.learner_wait_s = time.perf_counter() - t0
        for m in [m for m in self.ready if m < step]:
            del self.ready[m]
        item = self.ready[step]
        if item.prompts != list(prompts):
            raise RuntimeError(f"rollout producer: step {step} was sampled from other prompts than the learner drew (a bug)")
        self.phases.totals["generate"] += item.generate_s  # the producer's seconds, overlapped with the learner's
        self.last = item
        return dataclasses.replace(item.batch)

    def _collect(self, done) -> None:
        while not done():
            try:
                msg = self.results.get(timeout=5.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"rollout producer: it ended (exit code {getattr(self.proc, 'exitcode', None)})") from None
                continue
            if isinstance(msg, str):
                raise RuntimeError(f"rollout producer failed: {msg}")
            self.ready[msg.step] = msg

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
        """The rollouts in flight after ``step`` updates (steps step .. step+k-1): (JSON, tensors).
        Each was asked for with weights this checkpoint's or older, so waiting for them ends."""
        wanted = [m for m in range(step, step + self.k) if self.proc is not None or m in self.ready]
        if self.proc is not None:
            self._collect(lambda: all(m in self.ready for m in wanted))
        meta, tensors = {}, {}
        for m in wanted:
            item = self.ready[m]
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
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            self.jobs.put(("stop",))
        self.proc.join(timeout=30)
        if self.proc.is_alive() and hasattr(self.proc, "terminate"):  # a thread ends at its next job
            self.proc.terminate()
        self.proc = None

    def _snapshot(self):
        """The learner's weights now, copied (it updates them in place while they wait to be loaded):
        the parameters in order for the process's copy of the student; HF-named tensors for vLLM."""
        if self.engine is not None:
            base = self.student.get_base_model() if hasattr(self.student, "get_base_model") else self.student
            return [(name, t.detach().to("cpu", copy=True)) for name, t in base.state_dict().items()]
        return [p.detach().to("cpu", copy=True) for p in self.student.parameters()]

    def _start(self, step: int, prompts: list[str]) -> None:
        """First rollout wanted: ``step`` (its prompts already drawn by the learner, whose cursor is
        past them). Rollouts loaded from a checkpoint continue the sequence."""
        loaded = sorted(m for m in self.ready if m >= step)
        self.lookahead = DataCursor(self.cursor.n, self.cursor.seed, **self.cursor.state_dict())
        for _ in range(max(0, len(loaded) - 1)):
            self.plan(self.lookahead, self.tokenizer)
        self.requested = step + len(loaded) - 1
        if not loaded:
            self.pending[step] = list(prompts)
        if self.engine is not None:  # vLLM: its engine is the producer, a thread of this process drives it
            self.jobs, self.results = queue.Queue(), queue.Queue()
            load = self.engine.push_weights
            self.proc = threading.Thread(
                target=_serve,
                args=(self.engine, load, self.seed, self.jobs, self.results, lambda: True),
                name="opd-rollout-producer",
                daemon=True,
            )
            self.proc.start()
            return
        # forkserver: a fork of a clean server process (a fork of this one, with torch's threads, can
        # deadlock), which has the producer and transformers imported once for every run of the process
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["opd_exp.training.producer", "transformers"])
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        model = copy.deepcopy(self.student).to("cpu").eval().requires_grad_(False)
        self.proc = ctx.Process(
            target=_produce,
            args=(model, self.tokenizer, self.engine_spec, self.seed, self.jobs, self.results),
            name="opd-rollout-producer",
            daemon=True,
        )
        self.proc.start()


def _produce(model, tokenizer, engine_spec, seed: int, jobs, results) -> None:
    """The producer process: its own copy of the student (``model``), sampled by ``rollout.engine``'s
    in-process decoder; a learner killed outright never sends "stop", so it ends when its parent is gone."""
    torch.set_num_threads(1)
    try:
        build, cfg, vocab_size, autocast = engine_spec
        engine = build(cfg, model, tokenizer, vocab_size, source="student", autocast=autocast)
    except BaseException as ex:  # the learner raises it at its next wait
        results.put(f"{type(ex).__name__}: {ex}")
        return

    @torch.no_grad()
    def load(tensors, version: int) -> None:
        for mine, theirs in zip(model.parameters(), tensors, strict=True):
            mine.copy_(theirs)

    parent = os.getppid()
    _serve(engine, load, seed, jobs, results, lambda: os.getppid() == parent)


def _serve(engine, load, seed: int, jobs, results, alive) -> None:
    """The producer's loop: weights in the order the learner sends them, each job sampled by the
    version it names (``load(weights, version)`` before it), one ``Produced`` back per job; the
    engine's log-probs of its samples kept as the behaviour policy's."""
    weights: dict[int, list] = {}
    loaded = None
    try:
        while True:
            t0 = time.perf_counter()
            while True:
                try:
                    msg = jobs.get(timeout=5.0)
                    break
                except queue.Empty:
                    if not alive():
                        return
            if msg[0] == "stop":
                return
            if msg[0] == "weights":
                weights[msg[1]] = msg[2]
                continue
            _, m, version, prompts = msg
            wait_s = time.perf_counter() - t0
            if loaded != version:
                load(weights[version], version)
                loaded = version
                for v in [v for v in weights if v < version]:
                    del weights[v]
            seeds = dist_util.row_seeds(seed, m, range(len(prompts)))
            t1 = time.perf_counter()
            batch = engine.generate(prompts, seeds)
            generate_s = time.perf_counter() - t1
            batch = dataclasses.replace(batch, behaviour_logprobs=batch.sampling_logprobs.clone())
            results.put(Produced(m, list(prompts), batch, version, generate_s, wait_s))
    except BaseException as ex:  # the learner raises it at its next wait
        results.put(f"{type(ex).__name__}: {ex}")


def build_rollouts(cfg, engines, student, tokenizer, vocab_size: int, *, phases, plan, cursor, engine_spec):
    """``rollout.staleness``: 0 samples in the loop, k > 0 a producer k updates ahead: a process with a
    copy of the student, or (an engine with weights of its own: vLLM) the engine itself, driven by a thread."""
    if not cfg.rollout.staleness:
        return InLoop(engines, student, phases)
    engine = engines.student if getattr(engines.student, "holds_weights", False) else None
    if engine is not None and not getattr(engine, "processed", True):
        from opd_exp.config.checks import fail

        fail(
            "rollout.staleness",
            cfg.rollout.staleness,
            "0 with this vLLM (it has no logprobs_mode: its log-probs are raw, not the sampled distribution's, "
            "and a stale rollout's importance weights need the behaviour policy's)",
        )
    return Producer(cfg, student, tokenizer, vocab_size, engine_spec=engine_spec, plan=plan, cursor=cursor, phases=phases, engine=engine)
