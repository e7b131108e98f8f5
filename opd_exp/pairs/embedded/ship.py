"""Refresh the prepared worlds the package ships: ``python -m opd_exp.pairs.embedded.ship CACHE``.

Copies every complete embedded entry of the cache folder ``CACHE`` (built there by ``opd-prepare``
with ``OPD_EXP_CACHE=CACHE``: default, ``model_pair=embedded_multimodal task=multimodal``,
``model_pair=embedded_chain task=chain``) into ``shipped/`` and lists each with its manifest's
SHA-256 in ``shipped/shipped.json``, with the machine that built them. Entries the cache does not
hold are kept. Maintainers run this when a recipe changes (docs/contributing.md).
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
import time
from pathlib import Path

from opd_exp.pairs.embedded import cache
from opd_exp.runtime import files


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass  # no /proc (not Linux): the platform's own name below
    return platform.processor() or platform.machine()


def ship(source: Path, target: Path = cache.SHIPPED_ROOT) -> dict:
    import torch

    target.mkdir(parents=True, exist_ok=True)
    index_file = target / cache.SHIPPED_INDEX
    index = json.loads(index_file.read_text()) if index_file.is_file() else {"entries": {}}
    for entry in sorted(Path(source).glob("embedded-*")):
        if entry.name.startswith(files.TMP_PREFIX) or cache.check_entry(entry) is not None:
            continue
        shutil.rmtree(target / entry.name, ignore_errors=True)
        shutil.copytree(entry, target / entry.name)
        index["entries"][entry.name] = files.sha256_file(target / entry.name / cache.MANIFEST)
        info = cache.read_manifest(entry).get("info", {})
        print(f"shipped {entry.name}: {', '.join(f'{k}={info[k]}' for k in ('accuracy', 'format_rate', 'params') if k in info)}")
    index["built_on"] = {"cpu": _cpu(), "torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    index_file.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python -m opd_exp.pairs.embedded.ship CACHE_FOLDER")
    ship(Path(sys.argv[1]))
