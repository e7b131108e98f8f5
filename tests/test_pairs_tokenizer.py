"""The offline character tokenizer: HF format, AutoTokenizer round trip, special tokens."""

from __future__ import annotations

import json

import pytest

from opd_exp.pairs.embedded.tokenizer import EOS, PAD, UNK, build_tokenizer, load_tokenizer, save_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = save_tokenizer(tmp_path_factory.mktemp("tok"))
    return load_tokenizer(folder)


def test_saved_in_hf_format_and_loaded_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    folder = save_tokenizer(tmp_path / "t")
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == 3 + 256


def test_special_tokens(tok):
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == (PAD, EOS, UNK)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.bos_token is None and not tok.chat_template
    assert tok.padding_side == "left"
    # Special tokens written as text are recognised as one id each.
    assert tok("1<eos>", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids("1"), 1]


@pytest.mark.parametrize(
    "text",
    ["9-5=4;4+2=6;#### 6", "(3-7)*5=?\n", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "  tabs\tand  spaces  \n\n", ""],
)
def test_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [3 + ord(c) for c in text]  # one token per character, no BOS/EOS added
    assert tok.decode(ids) == text


def test_model_folder_loads_the_same_tokenizer(tmp_path):
    # transformers 5 loads any qwen2 model folder with Qwen2Tokenizer: ids must not change.
    from transformers import AutoTokenizer

    from opd_exp.config.world import EmbeddedModelConfig
    from opd_exp.pairs.embedded.models import build_model, save_model

    tok = build_tokenizer()
    model = build_model(EmbeddedModelConfig(hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=8), tok, 0)
    loaded = AutoTokenizer.from_pretrained(str(save_model(model, tok, tmp_path / "m")))
    text = "Natalia  sold 1+2=?\n\t#### 6 café"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id, len(loaded)) == (0, 1, 259)


def test_ids_are_stable_and_other_text_falls_back_to_bytes(tok):
    ids = tok("09+-=;#", add_special_tokens=False)["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(c) for c in "09+-=;#"]
    assert ids == [3 + ord(c) for c in "09+-=;#"]  # byte b has id 3 + b: a fixed contract
    # Non-ASCII text falls back to its UTF-8 bytes: nothing is unknown, decoding restores it.
    ids = tok("é1", add_special_tokens=False)["input_ids"]
    assert ids == [3 + b for b in "é1".encode()] and tok.decode(ids) == "é1"


def test_batch_left_padding_and_decode_skipping_specials(tok):
    batch = tok(["1+2=?\n", "12-3+4=?\n"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][:3] == [0, 0, 0] and batch["attention_mask"][0][:4] == [0, 0, 0, 1]
    ids = tok("#### 6", add_special_tokens=False)["input_ids"] + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "#### 6"


def test_build_is_deterministic():
    a = build_tokenizer().get_vocab()
    b = build_tokenizer().get_vocab()
    assert a == b
