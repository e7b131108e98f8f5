"""What a researcher meets at the command line: `--cfg` shows only a config that would run,
`variant=` without `+`, per-pair training defaults, a default run folder two starts cannot
share, and a lab pair refused with the wrong task."""

from __future__ import annotations

import pytest

from helpers.compose import compose_config as _compose
from helpers.reliability import run_cli


@pytest.mark.parametrize(
    "args, line",
    [
        (["--cfg", "job", "divergence.beta=1.5"], "opd-train: error: divergence.beta=1.5 is not allowed; allowed: 0 <= beta <= 1"),
        (["-c", "all", "trainer.batch_size=0"], "opd-train: error: trainer.batch_size=0 is not allowed; allowed: integer >= 1"),
        (["--cfg", "job", "+trainer.nope=1"], "opd-train: error: trainer.nope: unknown key; allowed: "),
    ],
)
def test_cfg_shows_no_invalid_config(args, line, monkeypatch, capsys):
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2, (out, err)
    assert out == ""
    assert err.strip().splitlines()[0].startswith(line) and len(err.strip().splitlines()) == 1


def test_cfg_shows_a_valid_config(monkeypatch, capsys):
    code, out, err = run_cli(["--cfg", "job", "divergence=jsd", "divergence.beta=0.9"], monkeypatch, capsys)
    assert code == 0, err
    assert "beta: 0.9" in out


def test_variant_needs_no_plus_alone_in_a_sweep_and_after_an_experiment():
    cfg = _compose("variant=jsd_0.9")
    assert (cfg.divergence.name.value, cfg.divergence.beta) == ("jsd", 0.9)
    cfg = _compose("sweep=divergence", "variant=skl")
    assert cfg.divergence.name.value == "skl"
    assert _compose("sweep=divergence").divergence.name.value == "rkl"  # the sweep's own default variant
    cfg = _compose("experiment=opd_gsm8k_jsd", "variant=jsd_0.1")  # the variant's beta wins
    assert (cfg.divergence.name.value, cfg.divergence.beta) == ("jsd", 0.1)
    assert _compose().divergence.name.value == "fkl"  # no variant: the defaults


def test_plus_variant_is_one_line_naming_the_fix(monkeypatch, capsys):
    code, _out, err = run_cli(["--cfg", "job", "+variant=jsd_0.5"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "opd-train: error: +variant=jsd_0.5: variant is already in the defaults list (conf/train.yaml); allowed: variant=jsd_0.5 "
        "without '+' on the command line (in a config file's defaults: `override /variant: jsd_0.5`)"
    ]


def test_an_ad_hoc_multirun_names_its_w_and_b_runs_from_the_swept_overrides():
    from pathlib import Path

    from opd_exp.sinks import tracking

    overrides = ["variant=jsd_0.5", "seed=1", "trainer.max_steps=100"]
    job = tracking.JobInfo(
        overrides=overrides, multirun=True, sweep_dir="multirun/2025-01-01/12-00-00", swept=frozenset({"variant", "seed"})
    )
    name = tracking.run_name(None, Path("multirun/2025-01-01/12-00-00/3"), job)
    assert name == "variant=jsd_0.5,seed=1-" + tracking.settings_hash(["trainer.max_steps=100"])
    # a sweep file's readable folder names are kept
    assert tracking.run_name(None, Path("multirun/divergence/embedded/3_jsd_0.5_seed1"), job).startswith("3_jsd_0.5_seed1-")


@pytest.mark.parametrize(
    "pair, batch, lr",
    [("embedded", 64, 3e-3), ("smollm2", 8, 1e-4), ("qwen2.5_1.5b_math7b", 32, 1e-6), ("qwen3", 32, 1e-6)],
)
def test_each_pair_brings_its_own_training_defaults(pair, batch, lr):
    cfg = _compose(f"model_pair={pair}")
    assert (cfg.trainer.batch_size, cfg.trainer.lr) == (batch, lr)
    # the command line and experiment files still win
    assert _compose(f"model_pair={pair}", "trainer.lr=0.5", "trainer.batch_size=3").trainer.lr == 0.5
    assert _compose(f"model_pair={pair}", "model_pair.name=x").model_pair.name == "x"


def test_experiment_files_keep_their_recipes():
    assert _compose("experiment=smollm2_recovery").trainer.batch_size == 8
    cfg = _compose("experiment=opd_gsm8k_jsd")
    assert (cfg.trainer.batch_size, cfg.trainer.micro_batch_size, cfg.trainer.lr, cfg.model_pair.dtype) == (32, 4, 1e-6, "bfloat16")


def test_a_lab_pair_with_another_task_is_refused(monkeypatch, capsys):
    code, _out, err = run_cli(["--cfg", "job", "model_pair=embedded_multimodal", "task=arithmetic"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "opd-train: error: task.name='arithmetic' is not allowed with model_pair=embedded_multimodal (built for task=multimodal, "
        "where task.name='multimodal'); allowed: task=multimodal, or another model_pair"
    ]
    code, _out, err = run_cli(["--cfg", "job", "model_pair=embedded_chain"], monkeypatch, capsys)
    assert code == 2 and "task.min_operands=2 is not allowed with model_pair=embedded_chain (built for task=chain" in err
    # the lab's own pairings, and keys the task option leaves free
    assert _compose("model_pair=embedded_multimodal", "task=multimodal", "task.n_eval=50").task.n_eval == 50
    assert _compose("model_pair=embedded_chain", "task=chain").model_pair.for_task == "chain"
    assert _compose("model_pair=embedded", "task=multimodal").task.name == "multimodal"  # the default pair: any task


def test_the_lab_pairs_task_check_is_not_in_the_fingerprint():
    from opd_exp.runtime.fingerprint import config_fingerprint

    assert not [k for k in config_fingerprint(_compose("model_pair=embedded_chain", "task=chain")) if "for_task" in k]


def test_the_default_run_folder_differs_between_two_starts_in_the_same_second(monkeypatch):
    import os
    import re

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import opd_exp.cli.train as T

    def run_dir() -> str:
        with initialize_config_dir(config_dir=T.CONF_DIR, version_base="1.3"):
            cfg = compose("train", overrides=["logger=none"], return_hydra_config=True)
            OmegaConf.clear_cache(cfg)  # resolvers cache per config: a fresh resolution
            return str(cfg.hydra.run.dir)

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    got = run_dir()
    assert re.fullmatch(rf"outputs/\d{{4}}-\d\d-\d\d/\d\d-\d\d-\d\d_{os.getpid()}", got), got
    # a second process started in the same second has another id; torchrun's ranks share their agent's
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_dir().endswith(f"_{os.getppid()}")
