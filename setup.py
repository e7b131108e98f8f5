"""Packaging beyond what pyproject.toml can say: the top-level ``conf/`` and ``sweeps/`` folders travel
inside the installed package as ``opd_exp.conf`` and ``opd_exp.sweeps`` (``opd_exp/config/folders.py``
finds them there), so a wheel or a git-URL install trains like a checkout."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

DATA = ["*.yaml", "*.jsonl", "*.json", "*.safetensors", "*.txt"]
# every folder below a shipped one is a package of its own, so its files are package data
SHIPPED = {
    "opd_exp." + ".".join(folder.parts): str(folder)
    for top in ("conf", "sweeps")
    for folder in [Path(top), *sorted(p for p in Path(top).rglob("*") if p.is_dir())]
    if folder != Path("conf", "local")  # this machine's own settings never travel in a wheel
}
PACKAGES = find_namespace_packages(include=["opd_exp", "opd_exp.*"], exclude=["*.__pycache__"])
PLUGINS = ["hydra_plugins.opd_exp_launchers"]  # Hydra looks for plugins only under hydra_plugins

setup(
    packages=PACKAGES + PLUGINS + list(SHIPPED),
    package_dir=SHIPPED,
    # the prepared worlds: one folder per cache entry (names with '-', so not packages themselves)
    package_data={**dict.fromkeys(PACKAGES + list(SHIPPED), DATA), "opd_exp.pairs.embedded.shipped": ["*.json", "*/*"]},
)
