"""A content-addressed cache of prepared artefacts (tokenizer and model folders).

An entry lives at ``<root>/<kind>-<hash of its key>``. It is built in a temporary folder
next to it, gets a manifest with every file's SHA-256 written last, and is renamed into
place in one step, so a folder with that name is either complete or was damaged afterwards.
Loading re-checks the manifest; an entry that fails (missing marker, missing or changed
file) is moved away and rebuilt, never loaded. A lock file serialises builders, so parallel
sweep jobs build an entry once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from opd_exp.runtime import files

log = logging.getLogger("opd_exp.pairs")

MANIFEST = files.CACHE_MANIFEST  # written last: its presence marks a complete entry


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


def entry_path(kind: str, key: Mapping[str, Any], root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{kind}-{key_hash(key)}"


def cached_keys(kind: str, root: Path | None = None) -> list[tuple[Path, dict]]:
    """(entry, manifest) of the complete entries of ``kind`` in the cache, newest first."""
    root = Path(root) if root is not None else cache_root()
    out = []
    for p in root.glob(f"{kind}-*") if root.is_dir() else ():
        try:
            out.append((p, read_manifest(p)))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda e: str(e[1].get("created", "")), reverse=True)


def read_manifest(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def check_entry(path: Path) -> str | None:
    """None when the entry is complete and intact, else the reason it is not."""
    return files.check_manifest(Path(path), MANIFEST)


def get_or_build(
    kind: str,
    key: Mapping[str, Any],
    build: Callable[[Path], Mapping[str, Any] | None],
    root: Path | None = None,
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
    with files.file_lock(root / f".{final.name}.lock"):
        reason = check_entry(final)  # another process may have built it meanwhile
        if reason is None:
            return final
        # A build killed by SIGKILL leaves its temp folder: we hold this entry's lock, so no
        # live builder owns one (other entries' builds are left alone).
        for leftover in [*root.glob(f"{files.TMP_PREFIX}{final.name}-*"), *root.glob(f"{files.TMP_PREFIX}trash-{final.name}-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        if reason != "missing":
            log.warning("cache entry %s is broken (%s): rebuilding it", final, reason)
            files.discard(final)
        with files.atomic_folder(final) as tmp:
            info = build(tmp) or {}
            extra = {"kind": kind, "key": key, "hash": key_hash(key), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "info": dict(info)}
            files.write_manifest(tmp, MANIFEST, extra)
    return final
