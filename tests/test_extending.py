"""Extending by registration: the worked example of docs/extending.md (Jeffreys + a jsonl task)
runs as written, check_divergence catches a wrong estimator, the registries refuse bad entries,
and a registered divergence and task train through opd-train from one plugin file."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.reliability import BASE, pair_args, read_metrics, run_subprocess
from opd_exp.divergences import DivergenceCheckError, ReverseKL, check_divergence

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "my_extensions.py"
DOC = ROOT / "docs" / "extending.md"


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """Run in a fresh interpreter: registrations are process-wide, other tests must not see them."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=dict(os.environ, **env), cwd=ROOT)


def test_the_doc_shows_the_example_file_as_it_is():
    """docs/extending.md quotes docs/examples/my_extensions.py in full (the code a user copies is the code tested)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert EXAMPLE.read_text() in blocks


def test_worked_example_passes_check_divergence_and_builds_its_task(tmp_path):
    rows = [{"question": f"capital of country {i}?", "answer": f"City {i}"} for i in range(10)]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = f"""
import runpy, torch
mod = runpy.run_path({str(EXAMPLE)!r}, run_name="__main__")
from opd_exp.divergences import DIVERGENCES, get_divergence
from opd_exp.tasks import build_task
from opd_exp.config.schema import DivergenceName
assert "jeffreys" in DIVERGENCES and DivergenceName("jeffreys").value == "jeffreys"
# Jeffreys = KL(S||T) + KL(T||S), on random logits
zs, zt = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
j = get_divergence("jeffreys").full(zs, zt)
k = get_divergence("rkl").full(zs, zt) + get_divergence("fkl").full(zs, zt)
assert torch.allclose(j, k, rtol=1e-12, atol=0), (j, k)
task = build_task({{"name": "qa_jsonl", "path": {str(data)!r}, "n_eval": 2}})
assert len(task.eval_problems()) == 2 and len(task.train_problems()) == 8
p = task.eval_problems()[0]
assert task.verify("  " + p.answer.upper() + " \\nmore", p.answer) and not task.verify("nope", p.answer)
print("EXAMPLE-OK")
"""
    res = _python(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "EXAMPLE-OK" in res.stdout and "FAIL" not in res.stdout
    assert res.stdout.count(" ok   ") == 10  # every check of the report, including the reference


class _WrongScore(ReverseKL):
    """rkl with the score of a 'JSD built from s and t': a wrong REINFORCE cost."""

    name = "wrong_score"

    def token_score(self, s, t):
        return t - s  # ascends KL(S||T)


class _BiasedValue(ReverseKL):
    name = "biased_value"

    def token_value(self, s, t):
        return (s - t).abs()


def test_check_divergence_catches_a_wrong_gradient_and_a_biased_value():
    with pytest.raises(DivergenceCheckError) as ex:
        check_divergence(_WrongScore())
    msg = str(ex.value)
    assert "\n" not in msg and msg.startswith("check_divergence(_WrongScore()): 'E_y[token_cost * grad log S] = grad D' fails")
    with pytest.raises(DivergenceCheckError, match=r"'E_y\[token_value\] = D \(unbiased\)' fails"):
        check_divergence(_BiasedValue())
    report = check_divergence(_BiasedValue(), raise_on_failure=False)
    assert not report.ok and "FAIL" in str(report)
    bad = {r.check for r in report.results if not r.ok}
    assert bad == {"E_y[token_value] = D (unbiased)"}


def test_a_wrong_reference_is_caught():
    with pytest.raises(DivergenceCheckError, match=r"'full = reference\(S, T\)' fails"):
        check_divergence(ReverseKL(), reference=lambda S, T: (T * (T / S).log()).sum(-1))


def test_registries_refuse_bad_entries_in_one_line():
    code = """
from opd_exp.divergences import ReverseKL, register_divergence
from opd_exp.tasks import register_task
import opd_exp.config.schema  # the schema listens: a parameter it has no key for is refused
def fails(f):
    try:
        f()
    except (ValueError, TypeError) as ex:
        print(ex)
    else:
        print("accepted")
class Dup(ReverseKL):
    name = "rkl"
class Gamma(ReverseKL):
    name = "gamma_kl"
    param_names = ("gamma",)
class Caps(ReverseKL):
    name = "Bad Name"
