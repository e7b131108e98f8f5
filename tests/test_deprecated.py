"""Old config keys (before the eval/checkpoint/scale groups): accepted with one notice each,
rewritten to the new key, and stored fingerprints read under the new names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from opd_exp.cli.compose import compose_config
from opd_exp.config import schema as S
from opd_exp.config.deprecated import RENAMED, upgrade_flat, upgrade_overrides


def test_every_old_key_names_an_existing_new_field():
    fields = S.TrainConfig.__dataclass_fields__
    for old, new in RENAMED.items():
        group, _, key = new.partition(".")
        assert group in fields, new
        if key:  # a key of a group (else: the group's choice itself, e.g. positions)
            assert hasattr(fields[group].default_factory(), key), new
        old_group, old_key = old.split(".", 1)
        assert not hasattr(fields[old_group].default_factory(), old_key), old  # gone from its old group


def test_overrides_are_rewritten_with_one_notice_per_key():
    lines: list[str] = []
    out = upgrade_overrides(
        ["trainer.eval_every=5", "+trainer.device=cpu", "~trainer.save_every", "trainer.lr=1e-3", "trainer.eval_every=7", "seed=1"],
        lines.append,
    )
    assert out == ["eval.every=5", "+scale.device=cpu", "~checkpoint.every", "trainer.lr=1e-3", "eval.every=7", "seed=1"]
    assert lines == [
        "opd-train: trainer.eval_every is deprecated and will be removed in opd-exp 0.2; use eval.every",
        "opd-train: trainer.device is deprecated and will be removed in opd-exp 0.2; use scale.device",
        "opd-train: trainer.save_every is deprecated and will be removed in opd-exp 0.2; use checkpoint.every",
    ]


def test_a_sweep_value_list_keeps_its_values():
    assert upgrade_overrides(["trainer.eval_size=10,20,30"], lambda _: None) == ["eval.size=10,20,30"]


def test_old_and_new_keys_compose_the_same_config():
    old = compose_config("trainer.eval_every=7", "trainer.keep_checkpoints=3", "trainer.precision=bf16", "logger=none")
    new = compose_config("eval.every=7", "checkpoint.keep=3", "scale.precision=bf16", "logger=none")
    assert old == new
    assert (new.eval.every, new.checkpoint.keep, new.scale.precision) == (7, 3, S.Precision.bf16)


def test_scale_overlays():
    gpu = compose_config("scale=gpu", "logger=none").scale
    assert (gpu.device, gpu.precision, gpu.parallel) == ("cuda", S.Precision.bf16, S.Parallel.none)
    ddp = compose_config("scale=ddp", "logger=none").scale
    assert (ddp.device, ddp.parallel) == ("cuda", S.Parallel.ddp)
    assert compose_config("experiment=opd_gsm8k_rkl").scale.device == "cuda"  # the experiment takes scale=gpu


def test_a_new_key_out_of_range_names_the_new_key():
    with pytest.raises(Exception, match=r"eval\.batch_size=0 is not allowed; allowed: integer >= 1"):
        compose_config("trainer.eval_batch_size=0", "logger=none")


def test_stored_fingerprints_are_read_under_the_new_names():
    assert upgrade_flat({"trainer.eval_size": 4, "trainer.lr": 1.0, "loss.positions": "first"}) == {
        "eval.size": 4,
        "trainer.lr": 1.0,
        "positions.name": "first",
    }


def test_the_cli_prints_the_notice_and_runs_with_the_new_key(tmp_path):
    # --cfg job shows the composed config without training: the old key arrives as the new one
    out = subprocess.run(
        [sys.executable, "-m", "opd_exp.cli.train", "trainer.eval_every=9", "logger=none", f"hydra.run.dir={tmp_path}", "--cfg", "job"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "opd-train: trainer.eval_every is deprecated and will be removed in opd-exp 0.2; use eval.every" in out.stderr
    assert "eval:\n  every: 9\n" in out.stdout


def test_an_old_key_beside_its_new_one_with_another_value_is_refused():
    """Before: `trainer.eval_every=5 eval.every=7` kept the last one without a word (issue 36)."""
    from opd_exp.runtime.errors import ConfigError

    with pytest.raises(ConfigError) as ex:
        upgrade_overrides(["loss.positions=first", "positions=first_n"], lambda line: None)
    assert str(ex.value) == (
        "loss.positions=first and positions=first_n: the same setting given twice (loss.positions is the old name of "
        "positions.name), and only one would be kept; allowed: positions=<value> alone"
    )
    with pytest.raises(ConfigError, match=r"^~trainer.save_every and checkpoint.every=3: the same setting given twice"):
        upgrade_overrides(["~trainer.save_every", "checkpoint.every=3"], lambda line: None)
    # the same value twice, or an old key alone: no conflict
    assert upgrade_overrides(["trainer.eval_every=5", "eval.every=5"], lambda line: None) == ["eval.every=5", "eval.every=5"]
    assert upgrade_overrides(["loss.positions=first", "positions=first"], lambda line: None) == ["positions.name=first", "positions=first"]
