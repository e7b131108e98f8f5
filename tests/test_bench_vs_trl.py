"""benchmarks/opd_step_vs_trl.py forces every response to --length tokens on both sides (TRL
through min_new_tokens, opd-exp's lean sampler through its own): the rows then compare the
same amount of work. Once the engine bound ``lean_generate`` at build time, patching the
module afterwards let opd-lean's responses end early (36.5 against TRL's 40 tokens)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "opd_step_vs_trl.py"
BATCH, LENGTH = 16, 24  # at this size the random student ends some responses early when not forced


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("opd_step_vs_trl", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    root = tmp_path_factory.mktemp("pair")
    threads = torch.get_num_threads()
    mod.build_pair(root)
    yield mod, root
    torch.set_num_threads(threads)


def _args(root, impl, steps=2):
    return SimpleNamespace(steps=steps, batch=BATCH, length=LENGTH, lr=3e-3, root=str(root), worker=f"{impl}:rkl")


def _result(mod, root, impl, capsys) -> dict:
    mod._worker(_args(root, impl))
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[-1][7:])


def test_unforced_responses_are_shorter_here(bench):
    """The control: without forcing, the same pair and size give shorter responses, so the
    checks below can see a sampler that is not forced."""
    mod, root = bench
    assert mod.run_opd(root, "rkl", "hf", _args(root, "opd-hf"))["length"] < LENGTH
    tr = mod.build_opd(root, "rkl", "lean", _args(root, "opd-lean"))
    assert min(tr.train_step()["response/length_mean"] for _ in range(2)) < LENGTH


@pytest.mark.parametrize("impl", ["opd-lean", "opd-quiet", "floor"])
def test_opd_lean_rows_are_forced_to_length(bench, impl, capsys):
    mod, root = bench
    out = _result(mod, root, impl, capsys)
    assert out["lengths"] and all(x == LENGTH for x in out["lengths"])
    assert out["length"] == LENGTH


def test_trl_row_is_forced_to_length(bench, capsys):
    pytest.importorskip("trl")
    mod, root = bench
    out = _result(mod, root, "trl", capsys)
    assert out["lengths"] and all(x == LENGTH for x in out["lengths"])


def test_a_short_forced_row_stops_the_benchmark(bench, capsys):
    mod, root = bench
    with pytest.raises(SystemExit) as ex:
        mod.check_forced("opd-lean", [24.0, 23.5], _args(root, "opd-lean"))
    assert str(ex.value) == "opd-lean: responses not forced to --length 24: mean lengths per step [24.0, 23.5]"
    mod.check_forced("opd-hf", [23.5], _args(root, "opd-hf"))  # not forced: any length
