"""The on-policy distillation loop, as a stateful object.

One step: draw prompts -> the student (or, with probability 1 - on_policy_fraction, the
teacher) samples responses -> teacher and student score the same positions per
micro-batch -> objective -> backward (loss normalised by the step's global response-token
count) -> clip, finite check, optimizer step -> metrics to the sinks -> eval / checkpoint.

A run started again in a folder that holds a checkpoint resumes from the newest complete
one: weights, optimizer, scheduler, data position, RNG, the before-training eval, the guard
counters. Each step also re-seeds torch from (seed, step), so a resumed run samples the very
same tokens and ends bit-identical to an uninterrupted one.

Guards (docs/reliability.md): a step whose teacher logits, loss or gradient norm is NaN/inf
is skipped (no update) and counted in ``guard/skipped_steps``; ``trainer.max_bad_steps`` in a
row stop the run (``Diverged``) without writing a checkpoint. A step without response tokens
is a no-op counted in ``guard/empty_steps``. SIGTERM/SIGUSR1/SIGUSR2 save a checkpoint at the
next step boundary and raise ``Preempted``. One process per run folder (``RunLock``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from opd_exp import checkpoint
from opd_exp import distributed as dist_util
from opd_exp import precision as prec
from opd_exp.errors import ConfigError
from opd_exp.guards import Diverged, NonFinite, Preempted, PreemptionGuard, nonfinite_summary
from opd_exp.config.schema import LoggerName, Precision, Schedule, TrainConfig
from opd_exp.divergences import get_divergence
from opd_exp.objective import TOKEN_METRICS, Objective, exact_divergences, metric_beta
from opd_exp.rollout import decode_responses, generate
from opd_exp.scoring import student_logits, teacher_logits, token_logprobs
from opd_exp.tracking import plain_config
from opd_exp.sinks import JsonlSink, MultiSink, Progress, Sink, WandbSink


def config_dict(cfg) -> dict[str, Any]:
    """A JSON-able dict of a (possibly nested) config dataclass; enums by value."""
    return plain_config(cfg)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class DataCursor:
    """Prompt order: a fresh seeded permutation per epoch; state is (epoch, position)."""

    def __init__(self, n: int, seed: int, epoch: int = 0, pos: int = 0):
        if n <= 0:
            raise ValueError("the task has no training problems")
        self.n, self.seed, self.epoch, self.pos = n, seed, epoch, pos
        self._perm_epoch, self._perm = -1, []

    def _permutation(self) -> list[int]:
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g).tolist(), self.epoch
        return self._perm

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            take = min(k - len(out), self.n - self.pos)
            out += self._permutation()[self.pos : self.pos + take]
            self.pos += take
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, *, pair=None, task=None, sinks: list[Sink] | None = None):
        self.cfg = cfg
        tc = cfg.trainer
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        # torchrun ranks (trainer.parallel=ddp|fsdp; docs/scale.md): process group + this rank's device
        self.dist, self.device = dist_util.setup(tc.parallel.value, tc.device)
        self.run_dir = Path(dist_util.broadcast_object(str(run_dir), self.dist))  # rank 0's folder for all
        if self.dist.row_keyed:
            dist_util.shard(tc.batch_size * cfg.rollout.n_samples, self.dist)  # rows split evenly, or one line now
        self.run_dir.mkdir(parents=True, exist_ok=True)
        prec.require_peft(tc)  # optional extras fail here, before any model loads
        if cfg.rollout.engine.value == "vllm":
            from opd_exp.rollout_vllm import require_vllm

            require_vllm()
        torch.manual_seed(cfg.seed)
        if task is None:
            from opd_exp.tasks import build_task

            task = build_task(cfg.task)
        if pair is None:
            from opd_exp.pairs import load_pair

            pair = load_pair(cfg.model_pair, cfg.task, self.device)
        self.task = task
        self.student = prec.prepare_student(pair.student, tc, self.device)  # dtype, grad ckpt, LoRA
        self.teacher_device = prec.teacher_device(tc, self.device)
        self.teacher = prec.prepare_teacher(pair.teacher, tc, self.teacher_device)  # frozen, no grad
        self.tokenizer = pair.tokenizer
        self.vocab_size = int(pair.vocab_size)
        self.student.train()
        self.train_problems = list(task.train_problems())
        evals = list(task.eval_problems())
        if not self.train_problems:
            raise ConfigError(f"task: {cfg.task.name!r} has no training problems (empty dataset or split); allowed: a task with at least one")
        if not evals:
            raise ConfigError(f"task: {cfg.task.name!r} has no eval problems (empty dataset or split); allowed: a task with at least one")
        self.eval_problems = evals[: tc.eval_size] if tc.eval_size else evals
        self.objective = Objective(cfg)
        self.eval_divs = {
            "eval/jsd": get_divergence("jsd", beta=metric_beta(cfg)),
            "eval/kl_reverse": get_divergence("rkl"),
            "eval/kl_forward": get_divergence("fkl"),
        }
        # The training forward goes through DDP / the FSDP2-sharded model; generate, eval and
        # checkpoints use the plain module (fully_shard works in place: the same object).
        self.train_module = dist_util.wrap_student(self.student, self.dist, self.device)
        self.params = [p for p in self.student.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=tc.lr, weight_decay=tc.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.cursor = DataCursor(len(self.train_problems), cfg.seed)
        self.step = 0
        self.state: dict[str, Any] = {}  # eval before/last, teacher accuracy, elapsed time, guard
        self._extra_sinks = sinks
        self._warned: set[str] = set()
        self._progress: Progress | None = None
        self.engine = None  # rollout.engine=vllm: the vLLM engine, built on first use

    def warn(self, line: str) -> None:
        """One line on stderr (through the progress bar while it is shown)."""
        if self._progress is not None:
            self._progress.write(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def _warn_once(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            self.warn(f"opd-train: warning: {text}")

    @property
    def guard(self) -> dict[str, Any]:
        """Counters saved with the loop state (a resumed run continues them)."""
        return self.state.setdefault("guard", {"skipped_steps": 0, "empty_steps": 0, "bad_in_a_row": 0, "bad_since": 0})

    def _truncated(self, prompts) -> int:
        """How many rendered prompts exceed rollout.max_prompt_tokens (the rollout keeps their
        last tokens); warned once per run, counted per step."""
        cap = self.cfg.rollout.max_prompt_tokens
        n = sum(len(self.tokenizer(p, add_special_tokens=False)["input_ids"]) > cap for p in prompts)
        if n:
            self._warn_once(
                "truncated", f"{n} of {len(prompts)} prompts are longer than rollout.max_prompt_tokens={cap} and are cut "
                f"from the left (the last {cap} tokens are kept); counted in rollout/truncated_prompts"
            )
        return n

    # -- schedule -------------------------------------------------------------
    def _lr_factor(self, step: int) -> float:
        tc = self.cfg.trainer
        if tc.warmup_steps and step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        span = max(tc.max_steps - tc.warmup_steps, 1)
        frac = min(max(step - tc.warmup_steps, 0) / span, 1.0)
        if tc.schedule is Schedule.linear:
            return 1.0 - frac
        if tc.schedule is Schedule.cosine:
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        return 1.0

    def _autocast(self):
        p = self.cfg.trainer.precision
        if p is Precision.fp32:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if p is Precision.bf16 else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    # -- one step -------------------------------------------------------------
    def _on_policy(self, step: int) -> bool:
        """GKD's lambda: whether step ``step`` is sampled by the student (deterministic in seed, step)."""
        frac = self.cfg.rollout.on_policy_fraction
        return frac >= 1.0 or (frac > 0.0 and random.Random(self.cfg.seed * 7919 + step).random() < frac)

    def sample(self, step: int):
        """The step's prompts and responses (re-seeded from (seed, step): resume-exact)."""
        cfg, ro = self.cfg, self.cfg.rollout
        torch.manual_seed(cfg.seed * 1_000_003 + step + 1)
        problems = [self.train_problems[i] for i in self.cursor.next(cfg.trainer.batch_size)]
        prompts = [self.task.render_prompt(p, self.tokenizer) for p in problems]
        self._n_truncated = self._truncated(prompts)
        on_policy = self._on_policy(step)
        if self.dist.row_keyed or self.cfg.rollout.engine.value == "vllm":
            return self._sample_rows(prompts, step, on_policy).to(self.device)
        with self._autocast():
            batch = generate(
                self.student if on_policy else self.teacher,
                self.tokenizer,
                prompts,
                n_samples=ro.n_samples,
                max_new_tokens=ro.max_new_tokens,
                max_prompt_tokens=ro.max_prompt_tokens,
                temperature=ro.temperature,
                top_k=ro.top_k,
                top_p=ro.top_p,
                source="student" if on_policy else "teacher",
                vocab_size=self.vocab_size,
            )
        return batch.to(self.device)

    def _sample_rows(self, prompts, step: int, on_policy: bool):
        """This rank's rows of the step's global batch (rows prompt-major, as one process lays
        them out), each sampled from a generator keyed by (seed, step, global row)."""
        ro, ds = self.cfg.rollout, self.dist
        n = ro.n_samples
        rows = range(len(prompts) * n)[dist_util.shard(len(prompts) * n, ds)]
        row_prompts = [prompts[r // n] for r in rows]
        seeds = dist_util.row_seeds(self.cfg.seed, step, rows)
        source = "student" if on_policy else "teacher"
        if self.cfg.rollout.engine.value == "vllm" and on_policy:
            engine = self._vllm()
            engine.sync_weights(self.student, version=self.step)  # after every update: the engine samples this student
            batch = engine.generate(row_prompts, seeds)
        else:
            with self._autocast():
                batch = generate(
                    self.student if on_policy else self.teacher, self.tokenizer, row_prompts, n_samples=1,
                    max_new_tokens=ro.max_new_tokens, max_prompt_tokens=ro.max_prompt_tokens,
                    temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p, source=source,
                    vocab_size=self.vocab_size, row_seeds=seeds,
                    synced_gpus=on_policy and ds.active and ds.parallel == "fsdp",
                )
        return dataclasses.replace(batch, prompt_index=torch.tensor([r // n for r in rows], device=batch.input_ids.device))

    def _vllm(self):
        if self.engine is None:
            from opd_exp.rollout_vllm import VllmRollout

            self.engine = VllmRollout.from_config(self.cfg, self.student, self.tokenizer, self.vocab_size, warn=self.warn)
        return self.engine

    def _teacher_logits(self, batch):
        """Teacher logits on the student's device (the teacher may live on another one)."""
        if self.teacher_device == self.device:
            return teacher_logits(self.teacher, batch, self.vocab_size, temperature=self.cfg.divergence.temperature)
        z = teacher_logits(self.teacher, batch.to(self.teacher_device), self.vocab_size, temperature=self.cfg.divergence.temperature)
        return z.to(self.device)

    def accumulate(self, batch, n_tokens: int | None = None) -> tuple[float, dict[str, float]]:
        """Forward/backward over micro-batches; gradients equal those of the whole batch.

        ``n_tokens``: the step's GLOBAL response-token count (all ranks; default: this batch's).
        Under DDP/FSDP each rank's loss is scaled by the world size (they average gradients),
        every rank runs the same number of micro-batches, and the teacher check is agreed on by
        all ranks before any backward (a collective missed by one rank would hang the others)."""
        cfg, ds = self.cfg, self.dist
        n_tokens = batch.num_response_tokens if n_tokens is None else n_tokens  # every micro-batch divides by it
        on_policy = batch.source == "student"
        loss_total, sums = 0.0, defaultdict(float)
        mbs = list(batch.micro_batches(cfg.trainer.micro_batch_size))
        for i, mb in enumerate(mbs):
            if mb.num_response_tokens == 0 and not ds.active:
                continue
            with self._autocast():
                zt = self._teacher_logits(mb)
                # Caught here, before the loss: a NaN teacher logit would turn the loss (and, via
                # masked positions, the gradient) into NaN with no hint where it came from.
                bad = nonfinite_summary(zt)
                if dist_util.any_rank(bad is not None, ds):
                    where = f"{bad} teacher logits" if bad is not None else "on another rank"
                    raise NonFinite(f"teacher log-probs are not finite at step {self.step + 1} ({where})")
                with dist_util.no_sync(self.train_module, ds, last=i == len(mbs) - 1):
                    zs = student_logits(
                        self.train_module, mb, self.vocab_size,
                        temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                    )
            out = self.objective(zs, zt, mb.response_ids, mb.response_mask, on_policy=on_policy, normalizer=n_tokens)
            if mb.sampling_logprobs is not None:  # vLLM: how far the engine's log-probs are from ours
                from opd_exp.rollout_vllm import logprob_gap_sum

                sums["rollout/engine_logprob_gap"] += logprob_gap_sum(
                    mb.sampling_logprobs, token_logprobs(zs.detach(), mb.response_ids), mb.response_mask)
            with dist_util.no_sync(self.train_module, ds, last=i == len(mbs) - 1):
                (out.loss * ds.world_size if ds.active else out.loss).backward()
            loss_total += float(out.loss.detach())
            for k, v in out.sums.items():
                sums[k] += v
        return loss_total, sums

    def train_step(self) -> dict[str, float]:
        tc = self.cfg.trainer
        t0 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        batch = self.sample(self.step)
        t_rollout = time.perf_counter() - t0
        step, guard, problem = self.step + 1, self.guard, None
        self.optimizer.zero_grad(set_to_none=True)
        n_global, seq_global = (int(x) for x in dist_util.all_reduce_sum([batch.num_response_tokens, batch.num_sequences], self.dist))
        if n_global == 0:
            # Nothing to learn from: a no-op step (no update), counted; never a 0/0 NaN.
            loss, sums, grad_norm = 0.0, {}, 0.0
            guard["empty_steps"] += 1
            self._warn_once("empty", f"step {step} has no response tokens: no update (counted in guard/empty_steps)")
        else:
            try:
                loss, sums = self.accumulate(batch, n_global)
                if self.dist.active:  # token-weighted: sums of per-token values, then / global count
                    loss, *vals = dist_util.all_reduce_sum([loss, *(sums.get(k, 0.0) for k in TOKEN_METRICS)], self.dist)
                    extra = sorted(set(sums) - set(TOKEN_METRICS))
                    sums = {**dict(zip(TOKEN_METRICS, vals)), **dist_util.reduce_sums(sums, extra, self.dist)}
                max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
                grad_norm = dist_util.grad_norm_value(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            except NonFinite as ex:
                loss, sums, grad_norm, problem = float("nan"), {k: float("nan") for k in TOKEN_METRICS}, float("nan"), str(ex)
            if problem is None and not (math.isfinite(loss) and math.isfinite(grad_norm)):
                problem = f"loss={loss}, grad/norm={grad_norm}"
        finite = problem is None
        if finite and n_global:  # a non-finite loss or gradient never reaches the weights
            self.optimizer.step()
        if finite:
            guard["bad_in_a_row"] = 0
        else:
            guard["skipped_steps"] += 1
            guard["bad_in_a_row"] += 1
            if guard["bad_in_a_row"] == 1:
                guard["bad_since"] = step
            guard["last_problem"] = problem
            self.warn(f"opd-train: warning: step {step} skipped (no update): {problem}")
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a skipped or empty first step: torch warns about the order
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.step += 1
        dt = time.perf_counter() - t0
        n_tok = max(n_global, 1)
        metrics = {k: v / n_tok for k, v in sums.items()}
        metrics.update(
            {
                "loss": loss,
                "response/length_mean": n_global / max(seq_global, 1),
                "grad/norm": grad_norm,
                "grad/skipped": 0.0 if finite else 1.0,
                "guard/skipped_steps": float(guard["skipped_steps"]),
                "guard/empty_steps": float(guard["empty_steps"]),
                "rollout/truncated_prompts": float(getattr(self, "_n_truncated", 0)),
                "lr": lr,
                "rollout/on_policy": 1.0 if batch.source == "student" else 0.0,
                "perf/tokens_per_s": n_global / dt,
                "perf/step_s": dt,
                "perf/rollout_s": t_rollout,
            }
        )
        for k in TOKEN_METRICS:
            metrics.setdefault(k, 0.0)
        return metrics

    # -- evaluation -----------------------------------------------------------
    @torch.no_grad()
    def _greedy(self, model, problems):
        ro, tc = self.cfg.rollout, self.cfg.trainer
        for start in range(0, len(problems), tc.eval_batch_size):
            chunk = problems[start : start + tc.eval_batch_size]
            prompts = [self.task.render_prompt(p, self.tokenizer) for p in chunk]
            self._truncated(prompts)
            with self._autocast():
                batch = generate(
                    model, self.tokenizer, prompts, n_samples=1, do_sample=False,
                    max_new_tokens=ro.max_new_tokens, max_prompt_tokens=ro.max_prompt_tokens,
                    vocab_size=self.vocab_size,
                )
            yield chunk, batch

    def accuracy(self, model, problems) -> float:
        correct = 0
        for chunk, batch in self._greedy(model, problems):
            texts = decode_responses(self.tokenizer, batch)
            correct += sum(bool(self.task.verify(txt, p.answer)) for txt, p in zip(texts, chunk))
        return correct / max(len(problems), 1)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy eval accuracy, and the exact divergences over the vocabulary at every
        position of the student's greedy eval responses (same S and T as the objective)."""
        cfg = self.cfg
        was_training = self.student.training
        self.student.eval()
        correct, n_tok, sums = 0, 0, defaultdict(float)
        for chunk, batch in self._greedy(self.student, self.eval_problems):
            texts = decode_responses(self.tokenizer, batch)
            correct += sum(bool(self.task.verify(txt, p.answer)) for txt, p in zip(texts, chunk))
            with self._autocast():
                zt = self._teacher_logits(batch)
                zs = student_logits(
                    self.student, batch, self.vocab_size,
                    temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                )
            for k, v in exact_divergences(zs, zt, batch.response_mask, self.eval_divs, cfg.estimator.chunk_size).items():
                sums[k] += v
            n_tok += batch.num_response_tokens
        self.student.train(was_training)
        out = {k: v / max(n_tok, 1) for k, v in sums.items()}
        out["eval/accuracy"] = correct / max(len(self.eval_problems), 1)
        if "teacher_accuracy" not in self.state:
            self.state["teacher_accuracy"] = self.accuracy(self.teacher, self.eval_problems)
            out["eval/teacher_accuracy"] = self.state["teacher_accuracy"]
        return out

    # -- the run --------------------------------------------------------------
    def _sinks(self, resume_step: int | None) -> Sink:
        if not self.dist.is_main:  # metrics.jsonl and W&B belong to rank 0
            return MultiSink([])
        sinks: list[Sink] = [JsonlSink(self.run_dir / "metrics.jsonl", resume_step=resume_step)]
        lg = self.cfg.logger
        extra = list(self._extra_sinks or [])
        if lg.name is LoggerName.wandb and not any(isinstance(s, WandbSink) for s in extra):
            sinks.append(WandbSink.from_config(self.cfg, self.run_dir))  # opd-train passes one started early
        sinks.extend(extra)
        return MultiSink(sinks)

    def _loop_state(self) -> dict[str, Any]:
        return {"data": self.cursor.state(), **self.state}

    def save(self) -> Path:
        """Rank 0 writes (FSDP2: every rank first gathers the full state); all ranks then agree."""
        ds = self.dist
        model, optimizer = self.student, self.optimizer
        if ds.active and ds.parallel == "fsdp":  # collectives: every rank takes part
            model = dist_util.Frozen(dist_util.FullModelView(self.student).state_dict())
            optimizer = dist_util.Frozen(dist_util.FullOptimizerView(self.student, self.optimizer).state_dict())
        path = checkpoint.checkpoint_root(self.run_dir) / f"step_{self.step:06d}"
        if ds.is_main:
            path = checkpoint.save(
                self.run_dir, self.step, model, optimizer, self.scheduler, self._loop_state(),
                keep=self.cfg.trainer.keep_checkpoints,
            )
        dist_util.barrier(ds)
        return path

    def resume(self) -> bool:
        """Load the newest complete checkpoint; one that fails to load (damaged, or from a
        different model) is renamed ``step_N.bad`` and the next older one is tried."""
        found = checkpoint.list_checkpoints(self.run_dir)
        if not found:
            damaged = checkpoint.damaged(self.run_dir)
            if damaged:  # our writes are atomic: these were complete once; never start over on top
                raise ConfigError(
                    f"hydra.run.dir: no checkpoint in {checkpoint.checkpoint_root(self.run_dir)} can be loaded "
                    f"({', '.join(p.name for p in damaged)}: incomplete or damaged); allowed: move checkpoints/ away to start the run over"
                )
            return False
        first_error = None
        for step, path in reversed(found):
            try:
                if self.dist.active and self.dist.parallel == "fsdp":  # full state in, sharded in place
                    st = checkpoint.load(path, dist_util.FullModelView(self.student),
                                         dist_util.FullOptimizerView(self.student, self.optimizer), self.scheduler)
                else:
                    st = checkpoint.load(path, self.student, self.optimizer, self.scheduler)
                break
            except Exception as ex:  # noqa: BLE001 - any damage: try the older one
                reason = (str(ex).strip().splitlines() or [type(ex).__name__])[0][:200]
                first_error = first_error or f"{path}: {reason}"
                self.warn(f"opd-train: warning: checkpoint {path} cannot be loaded ({reason}); trying an older one")
                if path.is_dir():
                    path.rename(path.with_name(path.name + ".bad"))
        else:
            raise ConfigError(
                f"hydra.run.dir: no checkpoint in {checkpoint.checkpoint_root(self.run_dir)} can be loaded (newest: {first_error}); "
                f"allowed: checkpoints of this model, or move checkpoints/ away to start the run over"
            )
        self.step = int(st.pop("step"))
        data = st.pop("data")
        self.cursor = DataCursor(len(self.train_problems), self.cfg.seed, data["epoch"], data["pos"])
        self.state = st
        return True

    def run(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train to ``trainer.max_steps`` (resuming if the folder holds a checkpoint) and
        return the summary. ``stop_after`` ends the session early after that many steps,
        as an interruption would (tests use it)."""
        lock = checkpoint.RunLock(self.run_dir) if self.dist.is_main else contextlib.nullcontext()  # rank 0 holds the folder
        try:
            with lock, PreemptionGuard() as preempt:
                summary = self._run(preempt, stop_after)
        finally:
            if self.dist.active and stop_after is None:
                dist_util.teardown()  # this process's one run is over (or failed)
        if isinstance(summary, Preempted):
            raise summary
        if summary and self.dist.is_main:
            print(self.summary_line(summary), flush=True)  # stdout: `opd-train | tail -1` is the result
        return summary

    def _run(self, preempt: PreemptionGuard, stop_after: int | None):
        tc = self.cfg.trainer
        resumed = self.resume()
        sink = self._sinks(resume_step=self.step if resumed else None)
        progress = Progress(tc.max_steps, initial=self.step, enabled=tc.progress)
        self._progress = progress
        t_start = time.perf_counter() - self.state.get("elapsed_s", 0.0)
        try:
            if not resumed:
                before = self.evaluate()
                self.state["eval_before"] = before
                self.state["eval_last"] = before
                sink.log(before, step=0)
            done_now = 0
            # A signal only sets a flag; it is acted on here, between steps, so a checkpoint
            # is never taken of a half-done step.
            while self.step < tc.max_steps and not self._stop_requested(preempt):
                metrics = self.train_step()
                last = self.step == tc.max_steps
                if (tc.eval_every and self.step % tc.eval_every == 0) or last:
                    ev = self.evaluate()
                    self.state["eval_last"] = ev
                    metrics.update(ev)
                if self.step % tc.log_every == 0 or last or "eval/accuracy" in metrics:
                    sink.log(metrics, step=self.step)
                progress.update(metrics)
                self.state["elapsed_s"] = time.perf_counter() - t_start
                guard = self.guard
                if guard["bad_in_a_row"] >= tc.max_bad_steps:
                    latest = checkpoint.latest(self.run_dir)
                    raise Diverged(
                        f"{guard['bad_in_a_row']} non-finite steps in a row (steps {guard['bad_since']}-{self.step}; last: "
                        f"{guard.get('last_problem')}); stopped without saving, last checkpoint intact: {latest or 'none'}; "
                        f"allowed: a lower trainer.lr, trainer.grad_clip > 0, a teacher with finite log-probs, "
                        f"or a larger trainer.max_bad_steps={tc.max_bad_steps}"
                    )
                # No periodic save inside a run of bad steps: keep the checkpoints from before it.
                if (tc.save_every and self.step % tc.save_every == 0 and not guard["bad_in_a_row"]) or last:
                    self.save()
                done_now += 1
                if stop_after is not None and done_now >= stop_after and not last:
                    return {}
            if self._stop_requested(preempt) and self.step < tc.max_steps:
                import signal as _signal

                stop = Preempted(preempt.signum or _signal.SIGTERM, self.step, self.save())
                stop.previous_handler = preempt.previous_handler()
                return stop
            summary = self.summary()
            sink.summary(summary)
        finally:
            progress.close()
            self._progress = None
            sink.close()
        return summary

    def _stop_requested(self, preempt: PreemptionGuard) -> bool:
        """A preemption signal seen by any rank stops every rank at the same step boundary."""
        return dist_util.any_rank(preempt.requested, self.dist)

    def summary(self) -> dict[str, Any]:
        before, after = self.state.get("eval_before", {}), self.state.get("eval_last", {})
        out = {"steps": self.step, "elapsed_s": round(self.state.get("elapsed_s", 0.0), 1)}
        for key in ("eval/accuracy", "eval/kl_reverse", "eval/kl_forward", "eval/jsd"):
            if key in before:
                out[f"{key}_before"] = before[key]
            if key in after:
                out[key] = after[key]
        if "teacher_accuracy" in self.state:
            out["eval/teacher_accuracy"] = self.state["teacher_accuracy"]
        return out

    def summary_line(self, s: dict[str, Any]) -> str:
        def f(key):
            v = s.get(key)
            return "n/a" if v is None else f"{v:.3f}"

        return (
            f"opd-train: student eval accuracy {f('eval/accuracy_before')} -> {f('eval/accuracy')} "
            f"(teacher {f('eval/teacher_accuracy')}); eval reverse KL {f('eval/kl_reverse_before')} -> "
            f"{f('eval/kl_reverse')}; {s['steps']} steps in {s['elapsed_s']:.0f} s; run folder {self.run_dir}"
        )
