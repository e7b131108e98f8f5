"""Tiny Qwen2 models for the embedded world, saved and loaded exactly like hub models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opd_exp.config.world import EmbeddedModelConfig


def qwen2_config(cfg: EmbeddedModelConfig, tokenizer: Any, max_positions: int = 256):
    """A ``Qwen2Config`` of the given size whose vocabulary is the tokenizer's."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,  # fewer parameters; the head learns with the embedding
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
    )


def build_model(cfg: EmbeddedModelConfig, tokenizer: Any, seed: int):
    """A freshly initialised Qwen2 causal LM (float32, deterministic from ``seed``)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen2_config(cfg, tokenizer), dtype=torch.float32)
    _set_generation_defaults(model, tokenizer)
    return model


def _set_generation_defaults(model: Any, tokenizer: Any) -> None:
    gen = model.generation_config
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = None
    gen.do_sample = False


def save_model(model: Any, tokenizer: Any, folder: str | Path) -> Path:
    """Write weights (safetensors), config, generation config and tokenizer to ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))  # safetensors is the default (and the only format we load)
    tokenizer.save_pretrained(str(folder))
    from opd_exp.pairs.embedded.tokenizer import fix_tokenizer_config

    fix_tokenizer_config(folder)
    return folder


def load_model(folder: str | Path, dtype: str = "float32"):
    """Load a saved model the way a hub model is loaded (safetensors only)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, use_safetensors=True)


def count_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
