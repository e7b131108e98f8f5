"""The loop's groups: ``trainer`` (steps, batch, optimiser, schedule, monitors), ``eval``, ``checkpoint`` and ``logger``."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from opd_exp.config.checks import check as _check
from opd_exp.config.checks import finite as _finite


class Schedule(Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class LoggerName(Enum):
    wandb = "wandb"
    none = "none"


@dataclass
class TrainerConfig:
    """The optimisation loop: steps, batch, optimiser, schedule, logging and the step monitors."""

    # optimizer steps
    max_steps: int = 2500
    # distinct prompts per step (each sampled rollout.n_samples times)
    batch_size: int = 64
    # sequences per forward/backward (0: all at once); the loss is normalised by the step's
    # global response-token count, so accumulation equals one big batch
    micro_batch_size: int = 0
    # peak learning rate (AdamW)
    lr: float = 3e-3
    weight_decay: float = 0.0
    # learning-rate schedule after warm-up
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 20
    # gradient-norm clip (0: off)
    grad_clip: float = 1.0
    # log metrics every N steps
    log_every: int = 1
    # console progress bar
    progress: bool = True
    # stop (exit 3) after this many steps in a row whose loss, gradient norm or teacher
    # log-probs were NaN/inf; each such step is skipped (no update) and counted
    max_bad_steps: int = 10
    # exact/jsd, exact/kl_reverse, exact/kl_forward every step on the step's own rollout (read off
    # the monitors' one pass over [tokens, V]); false drops them
    exact_metrics: bool = True
    # size of the top-k sets of overlap/teacher_mass, overlap/student_mass, overlap/ratio; 0 drops
    # those three (their two top-k searches are the monitors' largest cost at small vocabularies)
    overlap_k: int = 8

    def __post_init__(self) -> None:
        _check(
            isinstance(self.overlap_k, int) and self.overlap_k >= 0, "trainer.overlap_k", self.overlap_k, "integer >= 0 (0: no overlap/*)"
        )
        _check(self.max_steps >= 0, "trainer.max_steps", self.max_steps, "integer >= 0")
        _check(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "integer >= 1")
        _check(self.micro_batch_size >= 0, "trainer.micro_batch_size", self.micro_batch_size, "integer >= 0")
        _check(_finite(self.lr) and self.lr >= 0, "trainer.lr", self.lr, ">= 0")
        _check(_finite(self.weight_decay) and self.weight_decay >= 0, "trainer.weight_decay", self.weight_decay, ">= 0")
        _check(self.warmup_steps >= 0, "trainer.warmup_steps", self.warmup_steps, "integer >= 0")
        _check(
            _finite(self.grad_clip) and self.grad_clip >= 0,
            "trainer.grad_clip",
            self.grad_clip,
            "a finite number >= 0, the largest gradient norm kept (0 turns clipping off, which is what inf would mean)",
        )
        for key in ("log_every", "max_bad_steps"):
            _check(getattr(self, key) >= 1, f"trainer.{key}", getattr(self, key), "integer >= 1")


@dataclass
class EvalConfig:
    """Evaluation on the task's eval split (greedy; optional temperature-1 samples)."""

    # evaluate every N steps (0: only before and after training)
    every: int = 250
    # eval prompts (0: the task's whole eval split); more than the split holds is refused
    size: int = 0
    # sequences per eval generation batch
    batch_size: int = 128
    # k temperature-1 samples per eval prompt for eval/precision, eval/pass@k, eval/entropy and
    # (tasks that list their answers) eval/coverage; 0: off (greedy eval only, the default's cost)
    samples: int = 0

    def __post_init__(self) -> None:
        for key in ("every", "size", "samples"):
            _check(getattr(self, key) >= 0, f"eval.{key}", getattr(self, key), "integer >= 0")
        _check(self.batch_size >= 1, "eval.batch_size", self.batch_size, "integer >= 1")


@dataclass
class CheckpointConfig:
    """Checkpoints in the run folder, and what a resume may change."""

    # checkpoint every N steps (0: only at the end)
    every: int = 250
    # complete checkpoints kept in the run folder
    keep: int = 2
    # resume a run folder whose checkpoint was made with other settings (e.g. a larger
    # trainer.max_steps): without it such a resume is refused, naming the keys that differ. The
    # learning rate continues from the checkpoint's value, decaying over the remaining steps;
    # each session's overrides are appended to <run>/history.yaml
    extend: bool = False

    def __post_init__(self) -> None:
        _check(self.every >= 0, "checkpoint.every", self.every, "integer >= 0")
        _check(self.keep >= 1, "checkpoint.keep", self.keep, "integer >= 1")


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl (always written)."""

    name: LoggerName = LoggerName.wandb
    project: str = "opd-exp"
    entity: str | None = None
    group: str | None = None
    job_type: str | None = "train"
    tags: list[str] = field(default_factory=list)
    # offline: no network; online; disabled
    mode: str = "offline"
    # when W&B cannot start (bad key, no network, disk full): fail (one line, exit 2) | offline
    on_error: str = "fail"

    def __post_init__(self) -> None:
        _check(self.mode in ("offline", "online", "disabled"), "logger.mode", self.mode, "offline, online, disabled")
        _check(self.on_error in ("fail", "offline"), "logger.on_error", self.on_error, "fail, offline")