fails(lambda: register_divergence(Dup))
fails(lambda: register_divergence(Gamma))
fails(lambda: register_divergence(Caps))
fails(lambda: register_divergence(int))
fails(lambda: register_task("arithmetic", lambda cfg: None))
"""
    res = _python(code)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines == [
        "register_divergence: 'rkl' is already registered (ReverseKL); allowed: a new name, or replace=True",
        "register_divergence: Gamma takes gamma, which the config cannot set; allowed parameter names: beta, alpha, clip (keys of divergence.)",
        "register_divergence: Caps.name='Bad Name'; allowed: a lower-case identifier like 'jeffreys'",
        "register_divergence: <class 'int'> is not a Divergence subclass",
        "register_task: 'arithmetic' is already registered; allowed: a new name, or replace=True",
    ]


@pytest.mark.slow  # a whole opd-train process end to end
def test_unknown_names_list_the_registered_ones(tmp_path):
    env = dict(os.environ, OPD_PLUGINS=str(EXAMPLE))
    env.pop("HYDRA_FULL_ERROR", None)
    # what a fresh process has built in (this test process may hold names other tests registered)
    probe = "from opd_exp.config.world import TASKS; from opd_exp.divergences import DIVERGENCES; print(list(DIVERGENCES)); print(TASKS)"
    lines = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()
    builtin_divergences, builtin_tasks = (ast.literal_eval(line) for line in lines)
    for args, needle in (
        (["divergence=nope"], "divergence=nope: no such option; allowed: " + ", ".join(sorted([*builtin_divergences, "jeffreys"]))),
        (["divergence.name=nope"], f"expected one of [{', '.join([*builtin_divergences, 'jeffreys'])}]"),
        (["task.name=nope"], "task.name='nope' is not allowed; allowed: " + " | ".join([*builtin_tasks, "qa_jsonl"])),
    ):
        res = subprocess.run(
            [sys.executable, "-m", "opd_exp.cli.train", *args, "logger=none", f"hydra.run.dir={tmp_path}/run"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert res.returncode == 2, res.stderr
        assert needle in res.stderr, res.stderr


def test_a_plugin_that_does_not_import_is_one_line(tmp_path):
    env = dict(os.environ, OPD_PLUGINS="no_such_module_xyz")
    res = subprocess.run(
        [sys.executable, "-m", "opd_exp.cli.train", "logger=none", f"hydra.run.dir={tmp_path}/run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "opd-train: error: OPD_PLUGINS: cannot import 'no_such_module_xyz': ModuleNotFoundError: No module named 'no_such_module_xyz'; allowed: an importable module or .py file"
    ]


@pytest.mark.slow
def test_a_registered_divergence_and_task_train_through_opd_train(local_pair_dir, tmp_path, monkeypatch):
    rows = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(6) for b in range(6)]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("OPD_PLUGINS", str(EXAMPLE))
    args = [a for a in BASE if not a.startswith("task")] + pair_args(local_pair_dir)
    args += ["divergence=jeffreys", "task.name=qa_jsonl", f"task.path={data}", "task.n_eval=4", "trainer.max_steps=2"]
    res = run_subprocess(args, tmp_path / "run")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["eval/jeffreys"] > 0 and torch.isfinite(torch.tensor(r["eval/jeffreys"]))
        # Jeffreys = KL(S||T) + KL(T||S), on the same greedy eval responses
        assert r["eval/jeffreys"] == pytest.approx(r["eval/kl_reverse"] + r["eval/kl_forward"], rel=1e-5)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval/jeffreys"] == evals[-1]["eval/jeffreys"]
    assert summary["eval/jeffreys_before"] == evals[0]["eval/jeffreys"]
    params = {role: record.pop("params") for role, record in summary["pair"].items()}  # each model's parameter count
    assert params["teacher"] > params["student"] > 0  # 2 layers against 1
    assert summary["pair"] == {"teacher": {"path": str(local_pair_dir / "teacher")}, "student": {"path": str(local_pair_dir / "student")}}


def test_an_extension_to_another_divergence_keeps_its_before_value(tiny_pair, tmp_path):
    """fkl for 2 steps, then extended with divergence=rkl: eval/rkl_before is the run's step-0
    eval/kl_reverse (the same divergence under its fixed name), not missing."""
    import copy

    from helpers.tiny import AddTask, small_config
    from opd_exp.training.trainer import Trainer

    pair2 = copy.deepcopy(tiny_pair)
    Trainer(small_config(trainer={"max_steps": 2, "save_every": 1}), tmp_path, pair=tiny_pair, task=AddTask()).run()
    cfg = small_config(trainer={"max_steps": 3, "save_every": 1, "extend": True}, divergence={"name": "rkl"})
    summary = Trainer(cfg, tmp_path, pair=pair2, task=AddTask()).run()
    assert summary["eval/rkl_before"] == summary["eval/kl_reverse_before"]
    assert summary["eval/rkl"] == summary["eval/kl_reverse"]
