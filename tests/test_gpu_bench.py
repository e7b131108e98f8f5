"""benchmarks/gpu_opd_step.py smoke test on CPU (--tiny): both layouts, both estimators, one
JSON row each with finite losses, full-length responses and the reported fields."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_opd_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_opd_step", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_opd_step"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_real_layout_shapes_are_the_qwen_pair():
    mod = _load()
    s, t = mod.REAL["student"], mod.REAL["teacher"]

    # parameter counts of the shapes: ~1.5B student, ~7.6B teacher (Qwen2.5 config.json values)
    def params(c):
        h, i, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
        layer = h * h * 2 + 2 * h * kv + 3 * h * i
        return L * layer + V * h * (1 if c["tie_word_embeddings"] else 2)

    assert 1.2e9 < params(s) < 1.7e9 and 6.5e9 < params(t) < 8e9


def test_tiny_smoke_run(tmp_path, capsys):
    mod = _load()
    out = tmp_path / "bench.jsonl"
    code = mod.main(["--tiny", "--layout", "both", "--out", str(out), "--grad-checkpointing"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["layout"].split()[0], r["estimator"]) for r in rows] == [
        ("default", "sampled"),
        ("default", "full"),
        ("real-tiny", "sampled"),
        ("real-tiny", "full"),
    ]
    for r in rows:
        assert r["finite"] and r["tokens_per_s"] > 0 and r["peak_cpu_rss_gib"] > 0 and r["device"] == "cpu"
        assert 0 < r["rollout_s"] < r["step_s"]
        assert r["grad_checkpointing"] is True
    real = [r for r in rows if r["layout"] == "real-tiny"]
    assert all(r["tokens_per_step"] == r["batch_size"] * r["max_new_tokens"] for r in real)  # random weights: full length
    table = capsys.readouterr().out
    assert "| layout | estimator | tokens/step | tokens/s |" in table
