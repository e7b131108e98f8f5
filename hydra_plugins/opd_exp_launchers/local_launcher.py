"""``hydra/launcher=local``: the jobs of a multirun in parallel on this machine, each in a fresh
process of its own (``hydra.launcher.n_jobs`` at a time).

joblib's loky pool (hydra-joblib-launcher) shares its workers between jobs: one worker killed
(the OOM killer sends SIGKILL) breaks the pool, every running job is lost and the command ends
in a ``TerminatedWorkerError`` traceback. Here a job that dies takes only itself: one line names
it (number, folder, signal), the other jobs run to their end, and the multirun's summary counts
it with the failed ones (``opd_exp.cli.jobs``). Each process is started fresh (``spawn``: safe
with torch, as loky was) and is given the job cloudpickled, as joblib does.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher


def _run_one(payload: bytes, conn) -> None:
    """In the job's own process: the job as Hydra runs it, its folder sent first, then its outcome."""
    import cloudpickle
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.singleton import Singleton
    from hydra.core.utils import run_job, setup_globals
    from omegaconf import open_dict

    idx, overrides, hydra_context, config, task_function, singleton_state = cloudpickle.loads(payload)
    setup_globals()
    Singleton.set_state(singleton_state)
    cfg = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(cfg):
        cfg.hydra.job.id = f"{cfg.hydra.job.name}_{idx}"
        cfg.hydra.job.num = idx
    HydraConfig.instance().set_config(cfg)
    conn.send(("folder", str(Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir))))
    ret = run_job(
        hydra_context=hydra_context,
        config=cfg,
        task_function=task_function,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )
    if ret.status == JobStatus.COMPLETED:
        conn.send(("done", ret.return_value))
    else:
        conn.send(("failed", _failure(ret._return_value)))  # its line, not the exception: any error crosses the pipe


def _failure(ex: BaseException) -> tuple[str, int]:
    from opd_exp.cli.errors import one_line
    from opd_exp.runtime.guards import EXIT_CONFIG, EXIT_DIVERGED, Diverged

    return one_line(ex), EXIT_DIVERGED if isinstance(ex, Diverged) else EXIT_CONFIG


def death_line(exitcode: int | None) -> tuple[str, int]:
    """(what happened, exit code) for a job process that sent no outcome."""
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name
        why = " (the OOM killer sends it when memory runs out)" if -exitcode == signal.SIGKILL else ""
        return f"its process was killed by {sig}{why}; run the same multirun again to resume it", 128 - exitcode
    return f"its process ended with exit code {exitcode} before the job finished; run the same multirun again to resume it", exitcode or 1


class LocalLauncher(Launcher):
    def __init__(self, n_jobs: int = 4) -> None:
        self.n_jobs = n_jobs
        self.config = self.hydra_context = self.task_function = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import cloudpickle
        from hydra.core.singleton import Singleton
        from hydra.core.utils import configure_log, filter_overrides, setup_globals

        from opd_exp.cli.jobs import FAILED_JOBS, JOBS_STARTED

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        n_jobs = max(1, int(self.n_jobs if self.n_jobs and self.n_jobs > 0 else multiprocessing.cpu_count()))
        state = Singleton.get_state()
        ctx = multiprocessing.get_context("spawn")
        pending = list(enumerate(job_overrides, start=initial_job_idx))
        results: dict[int, Any] = {}
        running: dict[Any, tuple[int, Sequence[str], Any, Any]] = {}  # sentinel -> (num, overrides, process, pipe)
        folders: dict[int, str] = {}
        outcomes: dict[int, tuple[str, Any]] = {}

        def drain(num, conn) -> None:  # read as messages come: a full pipe would block the job
            try:
                while conn.poll():
                    kind, value = conn.recv()
                    if kind == "folder":
                        folders[num] = value
                    else:
                        outcomes[num] = (kind, value)
            except (EOFError, OSError):
                pass  # the job closed its pipe (it ended or was killed): its exit code says which
            except Exception as ex:  # a message that does not load: the job fails, the others go on
                outcomes[num] = ("failed", (f"its result could not be read ({type(ex).__name__}: {ex})", 2))

        def finish(num, overrides, proc, conn) -> None:
            drain(num, conn)
            proc.join()
            conn.close()
            outcome = outcomes.get(num)
            folder = folders.get(num, f"job {num}")
            ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
            ret.return_value = float("nan")
            if outcome is not None and outcome[0] == "done":
                ret.return_value = outcome[1]
            else:
                # the job's own error line is already on stderr; a killed process says nothing: say it here
                line, code = outcome[1] if outcome is not None else death_line(proc.exitcode)
                if outcome is None:
                    print(f"opd-train: error: job #{num} ({folder}): {line}", file=sys.stderr, flush=True)
                FAILED_JOBS.append((num, folder, line, code))
            results[num] = ret

        while pending or running:
            while pending and len(running) < n_jobs:
                num, overrides = pending.pop(0)
                print(f"[opd-train] job #{num}: {' '.join(filter_overrides(overrides))}", flush=True)
                payload = cloudpickle.dumps((num, overrides, self.hydra_context, self.config, self.task_function, state))
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_run_one, args=(payload, writer), name=f"opd-train job {num}")
                proc.start()
                writer.close()
                JOBS_STARTED.append(Path(f"job {num}"))
                running[proc.sentinel] = (num, overrides, proc, reader)
            readers = {conn: num for num, _, _, conn in running.values()}
            try:
                ready = multiprocessing.connection.wait([*running, *readers])
            except KeyboardInterrupt:  # Ctrl-C reached every job too: let them save their checkpoints
                for _, _, proc, _ in running.values():
                    proc.join()
                raise
            for obj in ready:
                if obj in readers:
                    drain(readers[obj], obj)
            for obj in ready:
                if obj in running:
                    finish(*running.pop(obj))
        return [results[num] for num in sorted(results)]
