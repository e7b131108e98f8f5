"""The pinned short runs (default; sampled + ppo + jsd with sequence credit; on_policy_fraction
0.5), run in float64, give the same per-step losses and eval metrics as when they were
recorded, to 1e-9 relative (tolerance and its measurement: helpers/golden.py). Re-record with
``PYTHONPATH=tests python -m helpers.golden --record`` (docs/contributing.md)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers import golden

PINNED = json.loads(golden.GOLDEN_FILE.read_text())


@pytest.fixture(scope="module")
def pair_root(tmp_path_factory):
    return golden.build_pair(tmp_path_factory.mktemp("golden_pair"))


@pytest.mark.parametrize("name", sorted(golden.GOLDEN_RUNS))
def test_golden_run_is_unchanged(name, pair_root, tmp_path):
    trainer = golden.run(name, tmp_path, pair_root)
    assert {p.dtype for p in trainer.student.parameters()} == {torch.float64}  # pins are float64 values
    assert {p.dtype for p in trainer.teacher.parameters()} == {torch.float64}
    assert torch.get_default_dtype() == torch.float32  # restored after the run
    assert golden.mismatches(golden.read_record(tmp_path), PINNED[name]) == []


def test_the_pins_can_fail():
    """Every pinned value moves between steps and is away from 0; the runs' losses differ."""
    assert sorted(PINNED) == sorted(golden.GOLDEN_RUNS)
    assert golden.degenerate(PINNED) == []
    for name, record in PINNED.items():
        assert sorted(record) == sorted(golden.STEP_KEYS + golden.EVAL_KEYS), name
        assert [s for s, _ in record["loss"]] == [1, 2, 3, 4]
        assert [s for s, _ in record["eval/jsd"]] == [0, 2, 4]


@pytest.mark.parametrize("name", sorted(golden.GOLDEN_RUNS))
def test_a_one_in_a_million_change_of_any_pinned_value_fails(name):
    want = PINNED[name]
    for key, rows in want.items():
        for i in range(len(rows)):
            got = copy.deepcopy(want)
            got[key][i][1] *= 1 + 1e-6
            assert len(golden.mismatches(got, want)) == 1, (key, rows[i][0])
    assert golden.mismatches(want, want) == []


def test_a_one_in_a_million_change_of_beta_moves_the_pins(pair_root, tmp_path):
    """End to end: the jsd run with beta 1e-6 relative off its pinned 0.5 no longer matches."""
    name = "sampled_ppo_jsd_sequence"
    golden.run(name, tmp_path, pair_root, divergence={"beta": 0.5 * (1 + 1e-6)})
    moved = golden.mismatches(golden.read_record(tmp_path), PINNED[name])
    assert any(m.startswith("loss at step 1:") for m in moved), moved
