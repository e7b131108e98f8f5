"""Checkpoints in the run folder: safetensors weights, optimizer + scheduler, JSON loop
state and RNG, written atomically (a temp folder renamed into place).

Layout: ``<run>/checkpoints/step_000050/{model.safetensors, optimizer.pt, state.json,
rng.pt, manifest.json}``. Only folders named ``step_<n>`` count; a crash mid-write leaves a
``.tmp-*`` folder that is ignored and swept away, so resume always finds a complete
checkpoint. ``manifest.json`` (written last) records each file's size, so a file truncated
afterwards (a copy cut short, a full disk) makes the checkpoint incomplete, never loadable.
Older checkpoints are pruned only after the new one has been renamed into place.

Nothing here unpickles code: weights are safetensors, the optimizer and RNG files are read
with ``torch.load(weights_only=True)``.

``RunLock``: one training process per run folder (an advisory ``flock`` the kernel drops when
the process dies, even by SIGKILL), so a second job in the same folder fails at start-up
instead of interleaving checkpoints and metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step_(\d+)$")
_FILES = ("model.safetensors", "optimizer.pt", "state.json", "rng.pt")
MANIFEST = "manifest.json"
LOCK = ".opd-train.lock"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, step: int, model, optimizer, scheduler, loop_state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep``."""
    from safetensors.torch import save_model

    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    if _complete(final):
        # Same step, same state (a preemption save right after a periodic one): never remove a
        # complete checkpoint to write its twin; a kill in between would leave none.
        return final
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))  # handles tied embeddings
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **loop_state}, indent=2) + "\n")
    sizes = {f: (tmp / f).stat().st_size for f in _FILES}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "sizes": sizes}) + "\n")
    for f in tmp.iterdir():  # data on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # an incomplete leftover of the same name (never a complete one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _prune(root, keep)  # only now: the new checkpoint is complete and visible
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported on this platform
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def _complete(path: Path) -> bool:
    """Every file present, and as large as the manifest says (checkpoints written before
    manifests existed are accepted on presence alone)."""
    if not all((path / f).is_file() for f in _FILES):
        return False
    manifest = path / MANIFEST
    if not manifest.is_file():
        return True
    try:
        sizes = json.loads(manifest.read_text())["sizes"]
        return all((path / f).stat().st_size == int(n) for f, n in sizes.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and _complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def damaged(run_dir: Path) -> list[Path]:
    """``step_N`` folders that are not complete, and ``step_N.bad`` ones set aside by a resume."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    bad = re.compile(r"^step_\d+(\.bad)?$")
    return sorted(p for p in root.iterdir() if p.is_dir() and bad.match(p.name) and not (_NAME.match(p.name) and _complete(p)))


def latest(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def load(path: Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG; return the JSON loop state."""
    from safetensors.torch import load_model

    load_model(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    state = json.loads((path / "state.json").read_text())  # parse first: cheap, and fails before any change
    # weights_only: tensors and plain containers only; a tampered file cannot run code
    opt = torch.load(path / "optimizer.pt", map_location=next(model.parameters()).device, weights_only=True)
    rng = torch.load(path / "rng.pt", weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    set_rng_state(rng)
    return state


def _prune(root: Path, keep: int) -> None:
    """Sweep crashed ``.tmp-*`` writes; keep the newest ``keep`` complete checkpoints."""
    for p in root.iterdir():
        if p.name.startswith(".tmp-"):
            shutil.rmtree(p, ignore_errors=True)
    ckpts = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and _complete(p))
    for _, p in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


class RunLock:
    """Holds ``<run>/.opd-train.lock`` for one process; re-entrant within it."""

    _held: dict[str, list] = {}  # path -> [file handle, depth]

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK

    def __enter__(self) -> "RunLock":
        from opd_exp.errors import ConfigError

        key = str(self.path.resolve())
        if key in self._held:
            self._held[key][1] += 1
            return self
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock (the rename-based checkpoints stay atomic)
            self._held[key] = [None, 1]
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            owner = fh.read().strip() or "unknown"
            fh.close()
            raise ConfigError(
                f"hydra.run.dir: {self.path.parent} is in use by another opd-train process (pid {owner}); "
                f"allowed: wait for it to end, or a different hydra.run.dir"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._held[key] = [fh, 1]
        return self

    def __exit__(self, *exc) -> None:
        key = str(self.path.resolve())
        entry = self._held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._held[key]
            if entry[0] is not None:
                entry[0].close()  # closing drops the flock
