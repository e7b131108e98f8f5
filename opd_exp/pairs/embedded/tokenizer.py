"""An offline byte-level tokenizer with one token per byte, built with ``tokenizers``.

Every character of ASCII text (digits, operators, letters, spaces, newlines) is exactly one
token; other text falls back to its UTF-8 bytes, so nothing is ever unknown. It is a BPE
tokenizer with no merges over the 256 byte symbols, i.e. exactly the pipeline that
transformers' ``Qwen2Tokenizer`` builds: transformers 5 loads every ``model_type: qwen2``
folder with that class whatever ``tokenizer_config.json`` says, so any other pipeline would
silently change (e.g. drop spaces) when loaded from a model folder. There is no chat
template: the embedded models see the plain prompt.

Ids: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then byte ``b`` has id ``3 + b`` (ASCII ``c`` ->
``3 + ord(c)``).
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]  # ids 0, 1, 2
BYTE_OFFSET = len(SPECIAL_TOKENS)
TOKENIZER_CLASS = "Qwen2Tokenizer"  # what transformers 5 uses for qwen2 folders anyway


def byte_symbols() -> list[str]:
    """The printable stand-in of each byte 0..255 used by byte-level BPE (GPT-2's table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:  # control bytes, space, ... move to unused code points
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_tokenizer(special_tokens: list[str] = SPECIAL_TOKENS):
    """A ``PreTrainedTokenizerFast`` with one token per byte (see the module docstring).

    ``special_tokens`` come first (pad, eos, unk, then any extra); bytes follow them.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(special_tokens)}
    for i, sym in enumerate(byte_symbols()):
        vocab[sym] = len(special_tokens) + i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=special_tokens[0],
        eos_token=special_tokens[1],
        unk_token=special_tokens[2],
        padding_side="left",  # generation pads on the left
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    if len(special_tokens) > 3:
        tok.add_special_tokens({"additional_special_tokens": list(special_tokens[3:])})
    return tok


def save_tokenizer(folder: str | Path) -> Path:
    """Build the tokenizer and write it to ``folder`` (loadable by ``AutoTokenizer``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(str(folder))
    fix_tokenizer_config(folder)
    return folder


def fix_tokenizer_config(folder: str | Path) -> None:
    """Name the class explicitly, so a folder with or without a model config loads the same way."""
    path = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = TOKENIZER_CLASS
    cfg["padding_side"] = "left"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_tokenizer(folder: str | Path):
    """Load a tokenizer folder exactly as for a hub model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
