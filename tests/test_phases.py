"""Every run accounts its phases (perf/generate_s, teacher_s, train_s, sync_s, wait_s): nested
phases are counted once, in the innermost one; the phases of a step are disjoint parts of it."""

from __future__ import annotations

import json

import pytest

from helpers.tiny import AddTask, small_config
from opd_exp.training import phases as phases_mod
from opd_exp.training.phases import PHASES, PhaseClock
from opd_exp.training.trainer import Trainer


def test_nested_phases_count_once_in_the_innermost(monkeypatch):
    ticks = iter([0.0, 1.0, 3.0, 7.0, 10.0, 10.5])  # train [0, 7] holding teacher [1, 3]; sync [10, 10.5]
    monkeypatch.setattr(phases_mod.time, "perf_counter", lambda: next(ticks))
    clock = PhaseClock()
    with clock("train"), clock("teacher"):
        pass
    with clock("sync"):
        pass
    out = clock.take(sampled=8, scored=8, trained=6)
    assert (out["perf/train_s"], out["perf/teacher_s"], out["perf/sync_s"], out["perf/generate_s"], out["perf/wait_s"]) == (
        5.0,
        2.0,
        0.5,
        0.0,
        0.0,
    )
    assert out["perf/teacher_tokens_per_s"] == 4.0 and out["perf/train_tokens_per_s"] == 1.2 and out["perf/generate_tokens_per_s"] == 0.0
    assert out["perf/peak_memory_gib"] > 0
    assert clock.take(sampled=1, scored=1, trained=1)["perf/train_s"] == 0.0  # take starts the next step afresh


@pytest.mark.parametrize("teacher", [{"name": "in_process"}, {"name": "ema"}])
def test_every_step_logs_its_phases(teacher, tiny_pair, tmp_path):
    Trainer(small_config(teacher=teacher, trainer={"max_steps": 2}, eval={"every": 1}), tmp_path, pair=tiny_pair, task=AddTask()).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    for r in rows:
        parts = [r[f"perf/{p}_s"] for p in PHASES]
        assert all(x >= 0 for x in parts) and sum(parts) <= r["perf/step_s"]  # disjoint parts of the step
        assert r["perf/generate_s"] > 0 and r["perf/teacher_s"] > 0 and r["perf/train_s"] > 0 and r["perf/wait_s"] == 0.0
        if teacher["name"] == "ema":
            assert r["perf/sync_s"] > 0  # the EMA update is the sync
