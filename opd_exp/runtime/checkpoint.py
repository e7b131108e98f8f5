"""Checkpoints in the run folder: safetensors weights, optimizer + scheduler, JSON loop
state and RNG, written atomically (a temp folder renamed into place).

Layout: ``<run>/checkpoints/step_000050/{model.safetensors, optimizer.pt, state.json,
rng.pt, manifest.json}``, and ``teacher.safetensors`` where the teacher scorer keeps state (a
teacher made from the student: its weights). Only folders named ``step_<n>`` count; a crash mid-write leaves a
``.tmp-*`` folder that is ignored and swept away, so resume always finds a complete
checkpoint. ``manifest.json`` (written last) records each file's size and SHA-256: a file
truncated afterwards makes the checkpoint incomplete (never listed), and a file whose bytes
changed fails its checksum when loaded, so ``restore`` sets it aside and takes the older one.
Older checkpoints are pruned only after the new one has been renamed into place.

Nothing here unpickles code: weights are safetensors, the optimizer and RNG files are read
with ``torch.load(weights_only=True)``.

``RunLock``: one training process per run folder (a ``filelock`` lock the kernel drops when
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
from typing import Any, ClassVar

import torch

from opd_exp.runtime import files
from opd_exp.runtime.errors import ConfigError, first_line

_NAME = re.compile(r"^step_(\d+)$")
_FILES = ("model.safetensors", "optimizer.pt", "state.json", "rng.pt")
TEACHER_FILE = "teacher.safetensors"  # only where the teacher scorer has state
TEACHER_STATE = "teacher_state"  # the loop-state key ``load`` returns it under
PRODUCER_FILE = "producer.safetensors"  # only with rollout.staleness > 0: the rollouts in flight
PRODUCER_STATE = "producer_state"
MANIFEST = "manifest.json"
LOCK = ".opd-train.lock"
OWNER = ".opd-train.pid"


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


def save(
    run_dir: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    loop_state: dict[str, Any],
    keep: int = 2,
    teacher_state: dict | None = None,
    producer_state: dict | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep``; ``teacher_state``:
    the teacher scorer's tensors (``TeacherScorer.state_dict``), if any; ``producer_state``: the
    rollouts in flight of an asynchronous run (``training/producer.py``), if any."""
    from safetensors.torch import save_file, save_model

    root = checkpoint_root(run_dir)
    final = root / f"step_{step:06d}"
    if _complete(final):
        # Same step, same state (a preemption save right after a periodic one): never remove a
        # complete checkpoint to write its twin; a kill in between would leave none.
        return final
    try:
        with files.atomic_folder(final) as tmp:
            save_model(model, str(tmp / "model.safetensors"))  # handles tied embeddings
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
            torch.save(rng_state(), tmp / "rng.pt")
            if teacher_state:
                save_file({k: v.detach().cpu().contiguous() for k, v in teacher_state.items()}, str(tmp / TEACHER_FILE))
            if producer_state:
                save_file({k: v.detach().cpu().contiguous() for k, v in producer_state.items()}, str(tmp / PRODUCER_FILE))
            (tmp / "state.json").write_text(json.dumps({"step": step, **loop_state}, indent=2) + "\n")
            files.write_manifest(tmp, MANIFEST, {"step": step})
    except (OSError, RuntimeError) as ex:
        # torch.save reports a full disk as RuntimeError ("PytorchStreamWriter failed writing
        # file ...: file write failed"); anything else is a bug and keeps its traceback.
        if isinstance(ex, RuntimeError) and not _is_write_failure(ex):
            raise
        newest = latest(run_dir)
        raise ConfigError(
            f"hydra.run.dir: cannot write checkpoint {final.name} in {root} ({first_line(ex, 160)}); nothing half-written is "
            f"kept, newest checkpoint: {newest.name if newest else 'none'}; allowed: free disk space (or a writable folder), "
            f"then run the same command again to resume"
        ) from None
    _prune(root, keep)  # only now: the new checkpoint is complete and visible
    return final


def _is_write_failure(ex: BaseException) -> bool:
    text = str(ex)
    return any(s in text for s in ("PytorchStreamWriter", "file write failed", "No space left", "unexpected pos"))


def _manifest(path: Path) -> dict | None:
    try:
        m = json.loads((path / MANIFEST).read_text())
        return m if isinstance(m, dict) else None
    except (OSError, ValueError):
        return None


