"""An offline character-level tokenizer, built with ``tokenizers`` and saved in HF format.

Every printable ASCII character plus newline and tab is one token, so arithmetic and any
GSM8K-style English text round-trip exactly; other characters map to ``<unk>``. There is no
chat template: the embedded models see the plain prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]  # ids 0, 1, 2
CHARSET = "\n\t" + "".join(chr(c) for c in range(32, 127))  # printable ASCII


def build_tokenizer(charset: str = CHARSET):
    """A ``PreTrainedTokenizerFast`` with one token per character of ``charset``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split every character off on its own ("[\\s\\S]" also matches newlines).
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters back without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",  # generation pads on the left
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(folder: str | Path, charset: str = CHARSET) -> Path:
    """Build the tokenizer and write it to ``folder`` (loadable by ``AutoTokenizer``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(charset).save_pretrained(str(folder))
    # Name the class both transformers 4.x and 5.x know, so older installs load it too.
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return folder


def load_tokenizer(folder: str | Path):
    """Load a tokenizer folder exactly as for a hub model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
