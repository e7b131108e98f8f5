"""Loading the user's extensions (divergences, tasks) before a config is composed.

``opd-train`` imports, once per process and before Hydra composes the config:

* every module named in the ``OPD_PLUGINS`` environment variable (comma-separated; a module
  name such as ``my_lab.jeffreys``, or the path of a ``.py`` file), and
* every entry point of the ``opd_exp.plugins`` group of the installed packages.

Importing the module runs its ``register_divergence`` / ``register_task`` calls, so
``divergence.name=jeffreys`` or ``task.name=my_jsonl`` are valid choices from then on.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from opd_exp.runtime.errors import ConfigError, first_line

ENV = "OPD_PLUGINS"
GROUP = "opd_exp.plugins"
_LOADED: set[str] = set()


def _import(spec: str) -> None:
    if spec.endswith(".py"):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{ENV}: {spec!r} is not a file; allowed: a module name or the path of a .py file")
        name = f"opd_plugin_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    else:
        importlib.import_module(spec)


def load_plugins() -> list[str]:
    """Import the plugins named by ``OPD_PLUGINS`` and the ``opd_exp.plugins`` entry points
    (each once); returns what was newly loaded. A plugin that fails to import is one line."""
    specs = [s.strip() for s in os.environ.get(ENV, "").split(",") if s.strip()]
    loaded = []
    for spec in specs:
        if spec in _LOADED:
            continue
        _LOADED.add(spec)
        try:
            _import(spec)
        except ConfigError:
            raise
        except Exception as ex:
            raise ConfigError(
                f"{ENV}: cannot import {spec!r}: {type(ex).__name__}: {first_line(ex)}; allowed: an importable module or .py file"
            ) from None
        loaded.append(spec)
    for ep in entry_points(group=GROUP):
        key = f"entry point {ep.name}"
        if key in _LOADED:
            continue
        _LOADED.add(key)
        try:
            ep.load()
        except Exception as ex:
            raise ConfigError(f"{GROUP} {ep.name!r} ({ep.value}): cannot import: {type(ex).__name__}: {first_line(ex)}") from None
        loaded.append(key)
    return loaded
