"""benchmarks/staleness_step.py measures asynchronous runs: every row must be at the staleness it was
asked for (a run that silently fell back to the loop would be the synchronous step under another
name), and its table has one row per staleness with finite times."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "staleness_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("staleness_step", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_row_not_at_its_staleness_stops_the_benchmark(bench):
    rows = [{"async/staleness": 0.0}, {"async/staleness": 1.0}, {"async/staleness": 1.0}]
    bench.check_staleness(rows, 1)
    with pytest.raises(SystemExit, match=r"the staleness=2 run logged async/staleness \[0, 1, 1\], not \[0, 1, 2\]"):
        bench.check_staleness(rows, 2)
    with pytest.raises(SystemExit, match="not what this benchmark measures"):
        bench.check_staleness([{}, {}], 1)  # the loop (no async/* at all)


@pytest.mark.slow
def test_the_table_has_a_row_per_staleness(bench, tmp_path, capsys, monkeypatch):
    import json

    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "summary.json"
    args = ["--repeats", "1", "--steps", "3", "--warmup", "1", "--staleness", "0", "1", "--sync-threads", "2", "--json", str(out)]
    assert bench.main([*args, "trainer.batch_size=8", "rollout.max_new_tokens=8"]) == 0
    table = json.loads(out.read_text())["table"]
    assert sorted(table) == ["0@1", "0@2", "1@1"]  # staleness @ torch threads
    for row in table.values():
        assert math.isfinite(row["wall_step_s"]) and row["wall_step_s"] > 0 and row["cpu_step_s"] > 0
    assert table["0@1"]["learner_wait_s"] == table["0@2"]["learner_wait_s"] == 0.0  # the loop waits for nothing
    text = capsys.readouterr().out
    assert "| 0 | 1 |" in text and "| 0 | 2 |" in text and "| 1 | 1 |" in text and "overlap floor" in text
