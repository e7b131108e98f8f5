"""What a resume needs beyond ``runtime/checkpoint.py``: the views of a (possibly FSDP-sharded)
student and optimizer that a checkpoint is written from and read into, and the comparison of the
checkpoint's settings with this run's (refused, or with ``checkpoint.extend`` an extension that
continues the learning-rate schedule and is recorded in the run's history)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from opd_exp.config.deprecated import upgrade_flat
from opd_exp.config.schema import TrainConfig
from opd_exp.runtime import distributed as dist_util
from opd_exp.runtime import fingerprint
from opd_exp.runtime.errors import ConfigError


def checkpoint_views(student, optimizer, dist, *, save: bool):
    """(model, optimizer) as a checkpoint sees them: the modules themselves, or under FSDP2 the
    full state (saving: gathered by every rank, a collective; loading: full state in, sharded in place)."""
    if not (dist.active and dist.parallel == "fsdp"):
        return student, optimizer
    model, opt = dist_util.FullModelView(student), dist_util.FullOptimizerView(student, optimizer)
    if save:
        return dist_util.Frozen(model.state_dict()), dist_util.Frozen(opt.state_dict())
    return model, opt


def resume_session(
    cfg: TrainConfig,
    run_dir: Path,
    step: int,
    stored: dict[str, Any] | None,
    current: dict[str, Any],
    lr: float,
    base_lr: float,
    warn: Callable[[str], None],
) -> tuple[dict[str, Any], float | None]:
    """(the session record, the lr factor an extension continues from, or None). Refuses a resume
    with other settings unless ``checkpoint.extend``; a setting newer than the checkpoint, at the
    schema's default, is no difference (``fingerprint.differences``)."""
    defaults = fingerprint.schema_defaults(TrainConfig())
    session: dict[str, Any] = {"session": "resume", "from_step": step}
    if stored is None:
        warn("opd-train: warning: the checkpoint records no settings (written by an older version): not compared")
        return session, None
    stored = upgrade_flat(stored)  # a checkpoint from before the eval/checkpoint/scale groups
    diff = fingerprint.differences(stored, current, defaults)
    if not diff:
        return session, None
    tc = cfg.trainer
    if not cfg.checkpoint.extend:
        raise ConfigError(fingerprint.refusal(run_dir, stored, current, defaults))
    session = {"session": "extend", "from_step": step, "changed": {k: [a, b] for k, (a, b) in diff.items()}}
    warn(
        f"opd-train: extending the run from step {step} with other settings ({fingerprint.describe(diff)}); "
        f"the learning rate continues from {lr:.3g} to the end of the {tc.schedule.value} schedule at step {tc.max_steps}; "
        f"recorded in {run_dir / fingerprint.HISTORY}"
    )
    if changed := fingerprint.eval_set_changes(diff):  # never one summary over two eval sets
        session["eval_set_changed"] = changed
        warn(
            f"opd-train: the extension changes what the eval measures ({', '.join(changed)}): the student is evaluated "
            f"on the new eval set at step {step} and the teacher's accuracy measured on it again; the summary's "
            f"'before' values are that evaluation (metrics.jsonl rows up to step {step} are on the old set)"
        )
    return session, lr / base_lr if base_lr else 0.0
