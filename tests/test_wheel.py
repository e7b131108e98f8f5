"""The package as a user installs it: a wheel built from this checkout, installed into a fresh
folder (no editable finder, no checkout on the path), runs the three commands from elsewhere.
Its configs, sweeps and the prepared embedded pair all come from inside the installed package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, env, timeout=900):
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(target folder, environment): the wheel's files alone, found through PYTHONPATH."""
    root = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "-w", root / "dist", REPO], cwd=root, env=os.environ)
    (wheel,) = (root / "dist").glob("opd_exp-*.whl")
    target = root / "site"
    _run([*pip, "install", "--no-deps", "--target", target, wheel], cwd=root, env=os.environ)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "OPD_"))}
    env.update(PYTHONPATH=str(target), OPD_EXP_CACHE=str(root / "cache"), WANDB_MODE="offline", OMP_NUM_THREADS="1")
    return target, env, root / "elsewhere"


def test_the_installed_package_is_the_wheel_with_its_files(installed):
    target, env, cwd = installed
    cwd.mkdir(exist_ok=True)
    code = "import opd_exp, opd_exp.config.folders as f; print(opd_exp.__file__); print(f.CONF_DIR); print(f.SWEEPS_DIR)"
    lines = _run([sys.executable, "-c", code], cwd, env).stdout.split()
    assert all(Path(line).is_relative_to(target) for line in lines), lines
    assert (target / "opd_exp" / "conf" / "train.yaml").is_file() and (
        target / "opd_exp" / "sweeps" / "sweep" / "divergence.yaml"
    ).is_file()
    assert list((target / "opd_exp" / "pairs" / "embedded" / "shipped").glob("embedded-teacher-*/model.safetensors"))
    # Hydra's own plugin scan (any Hydra app in the environment, before opd_exp is imported) loads our launchers
    scan = "from hydra.core.plugins import Plugins; print(sorted(c for c in Plugins.instance().class_name_to_class if 'opd_exp' in c))"
    found = _run([sys.executable, "-c", scan], cwd, env).stdout.strip()
    assert "dry_launcher.DryLauncher" in found and "local_launcher.LocalLauncher" in found, found


@pytest.mark.slow
def test_train_dry_sweep_and_compare_from_outside_the_checkout(installed):
    target, env, cwd = installed
    cwd.mkdir(exist_ok=True)
    bin_ = target / "bin"
    run = cwd / "run"
    out = _run(
        [
            bin_ / "opd-train",
            "trainer.max_steps=2",
            "eval.size=16",
            "logger=none",
            "trainer.progress=false",
            f"hydra.run.dir={run}",
        ],
        cwd,
        env,
    )
    # the first run on a fresh cache trains at once: the shipped pair is copied, not built
    assert "building the embedded" not in out.stderr, out.stderr
    assert "opd-train: student eval accuracy" in out.stdout.splitlines()[-1]
    assert sorted(p.name.split("-")[1] for p in (Path(env["OPD_EXP_CACHE"])).glob("embedded-*")) == ["student", "teacher", "tokenizer"]
    assert (run / "metrics.jsonl").is_file() and (run / ".hydra" / "config.yaml").is_file()

    dry = _run([bin_ / "opd-train", "-m", "sweep=divergence", "hydra/launcher=dry", f"hydra.sweep.dir={cwd / 'sweep'}"], cwd, env)
    jobs = [line for line in dry.stdout.splitlines() if line.startswith("opd-train: dry run: job #")]
    assert len(jobs) == 9 and all(line.endswith(": ok") for line in jobs)
    assert not (cwd / "sweep").exists()  # a dry run writes nothing

    table = _run([bin_ / "opd-compare", run], cwd, env).stdout
    assert "eval accuracy before" in table and "eval KL(S‖T) after" in table and "teacher eval accuracy" in table
