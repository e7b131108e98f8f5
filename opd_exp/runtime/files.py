"""Folders that are complete or absent: atomic writes, SHA-256 manifests, locks.

Checkpoints and cache entries share one recipe: fill a ``.tmp-*`` folder next to the final
name, write a manifest of every file's size and SHA-256 last, fsync, rename into place in one
step. A folder with the final name is therefore complete, or was damaged afterwards, which
``check_manifest`` finds. Locks are ``filelock`` locks, which the kernel drops when the process
dies (even by SIGKILL).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"
CACHE_MANIFEST = "opd-exp-manifest.json"  # a prepared cache entry's manifest (pairs.embedded.cache)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, name: str, extra: Mapping[str, Any] | None = None) -> dict:
    """Record every file under ``folder`` (size and SHA-256) in ``folder/name``, written last."""
    files = {}
    for f in sorted(Path(folder).rglob("*")):
        if f.is_file() and f.name != name and not f.name.endswith(".tmp"):
            files[f.relative_to(folder).as_posix()] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    manifest = {**dict(extra or {}), "files": files}
    tmp = Path(folder) / (name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, Path(folder) / name)
    return manifest


def check_manifest(folder: Path, name: str, required: tuple[str, ...] = ()) -> str | None:
    """None when every file the manifest lists is present with its size and SHA-256 (and every
    ``required`` file is listed), else the first reason it is not."""
    folder = Path(folder)
    if not folder.is_dir():
        return "missing"
    try:
        files = json.loads((folder / name).read_text())["files"]
        if not isinstance(files, dict) or not files:
            return f"{name} lists no files"
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {name} (partial build?)"
    for rel in required:
        if rel not in files:
            return f"{name} does not list {rel}"
    for rel, meta in files.items():
        f = folder / rel
        if not f.is_file():
            return f"file {rel} is missing"
        if f.stat().st_size != int(meta["size"]) or ("sha256" in meta and sha256_file(f) != meta["sha256"]):
            return f"file {rel} does not match its checksum"
    return None


def fsync_tree(folder: Path) -> None:
    """Data on disk before a rename makes the folder visible."""
    for f in Path(folder).rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(folder)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported on this platform
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield a fresh ``.tmp-*`` folder beside ``final``; on success it replaces ``final`` in one
    rename, on any error (or interrupt) it is removed, so no half-written folder stays behind."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=final.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists():
            discard(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sweep_tmp(root: Path) -> list[Path]:
    """Remove ``.tmp-*`` leftovers of writes killed midway (their owners are gone: callers hold
    the folder's lock); returns what was removed."""
    root = Path(root)
    gone = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                gone.append(p)
    return gone


def discard(path: Path) -> None:
    """Move a folder out of the way first (one rename), then delete it."""
    path = Path(path)
    if not path.exists():
        return
    trash = path.with_name(f"{TMP_PREFIX}trash-{path.name}-{os.getpid()}-{time.time_ns()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Hold the lock file ``path``; with ``blocking=False`` yield False at once if another
    process holds it (the caller decides what to say)."""
    from filelock import FileLock, Timeout

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path), timeout=-1 if blocking else 0)
    try:
        lock.acquire()
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()
