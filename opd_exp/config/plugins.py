"""Loading the user's extensions (divergences, tasks) before a config is composed.

``opd-train`` imports, once per process and before Hydra composes the config:

* every module named in the ``OPD_PLUGINS`` environment variable (a module name such as
  ``my_lab.jeffreys``, or the path of a ``.py`` file; several separated by commas or by
  ``os.pathsep``, ``:`` on Linux and macOS, ``;`` on Windows, as in ``PYTHONPATH``), and
* every entry point of the ``opd_exp.plugins`` group of the installed packages.

Importing the module runs its ``register_divergence`` / ``register_task`` calls, so
``divergence.name=jeffreys`` or ``task.name=my_jsonl`` are valid choices from then on.

A registered divergence that is not one of ours must pass ``check_divergence`` before it
trains (``opd_exp.cli.plugin_check``), and a run folder records the plugins it was made with
(``plugins.json``), so a resume without them says which to load.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

from opd_exp.runtime.errors import ConfigError, first_line

ENV = "OPD_PLUGINS"
GROUP = "opd_exp.plugins"
RECORD = "plugins.json"  # in a run folder: the plugins its sessions loaded
_LOADED: set[str] = set()
_ORDER: list[str] = []  # the specs and entry points imported so far, in order


def plugin_specs(value: str | None = None) -> list[str]:
    """The entries of ``OPD_PLUGINS``: split at commas and at ``os.pathsep``."""
    value = os.environ.get(ENV, "") if value is None else value
    return [s.strip() for s in re.split(f"[,{re.escape(os.pathsep)}]", value) if s.strip()]


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


def _exited(what: str, ex: SystemExit) -> ConfigError:
    # a plugin's sys.exit(0) at import would end opd-train "successfully" with nothing trained
    return ConfigError(
        f"{what}: importing it called sys.exit({ex.code!r}); allowed: a module whose import only defines and registers "
        f"(guard scripts with `if __name__ == '__main__':`)"
    )


def load_plugins() -> list[str]:
    """Import the plugins named by ``OPD_PLUGINS`` and the ``opd_exp.plugins`` entry points
    (each once); returns what was newly loaded. A plugin that fails to import, or exits while
    importing, is one line."""
    loaded = []
    for spec in plugin_specs():
        if spec in _LOADED:
            continue
        _LOADED.add(spec)
        try:
            _import(spec)
        except ConfigError:
            raise
        except SystemExit as ex:
            raise _exited(f"{ENV}: {spec!r}", ex) from None
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
        except SystemExit as ex:
            raise _exited(f"{GROUP} {ep.name!r} ({ep.value})", ex) from None
        except Exception as ex:
            raise ConfigError(f"{GROUP} {ep.name!r} ({ep.value}): cannot import: {type(ex).__name__}: {first_line(ex)}") from None
        loaded.append(key)
    _ORDER.extend(loaded)
    return loaded


# -- which plugins a run folder was made with ---------------------------------------------


def record_plugins(run_dir: Path) -> None:
    """Add the plugins loaded in this process to ``<run_dir>/plugins.json`` (kept across sessions)."""
    if not _ORDER:
        return
    path = Path(run_dir) / RECORD
    recorded = read_plugins(run_dir)
    specs = [s for s in _ORDER if s not in recorded]
    if not specs:
        return
    text = json.dumps({ENV: recorded + specs}, indent=1) + "\n"
    tmp = path.with_name(f".{RECORD}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_plugins(run_dir: Path) -> list[str]:
    try:
        got = json.loads((Path(run_dir) / RECORD).read_text()).get(ENV, [])
    except (OSError, ValueError, AttributeError):
        return []
    return [str(s) for s in got] if isinstance(got, list) else []


def missing_hint(run_dir: Path | str | None) -> str:
    """For an error in a run folder made with plugins this process did not load: what to set."""
    if not run_dir:
        return ""
    missing = [s for s in read_plugins(Path(run_dir)) if s not in _LOADED]
    if not missing:
        return ""
    specs = [s for s in missing if not s.startswith("entry point ")]
    fix = f"{ENV}={','.join(specs)}" if specs else "the package with the entry points " + ", ".join(missing)
    return f" (this run folder was made with plugins not loaded now: {', '.join(missing)}; to resume it, set {fix})"
