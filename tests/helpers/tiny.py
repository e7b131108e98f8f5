"""A tiny character tokenizer, tiny random Qwen2 teacher and student saved to a folder and loaded
back like hub models, a stand-in task, and a CPU-sized TrainConfig."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

CHARS = list("0123456789+-=;# ")


@dataclass
class Problem:
    prompt: str
    answer: str
    solution: str


class AddTask:
    """'a+b=' -> 'c': small enough for random tiny models, with a real verifier."""

    def __init__(self, n_train: int = 64, n_eval: int = 16, seed: int = 0):
        rng = random.Random(seed)
        pairs = [(a, b) for a in range(10) for b in range(10)]
        rng.shuffle(pairs)
        make = lambda a, b: Problem(f"{a}+{b}=", str(a + b), f"{a + b}")
        self._train = [make(a, b) for a, b in (pairs * 2)[:n_train]]
        self._eval = [make(a, b) for a, b in pairs[-n_eval:]]

    def train_problems(self):
        return self._train

    def eval_problems(self):
        return self._eval

    def render_prompt(self, problem, tokenizer):
        return problem.prompt

    def verify(self, completion: str, answer: str) -> bool:
        return completion.strip() == answer


def build_tokenizer(folder: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def build_model(folder: Path, vocab_size: int, hidden: int, layers: int, seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder)


def small_config(**groups):
    """A TrainConfig shrunk for CPU tests; ``groups`` maps a group name to a dict of fields
    (an enum field may be given as its string; each group's class and enums come from the schema)."""
    import dataclasses
    import enum
    import types
    import typing

    from opd_exp.config import schema as S
    from opd_exp.config.deprecated import RENAMED
    from opd_exp.config.world import ModelPairConfig, TaskConfig

    base = {
        "trainer": dict(
            max_steps=3,
            batch_size=4,
            lr=1e-2,
            warmup_steps=0,
            progress=False,
            schedule="constant",
        ),
        "eval": dict(every=0, size=4, batch_size=4),
        "checkpoint": dict(every=0),
        "scale": dict(device="cpu"),
        "rollout": dict(max_new_tokens=4, max_prompt_tokens=8),
        "logger": dict(name="none"),
    }
    for g, fields in groups.items():
        for k, v in fields.items():  # a moved key given under trainer (eval_every, device, ...) goes to its group
            new = RENAMED.get(f"{g}.{k}", f"{g}.{k}")
            group, key = new.split(".", 1)
            base.setdefault(group, {})[key] = v
    group_types = typing.get_type_hints(S.TrainConfig)
    kwargs = {}
    for g, fields in base.items():
        cls = group_types[g]
        hints = typing.get_type_hints(cls)
        conv = {}
        for k, v in fields.items():
            t = hints.get(k)
            if typing.get_origin(t) in (typing.Union, types.UnionType):  # Optional[Enum]: the enum
                t = next((a for a in typing.get_args(t) if a is not type(None)), t)
            is_enum = isinstance(t, type) and issubclass(t, enum.Enum)
            conv[k] = t(v) if is_enum and isinstance(v, str) else v
        assert dataclasses.is_dataclass(cls), g
        kwargs[g] = cls(**conv)
    return S.TrainConfig(model_pair=ModelPairConfig(), task=TaskConfig(), **kwargs)


def build_llama_teacher(folder: Path, vocab_size: int, seed: int, *, hidden: int = 32, tied: bool = True):
    """A tiny Llama saved beside a teacher's own tokenizer (beside a qwen2 config.json, AutoTokenizer would
    load Qwen2's class, with its own digit-splitting pre-tokenizer, not the tokenizer saved there); head
    size hidden / 2 (64: 32, which a CPU vLLM supports)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=tied, eos_token_id=0, pad_token_id=1,
        bos_token_id=None,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
