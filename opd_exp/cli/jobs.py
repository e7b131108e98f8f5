"""The jobs of this process's multirun: those started and those that failed, shared by ``opd-train``
and the launchers that run jobs in this process (basic, dry) whichever way the command was
started (a console script, or ``python -m opd_exp.cli.train``, where the entry module is
``__main__`` and module-level state there would be a second copy)."""

from __future__ import annotations

from pathlib import Path

# (job folders) and (job number, job folder, message, exit code)
JOBS_STARTED: list[Path] = []
FAILED_JOBS: list[tuple[int, str, str, int]] = []


def failed_summary() -> str:
    n = len(FAILED_JOBS)
    jobs = "; ".join(f"#{num} ({folder}): {line}" for num, folder, line, _ in FAILED_JOBS)
    return f"{n} of {max(len(JOBS_STARTED), n)} jobs of the multirun failed: {jobs} -- fix those and run the same multirun again (finished jobs are skipped)"
