"""What a run says while it trains: one line on stderr (through the progress bar while it is
shown) and the same line, secrets scrubbed, in ``<run>/train.log``; a warning of one kind once;
each eval as one line of its metrics (``eval_line``)."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path


class Console:
    def __init__(self, run_dir: Path, *, main: bool = True):
        self.run_dir, self.main = Path(run_dir), main
        self.progress = None  # the progress bar while the loop shows one (sinks.Progress)
        self._warned: set[str] = set()

    def warn(self, line: str) -> None:
        """One line on stderr, and in train.log (warnings, resume, preemption: every console line)."""
        if self.progress is not None:
            self.progress.write(line)
        else:
            print(line, file=sys.stderr, flush=True)
        self.log_line(line)

    def log_line(self, line: str) -> None:
        """Append to ``<run>/train.log`` (Hydra's job log file): the console's lines, kept."""
        if not self.main:
            return
        from opd_exp.runtime.secrets import scrub_text

        with contextlib.suppress(OSError), open(self.run_dir / "train.log", "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {scrub_text(line)}\n")  # e.g. a token in the run folder's path

    def warn_once(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            self.warn(f"opd-train: warning: {text}")

    def eval(self, step: int, metrics: dict) -> None:
        """Each eval, one line on the main rank: ``eval_line``."""
        if self.main:
            self.warn(eval_line(step, metrics))


def eval_line(step: int, metrics: dict) -> str:
    """``opd-train: eval at step 250: accuracy 0.412 (teacher 0.940), kl_reverse 1.319, ...``: every
    numeric ``eval/*`` value, accuracy first (3 decimals), the rest to 4 significant digits."""

    def num(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    values = {k[5:]: v for k, v in metrics.items() if k.startswith("eval/") and num(v)}
    parts = []
    if "accuracy" in values:
        acc = f"accuracy {values.pop('accuracy'):.3f}"
        if "teacher_accuracy" in values:
            acc += f" (teacher {values.pop('teacher_accuracy'):.3f})"
        parts.append(acc)
    parts += [f"{k} {v:.4g}" for k, v in values.items()]
    return f"opd-train: eval at step {step}: " + ", ".join(parts)
