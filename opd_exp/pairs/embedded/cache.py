"""A content-addressed cache of prepared artefacts (tokenizer and model folders).

An entry lives at ``<root>/<kind>-<hash of its key>``. It is built in a temporary folder
next to it, gets a manifest with every file's SHA-256 written last, and is renamed into
place in one step, so a folder with that name is either complete or was damaged afterwards.
Loading re-checks the manifest; an entry that fails (missing marker, missing or changed
file) is moved away and rebuilt, never loaded. A lock file serialises builders, so parallel
sweep jobs build an entry once.

Shipped entries: the package carries the prepared embedded worlds (``shipped/``, one folder per
entry under the same name, listed with their manifests' SHA-256 in ``shipped/shipped.json``). An
entry missing from the cache is copied from there, checked file by file, instead of being built:
a fresh machine trains at once, on the same pair as every other machine. ``shipped=False``
(``opd-prepare --force``) builds from scratch.
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
SHIPPED_ROOT = Path(__file__).resolve().parent / "shipped"
SHIPPED_INDEX = "shipped.json"


def cache_root() -> Path:
    """``$OPD_EXP_CACHE``, else ``$XDG_CACHE_HOME/opd-exp``, else ``~/.cache/opd-exp``."""
    if os.environ.get("OPD_EXP_CACHE"):
        return Path(os.environ["OPD_EXP_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "opd-exp"


def in_cache(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies in the cache (a disk problem there is OPD_EXP_CACHE's to fix)."""
    try:
        return Path(os.fsdecode(path)).resolve().is_relative_to(cache_root().resolve())
    except (TypeError, ValueError, OSError):  # not a path (a file descriptor), or one that cannot be resolved
        return False


def problem_line(path: str | os.PathLike, reason: str) -> str:
    """A disk problem inside the cache as one line naming OPD_EXP_CACHE (not the run folder)."""
    where = "OPD_EXP_CACHE" if os.environ.get("OPD_EXP_CACHE") else "the default cache (OPD_EXP_CACHE unset)"
    return (
        f"the model cache cannot be written ({os.fsdecode(path)}): {reason}; allowed: OPD_EXP_CACHE set to a writable "
        f"folder with free space ({where} is {cache_root()})"
    )


def copy_failure(ex: shutil.Error) -> tuple[str, str]:
    """(the first file ``shutil.copytree`` could not copy, why): its error holds a list of
    (src, dst, why) triples, no strerror."""
    failed = ex.args[0] if ex.args and isinstance(ex.args[0], list) else []
    first = next((f for f in failed if isinstance(f, tuple) and len(f) == 3), None)
    return (str(first[1]), str(first[2])) if first else ("?", str(ex))


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


def shipped_entry(name: str) -> Path | None:
    """The package's copy of entry ``name`` when it ships one that is listed in the index with
    its manifest's SHA-256 and intact file by file; None when it ships none. A listed entry that
    fails its check is an install error, never a silent rebuild."""
    try:
        index = json.loads((SHIPPED_ROOT / SHIPPED_INDEX).read_text())["entries"]
    except (OSError, ValueError, KeyError):
        return None
    if name not in index:
        return None
    folder = SHIPPED_ROOT / name
    reason = check_entry(folder)
    if reason is None and files.sha256_file(folder / MANIFEST) != index[name]:
        reason = f"its {MANIFEST} is not the one {SHIPPED_INDEX} lists"
    if reason is not None:
        from opd_exp.runtime.errors import ConfigError

        raise ConfigError(
            f"model_pair: the shipped entry {folder} is damaged ({reason}); allowed: reinstall opd-exp, "
            "or opd-prepare --force to build the pair from scratch"
        )
    return folder


def get_or_build(
    kind: str,
    key: Mapping[str, Any],
    build: Callable[[Path], Mapping[str, Any] | None],
    root: Path | None = None,
    *,
    shipped: bool = True,
) -> Path:
    """The folder of the entry for ``key``: from the cache, else copied from the package's shipped
    entries (``shipped``), else built with ``build(tmp_folder)``.

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
        source = shipped_entry(final.name) if shipped else None
        if source is not None:  # the package's prepared copy, manifest and all
            try:  # a full disk midway: atomic_folder removes the partial copy
                with files.atomic_folder(final) as tmp:
                    shutil.copytree(source, tmp, dirs_exist_ok=True)
            except shutil.Error as ex:  # copytree collects every file's failure in one list
                from opd_exp.runtime.errors import ConfigError

                failed, why = copy_failure(ex)
                raise ConfigError(problem_line(failed, f"copying the shipped entry {final.name} failed: {why}")) from None
            return final
        with files.atomic_folder(final) as tmp:
            info = build(tmp) or {}
            extra = {"kind": kind, "key": key, "hash": key_hash(key), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "info": dict(info)}
            files.write_manifest(tmp, MANIFEST, extra)
    return final
