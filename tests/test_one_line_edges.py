"""Issue 36, "Elsewhere": edges that ran silently or ended in a traceback, each now one line
(or the documented notice). Each test runs in this process and asserts the exact line."""

from __future__ import annotations

from pathlib import Path

from helpers.reliability import run_cli
from opd_exp.config.folders import SWEEPS_DIR

ALLOWED_SWEEPS = ", ".join(sorted(p.stem for p in (SWEEPS_DIR / "sweep").glob("*.yaml")))


# -- hydra/launcher=dry ------------------------------------------------------------------------
def test_dry_launcher_without_multirun_acts_dry(tmp_path, monkeypatch, capsys):
    """Before: `opd-train hydra/launcher=dry` (no -m) trained for real. After: checked, one line, nothing written."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    code, out, err = run_cli(["hydra/launcher=dry", "logger=none", "trainer.max_steps=1", f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert code == 0, err
    assert out.strip() == "opd-train: dry run (one run, no -m): logger=none trainer.max_steps=1: ok; nothing trained, nothing written"
    assert not run.exists() and sorted(tmp_path.iterdir()) == []


def test_dry_launcher_without_multirun_refuses_a_bad_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["hydra/launcher=dry", "logger=none", "trainer.lr=-1"], monkeypatch, capsys)
    assert code == 2 and not out.strip()
    assert err.strip() == "opd-train: error: trainer.lr=-1.0 is not allowed; allowed: >= 0"
    assert sorted(tmp_path.iterdir()) == []


def test_dry_launcher_refuses_an_unknown_sweep(tmp_path, monkeypatch, capsys):
    """Before: `-m sweep=nonexistent_xyz hydra/launcher=dry` said "job #0 ... ok"; the real launcher's job refuses it."""
    monkeypatch.chdir(tmp_path)
    args = ["-m", "sweep=nonexistent_xyz", "hydra/launcher=dry", "logger=none", f"hydra.sweep.dir={tmp_path / 'sw'}"]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2
    line = f"sweep=nonexistent_xyz: no such option; allowed: {ALLOWED_SWEEPS}"
    assert out.strip() == f"opd-train: dry run: job #0 sweep=nonexistent_xyz logger=none: error: {line}"
    assert err.strip().startswith(f"opd-train: error: 1 of 1 jobs of the multirun failed: #0 (no folder: dry run): {line}")
    assert not Path(tmp_path / "sw").exists()
