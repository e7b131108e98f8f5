"""Checkpoints in the run folder: safetensors weights, optimizer + scheduler, JSON loop
state and RNG, written atomically (a temp folder renamed into place).

Layout: ``<run>/checkpoints/step_000050/{model.safetensors, optimizer.pt, state.json,
rng.pt}``. Only folders named ``step_<n>`` count; a crash mid-write leaves a ``.tmp-*``
folder that is ignored and swept away, so resume always finds a complete checkpoint.
"""

from __future__ import annotations

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
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))  # handles tied embeddings
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **loop_state}, indent=2) + "\n")
    for f in tmp.iterdir():  # data on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, keep)
    return final


def _complete(path: Path) -> bool:
    return all((path / f).is_file() for f in _FILES)


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


def latest(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def load(path: Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG; return the JSON loop state."""
    from safetensors.torch import load_model

    load_model(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    opt = torch.load(path / "optimizer.pt", map_location=next(model.parameters()).device, weights_only=False)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "state.json").read_text())


def _prune(root: Path, keep: int) -> None:
    for p in root.iterdir():
        if p.name.startswith(".tmp-"):
            shutil.rmtree(p, ignore_errors=True)
    ckpts = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))
    for _, p in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
