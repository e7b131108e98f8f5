"""The jobs of this process's multirun: those started and those that failed, shared by ``opd-train``
and the launchers that run jobs in this process (basic, dry) whichever way the command was
started (a console script, or ``python -m opd_exp.cli.train``, where the entry module is
``__main__`` and module-level state there would be a second copy)."""

from __future__ import annotations

import sys
from pathlib import Path

# (job folders) and (job number, job folder, message, exit code)
JOBS_STARTED: list[Path] = []
FAILED_JOBS: list[tuple[int, str, str, int]] = []
# the run folders whose lock this process took: their train.log gets this job's console lines
# (never the log of a folder another process holds)
HELD: set[Path] = set()


def log_line(run_dir: Path | str, line: str) -> None:
    """A console line of ``opd-train`` (an error, the preemption) also in ``<run>/train.log``, as
    the trainer's own lines are (``training.console.Console``): when this process holds the run
    folder (``HELD``), on the main rank."""
    import os

    if Path(run_dir) in HELD and os.environ.get("RANK", "0") == "0":
        from opd_exp.training.console import Console

        Console(Path(run_dir)).log_line(line)


def failed_summary() -> str:
    n = len(FAILED_JOBS)
    jobs = "; ".join(f"#{num} ({folder}): {line}" for num, folder, line, _ in FAILED_JOBS)
    return f"{n} of {max(len(JOBS_STARTED), n)} jobs of the multirun failed: {jobs} -- fix those and run the same multirun again (finished jobs are skipped)"


def job_failed(ex: BaseException, code: int, hc) -> float:
    """One line for a job that cannot run. A single run exits with ``code``; in a multirun the
    other jobs still run (the failure is recorded and ``main`` exits non-zero at the end)."""
    from hydra.types import RunMode

    from opd_exp.cli.errors import one_line
    from opd_exp.config.plugins import missing_hint

    line = one_line(ex) + missing_hint(hc.runtime.output_dir)
    print(f"opd-train: error: {line}", file=sys.stderr, flush=True)
    log_line(hc.runtime.output_dir, f"opd-train: error: {line}")
    if hc.mode != RunMode.MULTIRUN:
        sys.exit(code)
    FAILED_JOBS.append((int(hc.job.get("num", len(FAILED_JOBS))), str(hc.runtime.output_dir), line, code))
    if "BasicLauncher" not in str(hc.launcher.get("_target_", "")):
        raise ex  # jobs in other processes: Hydra collects the failure (after every job has run)
    return float("nan")
