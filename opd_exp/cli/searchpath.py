"""Adds the repository's ``sweeps/`` folder to Hydra's config search path.

``sweeps/`` is a second config root next to ``conf/``: ``sweeps/sweep/<name>.yaml`` is the
``sweep`` group (``opd-train -m sweep=divergence``), ``sweeps/variant/`` holds the variants a
sweep picks by name. ``opd_exp.cli.train`` registers the plugin when imported, so ``opd-train``,
``python -m opd_exp.cli.train`` and ``hydra.compose`` after ``import opd_exp.cli.train`` all see it.
"""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.plugins import Plugins
from hydra.plugins.search_path_plugin import SearchPathPlugin

from opd_exp.config.folders import SWEEPS_DIR


class OpdSweepsSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="opd-exp-sweeps", path=f"file://{SWEEPS_DIR}")


def register() -> None:
    """Idempotent: Hydra keeps one entry per plugin class. The dry and local launchers are
    registered here too: Hydra's own scan of ``hydra_plugins`` does not see an editable install's packages."""
    from hydra_plugins.opd_exp_launchers.dry_launcher import DryLauncher
    from hydra_plugins.opd_exp_launchers.local_launcher import LocalLauncher

    Plugins.instance().register(OpdSweepsSearchPath)
    Plugins.instance().register(DryLauncher)
    Plugins.instance().register(LocalLauncher)
