"""What a run says while it trains: one line on stderr (through the progress bar while it is
shown) and the same line, secrets scrubbed, in ``<run>/train.log``; a warning of one kind once."""

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
        """One line on stderr, and in train.log."""
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
