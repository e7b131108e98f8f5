"""``hydra/launcher=dry``: compose and validate every job of a multirun, train none.

``opd-train -m sweep=divergence hydra/launcher=dry`` prints one line per job (its overrides, then
``ok`` or the one-line error that job would stop with) and exits 2 when any job is invalid: a
typo in the fifth variant of a sweep is found before the first four have spent their hours.
Nothing is written: no job folder, no W&B run.
"""

# No `from __future__ import annotations`: Hydra scans plugins with exec_module and no sys.modules
# entry, where a dataclass with string annotations fails (every Hydra app in the environment would).

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import open_dict


@dataclass
class DryLauncherConf:
    _target_: str = "hydra_plugins.opd_exp_launchers.dry_launcher.DryLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="dry", node=DryLauncherConf, provider="opd-exp")


class DryLauncher(Launcher):
    def __init__(self) -> None:
        self.config = self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.hydra_context, self.config = hydra_context, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from opd_exp.cli.compose import check_choices, to_train_config
        from opd_exp.cli.errors import one_line
        from opd_exp.cli.jobs import FAILED_JOBS, JOBS_STARTED
        from opd_exp.runtime.guards import EXIT_CONFIG

        results = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            JOBS_STARTED.append(Path("dry run"))
            try:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                check_choices(cfg.hydra)  # `sweep=nonexistent_xyz`: refused here as the real launcher's job refuses it
                with open_dict(cfg):
                    del cfg["hydra"]
                to_train_config(cfg)
                line = "ok"
            except Exception as ex:  # every job gets its line; the summary counts the failures
                line = f"error: {one_line(ex)}"
                FAILED_JOBS.append((num, "no folder: dry run", one_line(ex), EXIT_CONFIG))
            print(f"opd-train: dry run: job #{num} {' '.join(overrides)}: {line}", flush=True)
            ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
            ret.return_value = None
            results.append(ret)
        _remove_sweep_record(Path(str(self.config.hydra.sweep.dir)))
        return results


def _remove_sweep_record(folder: Path) -> None:
    """Hydra's sweeper writes ``multirun.yaml`` before any launcher runs: a dry run leaves no folder."""
    (folder / "multirun.yaml").unlink(missing_ok=True)
    cwd = Path.cwd().resolve()
    folder = folder.resolve()
    # the sweep folder, and the empty folders above it up to (not including) the working folder
    for parent in [folder, *(p for p in folder.parents if p != cwd and p.is_relative_to(cwd))]:
        try:
            parent.rmdir()  # only while empty: never a folder that holds anything else
        except OSError:
            break
