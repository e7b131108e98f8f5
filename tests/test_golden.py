"""The pinned short runs (default; sampled + ppo + jsd with sequence credit; on_policy_fraction
0.5) give the same per-step losses and eval metrics as when they were recorded, to 1e-6."""

from __future__ import annotations

import json

import pytest

from helpers.golden import GOLDEN_FILE, GOLDEN_RUNS, golden_groups, read_record
from helpers.tiny import AddTask, small_config
from opd_exp.training.trainer import Trainer

PINNED = json.loads(GOLDEN_FILE.read_text())


@pytest.mark.parametrize("name", sorted(GOLDEN_RUNS))
def test_golden_run_is_unchanged(name, tiny_pair, tmp_path):
    Trainer(small_config(**golden_groups(name)), tmp_path, pair=tiny_pair, task=AddTask()).run()
    got, want = read_record(tmp_path), PINNED[name]
    assert sorted(got) == sorted(want)
    for key in want:
        steps = [s for s, _ in want[key]]
        assert [s for s, _ in got[key]] == steps, key
        for (step, a), (_, b) in zip(got[key], want[key]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-6), (key, step, a, b)
