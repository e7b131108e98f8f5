"""A tiny world vLLM's CPU build can load, for the tests marked ``vllm``: the tests' character tokenizer,
a random tiny Qwen2 student with head_dim 64 (vLLM's CPU attention refuses the tiny pair's and the
embedded worlds' head_dim 16) and the tiny HF teacher (in process: any shape)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from helpers.tiny import build_model, build_tokenizer


def build_vllm_world(root: Path) -> Path:
    tok = build_tokenizer(root / "tokenizer")
    build_model(root / "student", len(tok), hidden=128, layers=1, seed=1)  # 2 heads: head_dim 64
    build_model(root / "teacher", len(tok) + 8, hidden=32, layers=2, seed=2)
    return root


def load_vllm_world(root: Path) -> SimpleNamespace:
    """A fresh copy of the pair (the student gets trained; vLLM loads it from ``root / "student"``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    return SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(root / "student"),
        teacher=AutoModelForCausalLM.from_pretrained(root / "teacher"),
        tokenizer=tok,
        vocab_size=len(tok),
    )
