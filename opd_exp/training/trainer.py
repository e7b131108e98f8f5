"""The on-policy distillation loop.

One step: draw prompts -> the student's rollout engine (or, with probability 1 - on_policy_fraction,
the teacher's) samples a ``Batch`` -> per micro-batch the teacher scorer and the student score the
same positions through the LM head -> objective -> backward (divided by the step's global count of
trained tokens) -> clip, guard, optimizer step -> the teacher scorer's ``sync`` -> metrics to the
sinks -> eval / checkpoint. Engines, scorer and head are picked once in ``__init__``; the loop never
asks which it has. The loop state (``TrainState``) and the scorer's state are in every checkpoint; a
run started again in its folder resumes from the newest one that loads, bit-identical (torch is
re-seeded from (seed, step) every step).

Guards (docs/reliability.md): a step whose teacher logits, loss or gradient norm is not finite is
skipped and counted; ``trainer.max_bad_steps`` in a row stop the run (``Diverged``); a step without
trained tokens is a counted no-op; SIGTERM/SIGUSR1/SIGUSR2 save at the next step boundary (exit 75);
one process per run folder (``RunLock``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import signal
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch

from opd_exp.config.schema import TrainConfig, whole_groups
from opd_exp.runtime import checkpoint, fingerprint, guards, host
from opd_exp.runtime import distributed as dist_util
from opd_exp.runtime import precision as prec
from opd_exp.runtime.errors import ConfigError
from opd_exp.runtime.guards import EXIT_PREEMPTED, Diverged, NonFinite, Preempted, PreemptionGuard, StepGuard, nonfinite_summary
from opd_exp.sinks import Progress, Sink
from opd_exp.training.advice import Advice, EvalRise
from opd_exp.training.checkpoints import checkpoint_views, resume_session
from opd_exp.training.console import Console
from opd_exp.training.engines import build_engines, require_extras, rollout_source, run_identity
from opd_exp.training.evaluate import EvalDivergences, Evaluator, eval_problems, require_finite
from opd_exp.training.heads import build_head
from opd_exp.training.memory import check_step_memory
from opd_exp.training.monitors import Tally
from opd_exp.training.objective import Objective, loss_normalizer
from opd_exp.training.phases import PhaseClock
from opd_exp.training.ppo import PpoUpdates
from opd_exp.training.report import run_sinks, summary, summary_line
from opd_exp.training.reward import RewardTerm
from opd_exp.training.rollout import Draw, count_truncated, warn_ignored_generation_settings
from opd_exp.training.schedule import LrSchedule
from opd_exp.training.state import DataCursor, TrainState
from opd_exp.training.teacher_prompt import TeacherPrompt
from opd_exp.training.teacher_served import TeacherUnavailable
from opd_exp.training.teacher_set import TeacherSet
from opd_exp.training.teachers import sparse_teacher_k


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, *, pair, task, sinks: list[Sink] | None = None, load_map_teacher=None):  # fmt: skip
        self.cfg = cfg
        tc, sc, ro = cfg.trainer, cfg.scale, cfg.rollout
        if sc.num_threads:
            torch.set_num_threads(sc.num_threads)
        # torchrun ranks (scale.parallel=ddp|fsdp; docs/scale.md): process group + this rank's device
        self.dist, self.device = dist_util.setup(sc.parallel.value, sc.device)
        if self.device.type == "cpu":  # freed blocks reused, not faulted in afresh every step (runtime/host.py)
            host.keep_freed_memory()
        self.run_dir = Path(dist_util.broadcast_object(str(run_dir), self.dist))  # rank 0's folder for all
        if self.dist.row_keyed:
            dist_util.shard(tc.batch_size * ro.n_samples, self.dist, whole_groups(cfg))  # rows split evenly, or one line now
        self.run_dir.mkdir(parents=True, exist_ok=True)
        require_extras(cfg)
        torch.manual_seed(cfg.seed)
        self.task, self.tokenizer, self.vocab_size = task, pair.tokenizer, int(pair.vocab_size)
        self.train_problems, self.reward = list(task.train_problems()), RewardTerm(cfg, task, pair.tokenizer, self.dist)  # reward.*
        eval_set = eval_problems(cfg, self.train_problems, list(task.eval_problems()))  # checked: one line
        self.student = prec.prepare_student(pair.student, sc, self.device)  # dtype, grad ckpt, LoRA
        teacher_device = prec.teacher_device(sc, self.device)
        check_step_memory(  # one line now, not an out-of-memory error minutes later
            cfg, self.student, self.vocab_size, self.device, world_size=self.dist.world_size, teacher_here=teacher_device == self.device
        )
        splits = dict(training=self.train_problems, eval=eval_set)  # what teachers.map routes (checked before its teachers load)
        self.teacher, self.teachers = TeacherSet.load(cfg, pair, teacher_device, splits, load_map_teacher, student=self.student)
        self.student.train()
        self.autocast = partial(prec.autocast, self.device, sc.precision.value)
        self.console = Console(self.run_dir, main=self.dist.is_main)  # stderr + train.log
        self.warn, self.log_line, self._warn_once = self.console.warn, self.console.log_line, self.console.warn_once
        self.advice = Advice(cfg, self.console)  # advice and start-up guards (advice.py): a local pair on the toy lr, ...

        # Engines, picked once: the loop below never asks which ones it has.
        fsdp = self.dist.active and self.dist.parallel == "fsdp"
        self.engines = build_engines(
            cfg, self.student, self.teacher, self.tokenizer, self.vocab_size, autocast=self.autocast, synced_gpus=fsdp, warn=self.warn
        )
        # a sparse teacher's limits are refused before the server is asked anything
        self.objective = self.advice.watch(Objective(cfg, teacher_k=sparse_teacher_k(cfg, self.vocab_size), vocab_size=self.vocab_size))
        self.teacher_scorer = self.teachers.scorer(self.tokenizer, self.vocab_size, autocast=self.autocast, warn=self.warn)
        self.phases = PhaseClock()  # perf/<phase>_s (training/phases.py)
        self.teacher_scorer.set_clock(self.phases)
        self.monitors = self.teachers.monitors(cfg, self.objective)  # exact/*, entropies, overlap/*, the log-prob gap; teacher/<name>/*
        warn_ignored_generation_settings(pair, self.warn)
        # training forwards go through DDP / FSDP2; generate, eval, checkpoints use the plain module (fully_shard: in place)
        self.train_module = dist_util.wrap_student(self.student, self.dist, self.device)
        # the LM head, picked once (scale.fused_lm_head): materialised logits, or chunks from hidden states
        self.head, materialised = build_head(
            cfg, self.objective, self.monitors, self.student, self.train_module, self.teacher_scorer, self.dist,
            vocab_size=self.vocab_size, autocast=self.autocast,
        )  # fmt: skip
        self.student_logits = materialised.student_logits  # (module, batch): the sampling-distribution logits
        self.eval_divergences = EvalDivergences(cfg)
        self.teacher_prompt = TeacherPrompt.from_config(cfg, task, self.tokenizer, self.warn, self.teachers.prompt_tokenizer)
        self.evaluator = Evaluator(
            task, self.tokenizer, eval_set, batch_size=cfg.eval.batch_size, teacher=self.teacher_scorer,
            divergences=self.eval_divergences if self.teacher_scorer.full_distribution else {},  # need the whole teacher
            student_logits=lambda b: self.student_logits(self.student, b), chunk_size=cfg.estimator.chunk_size,
            on_prompts=self._count_truncated, samples=cfg.eval.samples,
            position_sums=getattr(self.head, "position_sums", None),  # the fused head's (no [N, R, V] logits)
            routing=self.teachers.router, teacher_view=self.teacher_prompt.attach,
        )  # fmt: skip
        self.params = [p for p in self.student.parameters() if p.requires_grad]
        # fused AdamW: no parameter-sized temporary per step (runtime/host.py)
        self.optimizer = host.adamw(self.params, lr=tc.lr, weight_decay=tc.weight_decay, device=self.device, fsdp=fsdp)
        # loss.ppo_epochs / ppo_mini_batches: several clipped updates per rollout through the head, each an optimizer step
        self.ppo = None if cfg.loss.ppo_updates == 1 else PpoUpdates(
            cfg, head=self.head, check_teacher=self._check_teacher, optimizer=self.optimizer, params=self.params, warn=self.warn,
            after_update=lambda: self._sync_teacher(self.step + 1),
        )  # fmt: skip
        # estimator=sampled: an eval divergence that stays above its start is said once (advice.py)
        own = self.eval_divergences.own_key
        self.eval_rise = EvalRise(own, "sampled", tc.lr, cfg.estimator.baseline.value) if cfg.estimator.name.value == "sampled" else None
        self.lr_schedule = LrSchedule(tc)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_schedule.factor)
        self.state = TrainState(
            cursor=DataCursor(len(self.train_problems), cfg.seed), guard=StepGuard(tc.max_bad_steps, large=guards.large_coefficients(cfg))
        )
        self.rollouts = rollout_source(  # in the loop, or a producer rollout.staleness updates ahead (training/producer.py)
            cfg, self.engines, self.student, self.tokenizer, self.vocab_size, autocast=self.autocast, phases=self.phases,
            task=task, problems=self.train_problems, cursor=self.state.cursor,
        )  # fmt: skip
        self._extra_sinks = sinks
        self.pair_record, self.fingerprint = self.teachers.identity(*run_identity(cfg, pair, self.teacher_scorer))
        self._session: dict[str, Any] = {"session": "start", "from_step": 0}

    @property
    def step(self) -> int:
        return self.state.step

    def _count_truncated(self, prompts) -> int:
        return count_truncated(self.tokenizer, prompts, self.cfg.rollout.max_prompt_tokens, warn_once=self._warn_once)

    # -- one step -------------------------------------------------------------
    def _on_policy(self, step: int) -> bool:
        """GKD's lambda: whether step ``step`` is sampled by the student (deterministic in seed, step)."""
        frac = self.cfg.rollout.on_policy_fraction
        return frac >= 1.0 or (frac > 0.0 and random.Random(self.cfg.seed * 7919 + step).random() < frac)

    def sample(self, step: int):
        """This rank's rows of the step's global batch as ``Draw`` says (re-seeded from (seed, step): resume-exact), any engine."""
        cfg, n = self.cfg, self.cfg.rollout.n_samples
        torch.manual_seed((cfg.seed * 1_000_003 + step + 1) % (2**63))
        problems = [self.train_problems[i] for i in self.state.cursor.next(cfg.trainer.batch_size)]
        prompts = [self.task.render_prompt(p, self.tokenizer) for p in problems]
        self._n_truncated = self._count_truncated(prompts)
        draw = Draw.for_step(cfg.seed, step, len(prompts) * n, self.dist)
        batch = self.rollouts.generate(step, [prompts[r // n] for r in draw.rows], draw.seeds, on_policy=self._on_policy(step))
        batch = self.teachers.route(problems, dataclasses.replace(batch, prompt_index=torch.tensor(draw.rows) // n)).to(self.device)
        batch = self.teacher_prompt.attach(batch, problems)  # teacher.privileged: the teacher's own prompt
        return self.reward(batch, problems)  # reward.coef > 0: each row's reward advantage attached

    def accumulate(self, batch, n_tokens: int | None = None, n_rows: int | None = None) -> tuple[float, Tally]:
        """Forward/backward over micro-batches through the LM head (``training/heads.py``);
        gradients equal those of the whole batch. Returns the loss and the step's ``Tally``.
        ``n_tokens``: the step's GLOBAL response-token count (all ranks; default: this batch's)."""
        n_tokens = batch.num_trained_tokens if n_tokens is None else n_tokens
        norm = loss_normalizer(self.cfg, n_tokens, n_rows if n_rows is not None else batch.num_sequences)  # every micro-batch divides by it
        mbs = list(batch.micro_batches(self.cfg.trainer.micro_batch_size))
        return self.head.accumulate(mbs, on_policy=batch.on_policy, n_tokens=norm, check_teacher=self._check_teacher)

    def _sync_teacher(self, step: int) -> None:
        with self.phases("sync"):  # a teacher made from the student follows every applied update
            self.teacher_scorer.sync(self.student, step)

    def _check_teacher(self, scores: torch.Tensor) -> None:
        """Before the loss: a NaN teacher logit would make the loss NaN with no hint where it came from. All ranks agree."""
        bad = nonfinite_summary(scores)
        if dist_util.any_rank(bad is not None, self.dist):
            where = f"{bad} teacher logits" if bad is not None else "on another rank"
            raise NonFinite(f"teacher log-probs are not finite at step {self.step + 1} ({where})")

    def train_step(self) -> dict[str, float]:
        tc, guard = self.cfg.trainer, self.state.guard
        t0 = time.perf_counter()
        self.phases.reset()  # what an eval's teacher calls counted belongs to no step
        lr = self.optimizer.param_groups[0]["lr"]
        batch = self.sample(self.step)
        t_rollout = time.perf_counter() - t0
        step, problem = self.step + 1, None
        self.optimizer.zero_grad(set_to_none=True)
        n_global, seq_global = (int(x) for x in dist_util.all_reduce_sum([batch.num_trained_tokens, batch.num_sequences], self.dist))
        if n_global == 0:  # nothing to learn from: a counted no-op, never a 0/0 NaN
            loss, tally, grad_norm = 0.0, Tally(), 0.0
            guard.record_empty()
            self._warn_once("empty", f"step {step} has no response tokens: no update (counted in guard/empty_steps)")
        else:
            try:
                with self.phases("train"):  # the teacher's scores inside it are counted as teacher time
                    if self.ppo is not None:  # its own optimizer steps; problem: none of them applied
                        loss, tally, grad_norm, problem = self.ppo.step(batch, n_global, step)
                    else:
                        loss, tally = self.monitors.reduce(*self.accumulate(batch, n_global, seq_global), self.dist)
                        max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
                        grad_norm = dist_util.grad_norm_value(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            except NonFinite as ex:
                loss, grad_norm, problem = float("nan"), float("nan"), str(ex)
                tally = Tally({k: float("nan") for k in self.monitors.names})
            if problem is None and not (math.isfinite(loss) and math.isfinite(grad_norm)):
                problem = f"loss={loss}, grad/norm={grad_norm}"
        if problem is None and n_global and self.ppo is None:  # a non-finite loss or gradient never reaches the weights
            with self.phases("train"):
                self.optimizer.step()
            self._sync_teacher(step)
        guard.record(step, problem)
        if problem is not None:
            self.warn(f"opd-train: warning: step {step} skipped (no update): {problem}")
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # a skipped or empty first step: torch warns about the order
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.state.step += 1
        dt = time.perf_counter() - t0
        # teacher/<name>/*, reward/*, self/*, async/*
        metrics = {
            **self.teachers.metrics(tally, n_global),
            **self.reward.metrics,
            **self.teacher_scorer.metrics(),
            **self.rollouts.metrics(),
        }
        for line in (self.monitors.gap_warning(metrics, step), self.advice.update(metrics, step)):
            if line:
                self.warn(line)
        metrics.update(
            {
                "loss": loss,
                "response/length_mean": n_global / max(seq_global, 1),
                "grad/norm": grad_norm,
                "grad/skipped": 0.0 if problem is None else 1.0,
                "guard/skipped_steps": float(guard.skipped_steps),
                "guard/empty_steps": float(guard.empty_steps),
                "rollout/truncated_prompts": float(self._n_truncated),
                "lr": lr,
                "rollout/on_policy": 1.0 if batch.on_policy else 0.0,
                "perf/tokens_per_s": n_global / dt,
                "perf/step_s": dt,
                "perf/rollout_s": t_rollout,
                **self.phases.take_for(batch, self.device),  # perf/<phase>_s, tokens/s per phase, peak memory
            }
        )
        for k in self.monitors.names:
            metrics.setdefault(k, 0.0)
        return metrics

    # -- evaluation -----------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy eval accuracy, and the exact divergences over the vocabulary at every
        position of the student's greedy eval responses (same S and T as the objective)."""
        was_training = self.student.training
        self.student.eval()
        try:
            out = self.evaluator(self.engines.eval_student, self.device)
        finally:
            self.student.train(was_training)
        out = self.eval_divergences.name_own(out)
        # what the eval's teacher scoring measured (teacher.privileged: eval/self/privileged_gain), kept out of the next step's
        out.update({f"eval/{k}": v for k, v in self.teacher_scorer.metrics().items() if k == "self/privileged_gain"})
        if self.state.teacher_accuracy is None:
            out.update(self.teachers.accuracy(self.evaluator, self.engines.eval_teacher))  # and each teacher's on its prompts
            self.state.teacher_accuracy = self.advice.teacher_accuracy(out["eval/teacher_accuracy"])  # ~0: said once
        return out

    # -- checkpoints ----------------------------------------------------------
    def save(self) -> Path:
        """Rank 0 writes (FSDP2: every rank first gathers the full state); all ranks then agree."""
        model, optimizer = checkpoint_views(self.student, self.optimizer, self.dist, save=True)  # a collective
        path = checkpoint.checkpoint_root(self.run_dir) / f"step_{self.step:06d}"
        if self.dist.is_main:
            loop = {**self.state.state_dict(), "config": self.fingerprint, "config_hash": fingerprint.short_hash(self.fingerprint)}
            if self.lr_schedule.segments:
                loop["lr_segments"] = self.lr_schedule.segments
            producer_meta, producer_state = self.rollouts.state(self.step)  # rollouts in flight (rollout.staleness > 0)
            if producer_meta:
                loop["producer"] = producer_meta
            path = checkpoint.save(
                self.run_dir, self.step, model, optimizer, self.scheduler, loop, keep=self.cfg.checkpoint.keep,
                teacher_state=self.teacher_scorer.state_dict(), producer_state=producer_state,
            )  # fmt: skip
        dist_util.barrier(self.dist)
        return path

    def resume(self) -> bool:
        """Load the newest checkpoint that loads (``checkpoint.restore``); False: a fresh run."""
        model, optimizer = checkpoint_views(self.student, self.optimizer, self.dist, save=False)
        found = checkpoint.restore(self.run_dir, model, optimizer, self.scheduler, warn=self.warn)
        if found is None:
            return False
        step, loop = found
        if (line := fingerprint.below_step(self.run_dir, step, self.cfg.trainer.max_steps)) is not None:
            raise ConfigError(line)
        lr = self.optimizer.param_groups[0]["lr"]
        stored = loop.pop("config", None)
        self._session, factor = resume_session(
            self.cfg, self.run_dir, step, stored, self.fingerprint, lr, self.scheduler.base_lrs[0], self.warn
        )
        if factor is not None:  # checkpoint.extend: the schedule continues from the checkpoint's lr
            self.lr_schedule.extend(step, factor)
        loop.pop("config_hash", None)
        try:  # a teacher made from the student continues from its saved weights
            self.teacher_scorer.load_state_dict(loop.pop(checkpoint.TEACHER_STATE, {}))
        except ValueError as ex:
            raise ConfigError(f"teacher.name={self.cfg.teacher.name.value}: checkpoint at step {step}: {ex}") from None
        self.lr_schedule.segments += loop.pop("lr_segments", [])
        self.rollouts.load_state(loop.pop("producer", None), loop.pop(checkpoint.PRODUCER_STATE, {}))
        self.state.load_state_dict(step, loop)
        if self._session.get("eval_set_changed"):
            self.state.teacher_accuracy = None  # measured again on the new eval set (``_run``)
        self.warn(f"opd-train: resuming from step {step} (checkpoint {checkpoint.checkpoint_root(self.run_dir) / f'step_{step:06d}'})")
        return True

    # -- the run --------------------------------------------------------------
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
        if summary and self.dist.is_main:
            line = summary_line(summary, self.run_dir)
            print(line, flush=True)  # stdout: `opd-train | tail -1` is the result
            self.log_line(line)
            self.log_line("summary: " + json.dumps(summary, sort_keys=True, default=str))
        return summary

    def _run(self, preempt: PreemptionGuard, stop_after: int | None):
        tc, ev, ck, state = self.cfg.trainer, self.cfg.eval, self.cfg.checkpoint, self.state
        resumed = self.resume()
        if self.dist.is_main:
            from opd_exp.sinks.tracking import hydra_job

            fingerprint.append_history(self.run_dir, {**self._session, "overrides": hydra_job().overrides})
        sink = run_sinks(
            self.cfg,
            self.run_dir,
            main=self.dist.is_main,
            extra=self._extra_sinks,
            resume_step=self.step if resumed else None,
            warn=self.warn,
        )
        if self.pair_record:
            sink.config({"pair": self.pair_record})
        self.console.progress = progress = Progress(
            tc.max_steps, initial=self.step, enabled=tc.progress, divergence=self.cfg.divergence.name.value, loss=self.cfg.loss.name.value
        )
        t_start = time.perf_counter() - state.elapsed_s
        try:
            if not resumed or self._session.get("eval_set_changed"):  # a fresh run, or an extension onto a new eval set
                state.eval_before = state.eval_last = require_finite(self.evaluate(), self.step)
                self.console.eval(self.step, state.eval_before)
                sink.log(state.eval_before, step=self.step)
            progress.start()  # the step-0 eval is outside step 1's time and the ETA
            done_now = 0  # a signal only sets a flag, acted on between steps: never a checkpoint of a half-done step
            while self.step < tc.max_steps and not self._stop_requested(preempt):
                cursor, metrics = state.cursor.state_dict(), None
                try:  # a teacher server lost in the step or its eval: stop at the last finished step, saved
                    metrics = self.train_step()
                    cursor, last = state.cursor.state_dict(), self.step == tc.max_steps
                    if (ev.every and self.step % ev.every == 0) or last:
                        state.eval_last = self.evaluate()
                        self.console.eval(self.step, state.eval_last)
                        if self.eval_rise is not None and (line := self.eval_rise.update(state.eval_before, state.eval_last, self.step)):
                            self.warn(line)
                        metrics.update(state.eval_last)
                except TeacherUnavailable as ex:
                    if metrics is not None:  # the step finished: its row is kept, without the lost eval
                        sink.log(metrics, step=self.step)
                    if self._stop_requested(preempt):  # a signal cut the teacher's retries short: the preemption stop
                        self.optimizer.zero_grad(set_to_none=True)
                        state.cursor.load_state_dict(cursor)
                        raise self._preempted(preempt) from None
                    raise self._teacher_lost(ex, cursor) from None
                if self.step % tc.log_every == 0 or last or "eval/accuracy" in metrics:
                    sink.log(metrics, step=self.step)
                progress.update(metrics)
                state.elapsed_s = time.perf_counter() - t_start
                if state.guard.should_stop:
                    raise Diverged(state.guard.stop_message(self.step, checkpoint.latest(self.run_dir)))
                if last and state.guard.skipped_steps >= self.step:  # nothing was ever trained: no ordinary summary
                    raise Diverged(state.guard.all_skipped_message(self.step, checkpoint.latest(self.run_dir)))
                # No periodic save inside a run of bad steps: keep the checkpoints from before it.
                if (ck.every and self.step % ck.every == 0 and not state.guard.bad_in_a_row) or last:
                    self.save()
                done_now += 1
                if stop_after is not None and done_now >= stop_after and not last:
                    return {}
            if self._stop_requested(preempt) and self.step < tc.max_steps:
                raise self._preempted(preempt)
            summary = self.summary()
            sink.summary(summary)
        finally:
            progress.close()
            self.console.progress = None
            sink.close(exit_code=preempt.exit_code)  # a preempted run's W&B run ends with 75
            self.teacher_scorer.close()
            self.rollouts.close()
        return summary

    def _preempted(self, preempt: PreemptionGuard) -> Preempted:
        """Saved at the last finished step: raised through the run's lock and signal guard (exit 75)."""
        stop = Preempted(preempt.signum or signal.SIGTERM, self.step, self.save())
        preempt.exit_code = EXIT_PREEMPTED
        stop.previous_handler = preempt.previous_handler()
        return stop

    def _teacher_lost(self, ex: TeacherUnavailable, cursor: dict) -> ConfigError:
        """The teacher server was lost: the data position goes back to the last finished step (``cursor``), a checkpoint is saved there, one line says how to resume."""
        self.optimizer.zero_grad(set_to_none=True)
        self.state.cursor.load_state_dict(cursor)
        path = self.save()
        return ConfigError(
            f"{ex}; the run stopped before step {self.step + 1} (nothing trained on partial scores), checkpoint at step "
            f"{self.step} saved to {path}; to resume: start the teacher server again and run the same command"
        )

    def _stop_requested(self, preempt: PreemptionGuard) -> bool:
        """A preemption signal seen by any rank stops every rank at the same step boundary."""
        return dist_util.any_rank(preempt.requested, self.dist)

    def summary(self) -> dict[str, Any]:
        st = self.state
        before = self.eval_divergences.name_own(dict(st.eval_before))  # an extension that switched divergence: under the fixed name
        return summary(self.step, st.elapsed_s, before, st.eval_last, self.eval_divergences.own_key, st.teacher_accuracy, self.pair_record)
