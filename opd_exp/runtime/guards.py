"""Reliability guards of the training loop: preemption signals and non-finite values.

Exit codes of ``opd-train`` (documented in docs/reliability.md):

* 0  finished (or already finished: a rerun in a finished folder does nothing);
* 2  a config or input error, one line on stderr (``ConfigError``);
* 3  stopped: ``trainer.max_bad_steps`` non-finite steps in a row (``Diverged``); the last
     checkpoint, written before the trouble, is intact;
* 75 preempted (EX_TEMPFAIL, "try again later"): a checkpoint was saved at the step
     boundary after SIGTERM/SIGUSR1/SIGUSR2 or Ctrl-C (SIGINT); running the same command resumes;
* 130 a second Ctrl-C before that save: stopped at once, nothing written after the last
     checkpoint (a half-written one is removed).

Why 75 and not 0 or 143: 0 would tell ``opd-train && next-step`` pipelines and job chains
that training finished; 143 (128+SIGTERM) is what an unhandled kill reports, when nothing
was saved. SLURM requeues a preempted job (``--requeue``) whatever its exit code, so 75 costs
nothing there and lets a wrapper loop tell "resume me" apart from success and failure.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EXIT_CONFIG = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75

# SIGTERM: SLURM preemption/scancel, Kubernetes, systemd; SIGUSR1: `sbatch --signal=USR1@120`;
# SIGUSR2: submitit's default timeout/preemption signal; SIGINT: Ctrl-C (a second Ctrl-C stops
# at once, without saving, as KeyboardInterrupt).
PREEMPT_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT") if hasattr(signal, n))
EXIT_INTERRUPTED = 130  # 128 + SIGINT: a second Ctrl-C, nothing saved after the last checkpoint
# the guards now active (a run's), so code that waits in a worker thread (a served teacher's
# retries) can see a signal the main thread received and stop waiting for more
_ACTIVE: list[PreemptionGuard] = []


def preemption_requested() -> int | None:
    """The signal an active ``PreemptionGuard`` received (None: none), read from any thread."""
    return next((g.signum for g in list(_ACTIVE) if g.signum is not None), None)


class Preempted(Exception):
    """A preemption signal arrived; a checkpoint was saved at the next step boundary."""

    def __init__(self, signum: int, step: int, checkpoint: Any):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"{signal.Signals(signum).name} received: checkpoint at step {step} saved to {checkpoint}; "
            f"run the same command again to resume (exit code {EXIT_PREEMPTED})"
        )


class Diverged(Exception):
    """Too many non-finite steps in a row; the run stops without writing a checkpoint."""


class NonFinite(Exception):
    """A tensor that feeds the loss is NaN/inf (raised before it reaches the loss)."""


class PreemptionGuard:
    """While active, SIGTERM/SIGUSR1/SIGUSR2 only set ``signum``; the loop polls it at step
    boundaries, saves, and calls ``finish``. Handlers are installed only from the main thread
    (Python's rule) and restored on exit."""

    def __init__(self, signals=PREEMPT_SIGNALS):
        self.signals = tuple(signals)
        self.signum: int | None = None
        self.exit_code: int | None = None  # EXIT_PREEMPTED once the loop stopped for it (the W&B run ends with it)
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # Ctrl-C again: the user does not want to wait for the save
        if self.signum is None:  # the first signal decides; repeats (SLURM resends) change nothing
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> PreemptionGuard:
        _ACTIVE.append(self)
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def previous_handler(self) -> Callable | None:
        """The Python-level handler that was installed before us for the received signal
        (submitit's requeue handler under hydra-submitit-launcher), if any."""
        prev = self._previous.get(self.signum) if self.signum is not None else None
        # Python's own Ctrl-C handler would only raise KeyboardInterrupt after the save
        return prev if callable(prev) and prev is not signal.default_int_handler else None


# a loss coefficient above this scales the loss rather than weighting its terms: a non-finite stop
# names it (config/reward.py refuses reward.coef and loss.kl_coef above it)
LARGE_COEF = 1e6


def _setting(cfg: Any, dotted: str) -> Any:
    """``cfg``'s value at ``a.b``: a TrainConfig's attribute (an enum as its value) or a plain
    mapping's key (a run's .hydra/config.yaml); None when absent."""
    node = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return getattr(node, "value", node)


def large_coefficients(cfg: Any) -> tuple[str, ...]:
    """``key=value`` of each loss coefficient the config sets above LARGE_COEF: loss.kl_coef,
    reward.coef, positions.gamma (with positions=iw_opd: its weights reach 1 + gamma) and
    divergence.clip (the importance weights it lets through)."""
    keys = ["loss.kl_coef", "reward.coef", "divergence.clip"]
    if _setting(cfg, "positions.name") == "iw_opd":
        keys.insert(2, "positions.gamma")
    out = []
    for key in keys:
        value = _setting(cfg, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not value <= LARGE_COEF:  # nan/inf too
            out.append(f"{key}={value:g}")
    return tuple(out)


def with_scale_advice(line: str, large: tuple[str, ...] | list[str]) -> str:
    """A non-finite stop's line with the large coefficients named first in its advice: they, not the
    teacher or the learning rate, are the likely cause."""
    head, sep, allowed = line.partition("; allowed: ")
    if not large or not sep or "past float range" in line:
        return line
    verb = "scales" if len(large) == 1 else "scale"
    return (
        f"{head}; the config's {', '.join(large)} {verb} the loss past float range; allowed: values that keep the loss finite "
        f"(at most {LARGE_COEF:g}), then {allowed}"
    )


def nonfinite_summary(x) -> str | None:
    """None if every entry of tensor ``x`` is finite, else e.g. '3 NaN, 1 inf of 960'."""
    import torch

    finite = torch.isfinite(x)
    if bool(finite.all()):
        return None
    nan = int(torch.isnan(x).sum())
    inf = int((~finite).sum()) - nan
    parts = [f"{nan} NaN" if nan else "", f"{inf} inf" if inf else ""]
    return f"{', '.join(p for p in parts if p)} of {x.numel()}"


@dataclass
class StepGuard:
    """The loop's non-finite guard: records each step's outcome, decides when to stop, and says
    why. Its counters are part of the loop state (a resumed run continues them)."""

    max_bad_steps: int
    skipped_steps: int = 0  # steps whose loss, gradient or teacher logits were not finite
    empty_steps: int = 0  # steps without a response token (no update)
    bad_in_a_row: int = 0
    bad_since: int = 0
    last_problem: str | None = None
    # the config's coefficients above LARGE_COEF (``large_coefficients``): named first in the stop's advice
    large: tuple[str, ...] = ()

    def record_empty(self) -> None:
        self.empty_steps += 1

    def record(self, step: int, problem: str | None) -> None:
        """``problem`` is None for a finite step, else what was not finite."""
        if problem is None:
            self.bad_in_a_row = 0
            return
        self.skipped_steps += 1
        self.bad_in_a_row += 1
        if self.bad_in_a_row == 1:
            self.bad_since = step
        self.last_problem = problem

    @property
    def should_stop(self) -> bool:
        return self.bad_in_a_row >= self.max_bad_steps

    def stop_message(self, step: int, latest_checkpoint: Any) -> str:
        return with_scale_advice(
            f"{self.bad_in_a_row} non-finite steps in a row (steps {self.bad_since}-{step}; last: {self.last_problem}); "
            f"stopped without saving, last checkpoint intact: {latest_checkpoint or 'none'}; allowed: a lower trainer.lr, "
            f"trainer.grad_clip > 0, a teacher with finite log-probs, or a larger trainer.max_bad_steps={self.max_bad_steps}",
            self.large,
        )

    def all_skipped_message(self, step: int, latest_checkpoint: Any) -> str:
        """Every step of the run was skipped (fewer than ``max_bad_steps`` of them): nothing trained."""
        return with_scale_advice(
            f"every one of the run's {step} steps was non-finite and skipped (last: {self.last_problem}); nothing was trained, "
            f"no checkpoint written (last checkpoint: {latest_checkpoint or 'none'}); allowed: a teacher with finite log-probs, "
            f"a lower trainer.lr, or trainer.grad_clip > 0",
            self.large,
        )

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "skipped_steps": self.skipped_steps,
            "empty_steps": self.empty_steps,
            "bad_in_a_row": self.bad_in_a_row,
            "bad_since": self.bad_since,
        }
        if self.last_problem is not None:
            out["last_problem"] = self.last_problem
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.empty_steps = int(state.get("empty_steps", 0))
        self.bad_in_a_row = int(state.get("bad_in_a_row", 0))
        self.bad_since = int(state.get("bad_since", 0))
        self.last_problem = state.get("last_problem")
