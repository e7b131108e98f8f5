"""The new axes take plugins from one file each (docs/examples): an estimator, checked at start by
its expected gradient (a wrong one refused in one line), and a teacher scorer; both train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.tiny import small_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"

WRONG = '''
from opd_exp.training.estimators import Estimate, Estimator, register_estimator
from opd_exp.training.scoring import Feed

@register_estimator
class Ascends(Estimator):
    """REINFORCE with the cost's sign flipped: ascends the divergence."""
    name = "ascends"
    feeds = frozenset({Feed.dense})

    def __call__(self, x):
        adv = x.cfg.loss.kl_coef * x.obj.div.token_cost(x.s.detach(), x.t)
        return Estimate(per_token=-adv * x.s, advantages=adv)
'''


def _train(tmp_path: Path, plugins: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="offline", OPD_PLUGINS=plugins)
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, "-m", "opd_exp.cli.train", "logger=none", "trainer.progress=false", *args, f"hydra.run.dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_check_estimator_passes_ours_and_fails_a_biased_one():
    from opd_exp.training.estimator_check import EstimatorCheckError, check_estimator

    for est, loss in (("sampled", "reinforce"), ("sampled", "ppo"), ("full", "direct"), ("topk", "reinforce"), ("topk_union", "direct")):
        for div in ("rkl", "fkl", "jsd", "tvd"):
            cfg = small_config(estimator={"name": est, "k": 3}, loss={"name": loss}, divergence={"name": div})
            assert check_estimator(cfg) < 1e-12, (est, loss, div)
    with pytest.raises(EstimatorCheckError, match=r"estimator=topk_renorm: its expected gradient under y ~ S differs"):
        check_estimator(small_config(estimator={"name": "topk_renorm", "k": 3}, loss={"name": "direct"}, divergence={"name": "rkl"}))


@pytest.mark.slow
def test_a_plugin_estimator_trains_and_a_wrong_one_is_refused(tmp_path):
    res = _train(tmp_path, str(EXAMPLES / "my_estimator.py"), "estimator.name=rao_baseline", "loss=reinforce", "trainer.max_steps=2")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows[1:])
    wrong = tmp_path / "ascends.py"
    wrong.write_text(WRONG)
    res = _train(tmp_path / "w", str(wrong), "estimator.name=ascends", "loss=reinforce") if (tmp_path / "w").mkdir() is None else None
    assert res.returncode == 2, res.stderr[-3000:]
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("opd-train: error: estimator=ascends (opd_plugin_ascends.Ascends) fails check_estimator: estimator=ascends: ")
    assert "allowed: an estimator whose expected gradient is the divergence's" in line


@pytest.mark.slow
def test_a_plugin_teacher_scorer_trains_from_one_file(tmp_path):
    res = _train(tmp_path, str(EXAMPLES / "my_teacher.py"), "teacher.name=tempered", "trainer.max_steps=1")
    assert res.returncode == 0, res.stderr[-3000:]
    tempered = _rows(tmp_path)[0]
    res = (
        _train(tmp_path / "plain", str(EXAMPLES / "my_teacher.py"), "trainer.max_steps=1") if (tmp_path / "plain").mkdir() is None else None
    )
    plain = json.loads((tmp_path / "plain" / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # same student, a softer teacher: another divergence at step 0
    assert tempered["eval/kl_reverse"] != pytest.approx(plain["eval/kl_reverse"], rel=1e-3)


def test_debug_fdr_runs_one_step(tmp_path, monkeypatch, capsys):
    from helpers.reliability import read_metrics, run_in_process

    code, out, err = run_in_process(["debug=fdr"], tmp_path / "run", monkeypatch, capsys)
    assert code == 0, err[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[0] and "eval/accuracy" in rows[1]
    assert out.strip().splitlines()[-1].startswith("opd-train: student eval accuracy") and "1 steps" in out
    assert not (tmp_path / "run" / "wandb").exists()  # no logger


def test_debug_and_local_are_optional_groups():
    from helpers.compose import compose_config

    cfg = compose_config("debug=fdr")
    assert (cfg.trainer.max_steps, cfg.eval.every, cfg.eval.size, cfg.logger.name.value) == (1, 0, 8, "none")
    assert compose_config().trainer.max_steps != 1  # without it nothing changes (no conf/local/default.yaml in the checkout)


@pytest.mark.slow
def test_a_plugin_rollout_engine_trains_from_one_file_and_samples_the_trained_student(tmp_path):
    """The example engine samples a copy of the student synced before every step: the same draws as
    the lean engine over the live module, so every metric of a 3-step run equals that run's (it fails
    when ``sync`` is left out: from step 2 the copy would sample the step-0 weights)."""
    plugin = str(EXAMPLES / "my_rollout_engine.py")
    runs = {}
    for engine in ("lean_copy", "lean"):
        (tmp_path / engine).mkdir()
        res = _train(tmp_path / engine, plugin, f"rollout.engine={engine}", "trainer.max_steps=3", "eval.every=0")
        assert res.returncode == 0, res.stderr[-3000:]
        runs[engine] = _rows(tmp_path / engine)
    copy_rows, lean_rows = runs["lean_copy"], runs["lean"]
    assert [r["step"] for r in copy_rows] == [r["step"] for r in lean_rows] and len(copy_rows) >= 3
    for a, b in zip(copy_rows, lean_rows):
        for key in ("loss", "kl/reverse", "jsd/mean", "response/length_mean"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
        if "rollout/logprob_gap" in a:
            assert a["rollout/logprob_gap"] < 1e-5
