"""Where the commands' own files are: ``conf/`` (Hydra config groups) and ``sweeps/``.

The repository keeps both at the top level; a wheel carries them inside the package as
``opd_exp/conf`` and ``opd_exp/sweeps`` (``setup.py`` maps the folders in). A built wheel, a git-URL
install, an editable install and a bare checkout all find them here, with no copy to keep in step.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # opd_exp/


def shipped_folder(name: str) -> Path:
    """``opd_exp/<name>`` inside an installed wheel, else ``<checkout>/<name>``."""
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"opd-exp: its {name}/ folder is neither in the package ({_PACKAGE / name}) nor beside it ({_PACKAGE.parent / name}); "
        "allowed: a complete install (pip install opd-exp, or pip install -e . in a checkout)"
    )


CONF_DIR = shipped_folder("conf")
SWEEPS_DIR = shipped_folder("sweeps")
