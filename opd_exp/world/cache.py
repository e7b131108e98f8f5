"""A content-addressed cache of prepared artefacts (tokenizer and model folders).

An entry lives at ``<root>/<kind>-<hash of its key>``. It is built in a temporary folder
next to it, gets a manifest with every file's SHA-256 written last, and is renamed into
place in one step, so a folder with that name is either complete or was damaged afterwards.
Loading re-checks the manifest; an entry that fails (missing marker, missing or changed
file) is moved away and rebuilt, never loaded. A lock file serialises builders, so parallel
sweep jobs build an entry once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

log = logging.getLogger("opd_exp.world")

MANIFEST = "opd-exp-manifest.json"  # written last: its presence marks a complete entry


def cache_root() -> Path:
    """``$OPD_EXP_CACHE``, else ``$XDG_CACHE_HOME/opd-exp``, else ``~/.cache/opd-exp``."""
    if os.environ.get("OPD_EXP_CACHE"):
        return Path(os.environ["OPD_EXP_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "opd-exp"


def key_hash(key: Mapping[str, Any]) -> str:
    """A short stable hash of a JSON-able key (order of dict keys does not matter)."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_path(kind: str, key: Mapping[str, Any], root: Optional[Path] = None) -> Path:
    return (root or cache_root()) / f"{kind}-{key_hash(key)}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def check_entry(path: Path) -> Optional[str]:
    """None when the entry is complete and intact, else the reason it is not."""
    path = Path(path)
    if not path.is_dir():
        return "missing"
    try:
        manifest = read_manifest(path)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST} (partial build?)"
    if not files:
        return "manifest lists no files"
    for rel, meta in files.items():
        f = path / rel
        if not f.is_file():
            return f"file {rel} is missing"
        if f.stat().st_size != meta["size"] or _sha256(f) != meta["sha256"]:
            return f"file {rel} does not match its checksum"
    return None


def _write_manifest(folder: Path, kind: str, key: Mapping[str, Any], info: Mapping[str, Any]) -> None:
    files = {}
    for f in sorted(folder.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            files[f.relative_to(folder).as_posix()] = {"sha256": _sha256(f), "size": f.stat().st_size}
    manifest = {
        "kind": kind,
        "key": key,
        "hash": key_hash(key),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
        "info": dict(info),
    }
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, folder / MANIFEST)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: builders are not serialised, the rename stays atomic
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _discard(path: Path) -> None:
    """Move a bad entry out of the way first (one rename), then delete it."""
    if not path.exists():
        return
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.time_ns()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def get_or_build(
    kind: str,
    key: Mapping[str, Any],
    build: Callable[[Path], Optional[Mapping[str, Any]]],
    root: Optional[Path] = None,
) -> Path:
    """The folder of the entry for ``key``, building it with ``build(tmp_folder)`` when needed.

    ``build`` fills the folder it is given and may return a dict stored in the manifest as
    ``info`` (e.g. measured accuracy).
    """
    root = Path(root) if root is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    final = entry_path(kind, key, root)
    if check_entry(final) is None:
        return final
    with _locked(root / f".{final.name}.lock"):
        reason = check_entry(final)  # another process may have built it meanwhile
        if reason is None:
            return final
        if reason != "missing":
            log.warning("cache entry %s is broken (%s): rebuilding it", final, reason)
            _discard(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        try:
            info = build(tmp) or {}
            _write_manifest(tmp, kind, key, info)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
