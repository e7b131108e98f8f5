"""The run folder's record of the command: Hydra's ``.hydra/`` files and the sweep's ``multirun.yaml``,
written by the job that holds the folder's lock, with credentials redacted before they reach the disk."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

# `opd-train` asks Hydra not to write `.hydra/` itself (main() adds hydra.output_subdir=null):
# the job writes it once it holds the folder's lock, with credentials already redacted.
OWN_RECORD_ENV = "OPD_TRAIN_HYDRA_SUBDIR"


def write_hydra_record(cfg: DictConfig, hc, run_dir: Path) -> None:
    """Hydra's record of the job (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``),
    written by the job that holds the lock, credentials redacted before they reach the disk.
    When Hydra wrote it (``hydra.output_subdir`` given by the user), it is scrubbed in place."""
    from opd_exp.runtime.secrets import scrub_file, scrub_text

    subdir = hc.output_subdir
    if subdir is not None:
        folder = run_dir / subdir
        for f in folder.glob("*.yaml") if folder.is_dir() else ():
            scrub_file(f)
        return
    subdir = os.environ.get(OWN_RECORD_ENV)
    if not subdir or os.environ.get("RANK", "0") != "0":  # the user's output_subdir=null; torchrun: rank 0 writes
        return
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = OmegaConf.create(OmegaConf.to_container(HydraConfig.instance().cfg, resolve=False))
    with open_dict(hydra_cfg):
        hydra_cfg.hydra.output_subdir = subdir  # as if Hydra had written it
        hydra_cfg.hydra.overrides.hydra = [o for o in hydra_cfg.hydra.overrides.hydra if not o.startswith("hydra.output_subdir=")]
    folder = run_dir / subdir
    folder.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra_cfg), ("overrides.yaml", hc.overrides.task)):
        tmp = folder / f".{name}.tmp"
        tmp.write_text(scrub_text(OmegaConf.to_yaml(node)))
        os.replace(tmp, folder / name)


def scrub_sweep_record(sweep_dir: Path) -> None:
    """The sweep folder's ``multirun.yaml`` (written by Hydra before the first job) records every
    override verbatim: redact credentials there too."""
    from opd_exp.runtime.secrets import scrub_file

    f = sweep_dir / "multirun.yaml"
    if f.is_file():
        with contextlib.suppress(OSError):  # another job may be rewriting it: it scrubs the same way
            scrub_file(f)


def parameter_counts(pair) -> dict[str, int]:
    """{role: parameter count} of the loaded pair's student and teacher (every tensor once: tied
    embeddings count once); counted before the trainer wraps the models (FSDP shards, LoRA)."""
    out = {}
    for role in ("student", "teacher"):
        model = getattr(pair, role, None)
        if model is not None and hasattr(model, "parameters"):
            out[role] = sum(p.numel() for p in model.parameters())
    return out


def with_parameter_counts(record: dict, counts: dict[str, int]) -> dict:
    """The run record (summary.json's and W&B's ``pair``) with ``<role>.params``: ``opd-compare
    --phases`` sets the FLOP ratio N_T/(3 N_S) from them beside the measured teacher share."""
    out = dict(record)
    for role, n in counts.items():
        out[role] = {**(out.get(role) or {}), "params": n}
    return out
