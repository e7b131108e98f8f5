"""benchmarks/gpu/run.sh, the one prepared GPU check: its --cpu dry run goes through the whole
sequence (the SmolLM2-shaped step, the fused and the materialised head, staleness 1 where the
schema has it) and writes one markdown table with finite numbers in every row that ran; what
travels to the GPU machine (tracked files, untracked ones git keeps, the carried wheels) stays
under the device tool's 64 MiB."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK = REPO / "benchmarks" / "gpu" / "check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_what_travels_to_the_gpu_machine_fits_its_64_mib():
    mod = _load()
    sizes = mod.travel_bytes(REPO)
    if sizes is None:
        pytest.skip("no git checkout here")
    assert sizes["total"] == sizes["tracked"] + sizes["untracked"] + sizes["wheels"]
    assert sizes["total"] < mod.TRAVEL_LIMIT == 64 * 2**20, mod.travel_line(sizes)
    assert mod.travel_line(sizes).endswith("of 64 MiB: fits")
    # the wheels are ignored by git: they travel only as carried paths, never committed
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/gpu/wheels/x.whl"], cwd=REPO)
    assert ignored.returncode == 0


def test_the_tokenizer_spans_the_real_vocabulary_and_encodes_the_task_byte_by_byte(tmp_path):
    from transformers import AutoTokenizer

    mod = _load()
    mod.write_tokenizer(tmp_path, 151936)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 151936 and tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert tok("12+34=")["input_ids"] == [3 + ord(c) for c in "12+34="]  # the embedded tokenizer's ids
    assert isinstance(tok.decode([70000, 151935]), str)  # filler tokens decode


def test_the_schema_is_read_when_the_check_runs():
    mod = _load()
    assert mod.schema_has("scale.fused_lm_head") and mod.schema_has("rollout.max_new_tokens")
    assert not mod.schema_has("rollout.no_such_key") and not mod.schema_has("no_such_group.x")


def test_the_shapes_are_the_named_models():
    mod = _load()

    def params(c):  # decoder layers + embeddings (tied), as in tests/test_gpu_bench.py
        h, i, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
        return L * (2 * h * h + 2 * h * kv + 3 * h * i) + V * h

    assert 130e6 < params(mod.SMOLLM2) < 140e6  # SmolLM2-135M
    assert 0.45e9 < params(mod.QWEN_05B) < 0.52e9 and 1.4e9 < params(mod.QWEN_15B) < 1.6e9
    assert mod.QWEN_05B["vocab_size"] == mod.QWEN_15B["vocab_size"] == 151936


@pytest.mark.slow
def test_the_cpu_dry_run_writes_one_table_with_every_row(tmp_path):
    out = tmp_path / "gpu_check.md"
    env = dict(os.environ, PYTHON=sys.executable, WANDB_MODE="disabled")
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu" / "run.sh"), "--cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "of 64 MiB: fits" in done.stdout
    text = out.read_text()
    assert text.count("\n| check |") == 1  # one table
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:7] == ["check", "pair", "setting", "params S/T", "s/step", "tokens/s", "peak GiB"]
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    assert [r["check"].split(" (")[0] for r in rows] == [
        "SmolLM2 pair, one OPD step",
        "fused LM head",
        "materialised LM head",
        "staleness 1",
    ]
    numbers = [
        "s/step",
        "tokens/s",
        "peak GiB",
        "generate %",
        "teacher %",
        "train %",
        "sync %",
        "wait %",
        "N_T/(3 N_S)",
        "teacher s/train s",
    ]
    for r in rows:
        if r["status"].startswith("skipped"):  # only staleness, and only while the schema lacks it, saying so
            assert r["check"] == "staleness 1" and "rollout.staleness is not in the config schema" in r["status"]
            continue
        assert r["status"].startswith("ok"), r
        assert all(math.isfinite(float(r[k])) for k in numbers), r
        assert float(r["s/step"]) > 0 and float(r["generate %"]) > 0 and float(r["train %"]) > 0
    assert "scale.fused_lm_head=on" in rows[1]["setting"] and "scale.fused_lm_head=off" in rows[2]["setting"]
    assert "x the fused peak" in rows[2]["status"]
    assert rows[1]["params S/T"] == rows[2]["params S/T"] != "—"
    log = out.with_suffix(".log").read_text()
    assert log.count("opd_exp.cli.train") == sum(1 for r in rows if not r["status"].startswith("skipped"))
