"""What opd-train does with the user's plugins at start: a plugin divergence that fails
check_divergence is refused in one line (a pass is cached by its source), a plugin that exits
while importing is an error, OPD_PLUGINS splits at commas and os.pathsep, and a run folder
records its plugins so that a resume without them says which to load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "my_extensions.py"

WRONG = '''
from opd_exp.divergences import ReverseKL, register_divergence

@register_divergence
class WrongScore(ReverseKL):
    """rkl whose REINFORCE score ascends KL(S||T)."""

    name = "wrong_score"

    def token_score(self, s, t):
        return t - s
'''


def _env(tmp_path: Path, plugins: str | None) -> dict:
    env = dict(os.environ, WANDB_MODE="offline", OPD_EXP_CACHE=str(tmp_path / "cache"))
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("OPD_PLUGINS", None)
    if plugins is not None:
        env["OPD_PLUGINS"] = plugins
    return env


def _train(tmp_path: Path, plugins: str | None, *args: str, run: str = "run") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opd_exp.cli.train", "logger=none", *args, f"hydra.run.dir={tmp_path / run}"]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path, plugins), timeout=300, cwd=tmp_path)


def test_a_plugin_divergence_with_a_wrong_cost_is_refused_at_start(tmp_path):
    plugin = tmp_path / "wrong.py"
    plugin.write_text(WRONG)
    res = _train(tmp_path, str(plugin), "divergence=wrong_score", "trainer.max_steps=1")
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [
        "opd-train: error: divergence=wrong_score (opd_plugin_wrong.WrongScore) fails check_divergence: "
        "check_divergence(WrongScore()): 'E_y[token_cost * grad log S] = grad D' fails: error 2 > 1e-06 (peaked-near, seed 2); "
        "allowed: a divergence whose costs and values pass check_divergence (docs/extending.md)"
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # a whole opd-train process end to end
def test_a_passing_plugin_is_checked_once_per_version_of_its_source(tmp_path):
    plugin = tmp_path / "jeff.py"
    plugin.write_text(EXAMPLE.read_text())
    code = f"""
import os
os.environ["OPD_PLUGINS"] = {str(plugin)!r}
from opd_exp.config.plugins import load_plugins
from opd_exp.cli.plugin_check import check_plugin_divergence
import opd_exp.divergences as d
load_plugins()
calls = []
real = d.check_divergence
def counting(div, **kw):
    calls.append(type(div).__name__)
    return real(div, **kw)
d.check_divergence = counting
check_plugin_divergence("jeffreys", {{}})
check_plugin_divergence("jeffreys", {{}})
check_plugin_divergence("rkl", {{}})  # ours: never checked at start
print(calls)
"""
    env = _env(tmp_path, None)
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.strip() == "['Jeffreys']"
    assert len(list((tmp_path / "cache" / "divergence-checks").glob("*.ok"))) == 1
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert again.stdout.strip() == "[]"  # cached by the source's hash
    plugin.write_text(EXAMPLE.read_text() + "\n# edited\n")
    edited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert edited.stdout.strip() == "['Jeffreys']"


def test_a_plugin_that_exits_while_importing_is_an_error(tmp_path):
    plugin = tmp_path / "quits.py"
    plugin.write_text("import sys\nsys.exit(0)\n")
    res = _train(tmp_path, str(plugin), "trainer.max_steps=1")
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines() == [
        f"opd-train: error: OPD_PLUGINS: {str(plugin)!r}: importing it called sys.exit(0); allowed: a module whose import only "
        "defines and registers (guard scripts with `if __name__ == '__main__':`)"
    ]


def test_opd_plugins_splits_at_commas_and_os_pathsep():
    from opd_exp.config.plugins import plugin_specs

    assert plugin_specs(f"a.py, my_lab.x{os.pathsep}b.py,,") == ["a.py", "my_lab.x", "b.py"]


def test_the_run_folder_records_its_plugins_and_a_resume_without_them_says_which(tmp_path):
    plugin = tmp_path / "jeff.py"
    plugin.write_text(EXAMPLE.read_text())
    other = tmp_path / "other.py"
    other.write_text("X = 1\n")
    # a config error after the folder is taken: the record is already there
    made = _train(tmp_path, f"{plugin}{os.pathsep}{other}", "divergence=jeffreys", "trainer.batch_size=0")
    assert made.returncode == 2, made.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "plugins.json").read_text()) == {"OPD_PLUGINS": [str(plugin), str(other)]}
    res = _train(tmp_path, None, "divergence=jeffreys")
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("opd-train: error: divergence=jeffreys: no such option; allowed: ")
    assert line[0].endswith(
        f" (this run folder was made with plugins not loaded now: {plugin}, {other}; to resume it, set OPD_PLUGINS={plugin},{other})"
    )