def _complete(path: Path) -> bool:
    """Every file present, and as large as the manifest says (cheap: no hashing; checkpoints
    written before manifests existed are accepted on presence alone)."""
    if not all((path / f).is_file() for f in _FILES):
        return False
    if not (path / MANIFEST).is_file():
        return True
    m = _manifest(path)
    if m is None:
        return False
    try:
        sizes = {rel: meta["size"] for rel, meta in m["files"].items()} if "files" in m else m["sizes"]
        return all((path / f).stat().st_size == int(n) for f, n in sizes.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def verify(path: Path) -> str | None:
    """None when every file matches its SHA-256 in the manifest (older manifests carry sizes
    only, which ``_complete`` checked), else the reason."""
    m = _manifest(path)
    if m is None or "files" not in m:
        return None if _complete(path) else "incomplete"
    return files.check_manifest(path, MANIFEST, required=_FILES)


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


class OtherModel(ValueError):
    """Intact checkpoint bytes that do not fit this model (another pair's student)."""


def _mismatch(ex: BaseException) -> str:
    """``Error(s) in loading state_dict ...`` -> how many tensors differ, and the first one."""
    lines = [ln.strip() for ln in str(ex).splitlines() if ln.strip()]
    details = lines[1:] or lines or [type(ex).__name__]
    return f"{details[0][:200]}" + (f" (and {len(details) - 1} more)" if len(details) > 1 else "")


def load(path: Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG; return the JSON loop state. Bytes that
    fail their checksum raise ValueError; intact bytes of another model raise ``OtherModel``."""
    from safetensors.torch import load_model

    problem = verify(path)
    if problem is not None:
        raise ValueError(problem)
    try:
        load_model(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    except RuntimeError as ex:  # missing, unexpected or differently shaped tensors
        raise OtherModel(_mismatch(ex)) from None
    state = json.loads((path / "state.json").read_text())  # parse first: cheap, and fails before any change
    # weights_only: tensors and plain containers only; a tampered file cannot run code
    opt = _load_plain(path / "optimizer.pt", map_location=next(model.parameters()).device)
    rng = _load_plain(path / "rng.pt")
    try:
        optimizer.load_state_dict(opt["optimizer"])
    except ValueError as ex:  # parameter groups of another size
        raise OtherModel(_mismatch(ex)) from None
    scheduler.load_state_dict(opt["scheduler"])
    set_rng_state(rng)
    if (path / TEACHER_FILE).is_file():
        from safetensors.torch import load_file

        state[TEACHER_STATE] = load_file(str(path / TEACHER_FILE))
    if (path / PRODUCER_FILE).is_file():
        from safetensors.torch import load_file

        state[PRODUCER_STATE] = load_file(str(path / PRODUCER_FILE))
    return state


def _load_plain(path: Path, **kw) -> Any:
    """``torch.load(weights_only=True)``; a file holding anything else is refused unread, and said
    so in our words (torch's own message suggests weights_only=False, which would run it)."""
    import pickle

    try:
        return torch.load(path, weights_only=True, **kw)
    except pickle.UnpicklingError:
        raise ValueError(f"{path.name} holds objects other than tensors and plain containers (refused without running them)") from None


def _prune(root: Path, keep: int) -> None:
    """Sweep crashed ``.tmp-*`` writes; keep the newest ``keep`` complete checkpoints."""
    files.sweep_tmp(root)
    ckpts = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and _complete(p))
    for _, p in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


class RunLock:
    """Holds ``<run>/.opd-train.lock`` for one process; re-entrant within it. The owner's pid
    is kept beside it (``.opd-train.pid``) for the message a second process gets."""

    _held: ClassVar[dict[str, list]] = {}  # path -> [lock context, depth]

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.owner = Path(run_dir) / OWNER

    def __enter__(self) -> RunLock:
        key = str(self.path.resolve())
        if key in self._held:
            self._held[key][1] += 1
            return self
        ctx = files.file_lock(self.path, blocking=False)
        if not ctx.__enter__():
            ctx.__exit__(None, None, None)
            try:
                owner = self.owner.read_text().strip() or "unknown"
            except OSError:
                owner = "unknown"
            raise ConfigError(
                f"hydra.run.dir: {self.path.parent} is in use by another opd-train process (pid {owner}); "
                f"allowed: wait for it to end, or a different hydra.run.dir"
            )
        with contextlib.suppress(OSError):
            self.owner.write_text(f"{os.getpid()}\n")
        self._held[key] = [ctx, 1]
        return self

    def __exit__(self, *exc) -> None:
        key = str(self.path.resolve())
        entry = self._held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._held[key]
            entry[0].__exit__(None, None, None)


def _stored_pair(path: Path) -> str:
    try:
        stored = json.loads((path / "state.json").read_text()).get("config") or {}
        name = stored.get("model_pair.name")
    except (OSError, ValueError, AttributeError):
        return ""
    return f" (model_pair={name})" if isinstance(name, str) and name else ""


def restore(run_dir: Path, model, optimizer, scheduler, warn=print) -> tuple[int, dict[str, Any]] | None:
    """Load the newest checkpoint that loads; return (step, loop state), or None when the
    folder holds none. One whose bytes are damaged is renamed ``step_N.bad`` with a warning and
    the next older one is tried; if none loads, a ``ConfigError`` says so (never a silent fresh
    start on top of a run's folder). Intact bytes of another model (``checkpoint.extend`` with
    another pair) are refused at once with nothing renamed: the run's own command still resumes."""
    root = checkpoint_root(run_dir)
    files.sweep_tmp(root)  # leftovers of a write that failed (a full disk) or was killed: the caller holds the lock
    found = list_checkpoints(run_dir)
    if not found:
        bad = damaged(run_dir)
        if bad:  # our writes are atomic: these were complete once; never start over on top
            raise ConfigError(
                f"hydra.run.dir: no checkpoint in {root} can be loaded ({', '.join(p.name for p in bad)}: incomplete "
                f"or damaged); allowed: move checkpoints/ away to start the run over"
            )
        return None
    first_error = None
    for _, path in reversed(found):
        try:
            state = load(path, model, optimizer, scheduler)
        except OtherModel as ex:
            raise ConfigError(
                f"hydra.run.dir: checkpoint {path} holds another model than this run's student ({ex}); nothing was "
                f"set aside; allowed: the model pair it was trained with{_stored_pair(path)}, or a new hydra.run.dir"
            ) from None
        except Exception as ex:
            reason = first_line(ex, 200)
            first_error = first_error or f"{path}: {reason}"
            warn(f"opd-train: warning: checkpoint {path} cannot be loaded ({reason}); set aside as {path.name}.bad, trying an older one")
            if path.is_dir():
                path.rename(path.with_name(path.name + ".bad"))
            continue
        return int(state.pop("step")), state
    raise ConfigError(
        f"hydra.run.dir: no checkpoint in {root} can be loaded (newest: {first_error}); "
        f"allowed: checkpoints of this model, or move checkpoints/ away to start the run over"
    )
