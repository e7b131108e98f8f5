"""Model pairs: a tiny pair saved to a folder loads through the same path as hub ids, and every
pre-flight error is one line naming the key, the value and what is allowed."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from opd_exp.config.world import EmbeddedModelConfig, ModelPairConfig
from opd_exp.pairs import load_pair, preflight, resolve_pair
from opd_exp.pairs.embedded.models import build_model, save_model
from opd_exp.pairs.embedded.tokenizer import SPECIAL_TOKENS, build_tokenizer
from opd_exp.runtime.errors import ConfigError


def _save(folder: Path, hidden: int, rows: int | None = None, tokenizer=None) -> Path:
    tok = tokenizer or build_tokenizer()
    model = build_model(
        EmbeddedModelConfig(hidden_size=hidden, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=2 * hidden), tok, seed=hidden
    )
    if rows is not None:
        model.resize_token_embeddings(rows)
    return save_model(model, tok, folder)


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    # Teacher with more embedding rows than the tokenizer (like Qwen2.5-7B vs 1.5B): reconcilable.
    return _save(root / "student", 16), _save(root / "teacher", 24, rows=288)


def _cfg(student, teacher, **kw) -> ModelPairConfig:
    return ModelPairConfig(name="test", student=str(student), teacher=str(teacher), **kw)


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_local_pair_loads_like_a_hub_pair(pair_dir, caplog):
    student_dir, teacher_dir = pair_dir
    with caplog.at_level(logging.INFO, logger="opd_exp.pairs"):
        pair = load_pair(_cfg(student_dir, teacher_dir))
    assert pair.vocab_size == len(pair.tokenizer) == 259
    assert pair.student.get_input_embeddings().weight.shape[0] == 259
    assert pair.teacher.get_input_embeddings().weight.shape[0] == 288
    assert "student has 259 embedding rows, teacher 288" in caplog.text and "reconcilable" in caplog.text
    assert pair.student.training and not pair.teacher.training
    assert not any(p.requires_grad for p in pair.teacher.parameters())
    assert all(p.requires_grad for p in pair.student.parameters())
    assert pair.student.dtype == torch.float32
    ids = pair.tokenizer("1+2=?\n", return_tensors="pt")["input_ids"]
    s, t = pair.student(ids).logits[..., : pair.vocab_size], pair.teacher(ids).logits[..., : pair.vocab_size]
    assert s.shape == t.shape == (1, 6, 259)


def test_dtype_from_config(pair_dir):
    pair = load_pair(_cfg(*pair_dir, dtype="bfloat16"))
    assert pair.student.dtype == pair.teacher.dtype == torch.bfloat16


def test_resolve_returns_local_folders_and_hub_ids(pair_dir, tmp_path, monkeypatch):
    student_dir, teacher_dir = pair_dir
    assert resolve_pair(_cfg(student_dir, teacher_dir)) == (str(student_dir), str(teacher_dir))
    hub = ModelPairConfig(student="Qwen/Qwen2.5-1.5B-Instruct", teacher="Qwen/Qwen2.5-Math-7B-Instruct")
    assert resolve_pair(hub) == ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-Math-7B-Instruct")
    monkeypatch.chdir(tmp_path)
    shutil.copytree(student_dir, tmp_path / "rel")
    assert resolve_pair(_cfg("rel", teacher_dir))[0] == str(tmp_path / "rel")


def test_missing_local_path(pair_dir, tmp_path):
    missing = tmp_path / "nope" / "student"
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(missing, pair_dir[1]))
    assert _one_line(err).startswith(f"model_pair.student: local folder '{missing}' does not exist; allowed: a hub id")
    with pytest.raises(ConfigError, match=r"^model_pair\.teacher: local folder './gone' does not exist"):
        resolve_pair(_cfg(pair_dir[0], "./gone"))
    with pytest.raises(ConfigError, match=r"^model_pair\.student='embedded:coach' is not allowed; allowed: 'embedded:student'"):
        resolve_pair(_cfg("embedded:coach", pair_dir[1]))


def test_folder_without_config(pair_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(pair_dir[0], tmp_path / "empty"))
    assert (
        _one_line(err)
        == f"model_pair.teacher: folder '{tmp_path / 'empty'}' has no config.json; allowed: a folder written by save_pretrained"
    )


def test_unreachable_hub_id(pair_dir, monkeypatch):
    import transformers.utils

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load this file.\nmore text")

    monkeypatch.setattr(transformers.utils, "cached_file", offline)
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(pair_dir[0], "Qwen/Qwen2.5-Math-7B-Instruct"))
    assert _one_line(err).startswith(
        "model_pair.teacher: cannot fetch 'Qwen/Qwen2.5-Math-7B-Instruct' from the hub or the local HF cache (We couldn't connect"
    )


def test_tokenizer_mismatch(pair_dir, tmp_path):
    other = build_tokenizer(SPECIAL_TOKENS + ["<sep>"])  # one more special token: every byte id shifts
    teacher = _save(tmp_path / "t", 16, tokenizer=other)
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(pair_dir[0], teacher))
    text = _one_line(err)
    assert text.startswith(f"model_pair.teacher: the tokenizer of '{teacher}' (260 tokens) maps text to different ids")
    assert text.endswith(
        "allowed: a teacher and student that share one tokenizer, or teacher.align=bytes (a teacher with its own tokenizer, "
        "scored on its own tokens; docs/training.md)"
    )
    # teacher.align=bytes: the teacher keeps its own tokenizer (no probe, no end-of-sequence comparison)
    checked = preflight(_cfg(pair_dir[0], teacher), teacher_align="bytes")
    assert checked.teacher_tokenizer == str(teacher) and checked.vocab_size == 259


def test_vocab_smaller_than_tokenizer(pair_dir, tmp_path):
    small = _save(tmp_path / "small", 16, rows=64)
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(pair_dir[0], small))
    assert _one_line(err) == (
        f"model_pair.teacher: '{small}' has 64 embedding rows but the tokenizer has 259 tokens; "
        f"allowed: a model whose vocab_size is >= 259 (the tokenizer's length)"
    )


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_trust_remote_code_needed_but_not_allowed(pair_dir, tmp_path):
    custom = Path(shutil.copytree(pair_dir[1], tmp_path / "custom"))
    _edit_config(custom, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with pytest.raises(ConfigError) as err:
        preflight(_cfg(pair_dir[0], custom))
    assert _one_line(err) == (
        f"model_pair.trust_remote_code: got False, but model_pair.teacher='{custom}' needs custom code "
        f"(its config.json maps to code in the repo (auto_map)); allowed: true (only for code you trust), "
        f"or a model transformers supports natively"
    )
    unknown = Path(shutil.copytree(pair_dir[0], tmp_path / "unknown"))
    _edit_config(unknown, model_type="my_new_arch")
    with pytest.raises(
        ConfigError, match=r"^model_pair\.trust_remote_code: got False, but model_pair\.student=.*model_type 'my_new_arch' is unknown"
    ):
        preflight(_cfg(unknown, pair_dir[1]))


def test_only_safetensors_weights_are_loaded(pair_dir, tmp_path):
    pickled = Path(shutil.copytree(pair_dir[1], tmp_path / "pickled"))
    from safetensors.torch import load_file

    torch.save(load_file(str(pickled / "model.safetensors")), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"^model_pair\.teacher: cannot load safetensors weights from"):
        load_pair(_cfg(pair_dir[0], pickled))


def test_separate_tokenizer_key(pair_dir, tmp_path):
    from opd_exp.pairs.embedded.tokenizer import save_tokenizer

    tok_dir = save_tokenizer(tmp_path / "tok")
    result = preflight(_cfg(*pair_dir, tokenizer=str(tok_dir)))
    assert result.tokenizer == str(tok_dir) and result.vocab_size == 259
    with pytest.raises(ConfigError, match=r"^model_pair\.tokenizer: local folder '/no/such/tok' does not exist"):
        preflight(_cfg(*pair_dir, tokenizer="/no/such/tok"))


def test_group_files_compose_into_the_schema():
    import os

    from omegaconf import OmegaConf

    from opd_exp.config.world import as_pair_config, as_task_config

    conf = os.path.join(os.path.dirname(__file__), "..", "conf")

    def load(group, name):
        """A group file's own keys; a `# @package _global_` file (a pair with its own trainer
        defaults) holds them under the group's name."""
        node = OmegaConf.load(os.path.join(conf, group, f"{name}.yaml"))
        return node.get(group, node)

    seeds = as_pair_config(load("model_pair", "qwen2.5_1.5b_math7b"))
    assert (seeds.student, seeds.teacher, seeds.dtype) == ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-Math-7B-Instruct", "bfloat16")
    assert as_pair_config(load("model_pair", "qwen3")).teacher == "Qwen/Qwen3-8B"
    assert as_pair_config(load("model_pair", "embedded")) == ModelPairConfig()
    with pytest.raises(ConfigError, match=r"^model_pair\.student='' is not allowed; allowed: .*set it on the command line"):
        as_pair_config(load("model_pair", "local"))
    assert as_task_config(load("task", "arithmetic")).max_digits == 2
    gsm8k = as_task_config(load("task", "gsm8k"))
    assert (gsm8k.name, gsm8k.path, gsm8k.eval_split) == ("gsm8k", "openai/gsm8k", "test")


def _tiny_embedded_pair():
    """(ModelPairConfig, TaskConfig) of an embedded pair that builds in seconds."""
    from opd_exp.config.world import EmbeddedPairConfig, TaskConfig

    tiny = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, sft_steps=3, batch_size=4)
    cfg = ModelPairConfig(
        embedded=EmbeddedPairConfig(
            teacher=EmbeddedModelConfig(**tiny), student=EmbeddedModelConfig(**tiny), n_sft=16, n_check=4, threads=1
        )
    )
    return cfg, TaskConfig(n_train=5, n_eval=10)


def test_embedded_pair_loads_through_the_same_path(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))
    cfg, task = _tiny_embedded_pair()
    student_path, teacher_path = resolve_pair(cfg, task, progress=False)
    assert Path(student_path).parent == tmp_path and Path(teacher_path).name.startswith("embedded-teacher-")
    pair = load_pair(cfg, task)
    assert (pair.student_path, pair.teacher_path) == (student_path, teacher_path)
    assert pair.vocab_size == len(pair.tokenizer) == 259 and pair.tokenizer.pad_token_id == 0
    assert not pair.teacher.training and pair.student.training


def test_a_pair_named_by_its_teacher_alone_prepares_no_student(tmp_path, monkeypatch):
    """A model_pair option used as one teacher of a map names its teacher in both slots: its
    student recipe is never built (only the tokenizer and the teacher enter the cache)."""
    import dataclasses

    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))
    cfg, task = _tiny_embedded_pair()
    alone = dataclasses.replace(cfg, student="embedded:teacher", teacher="embedded:teacher")
    student_path, teacher_path = resolve_pair(alone, task, progress=False)
    assert student_path == teacher_path and Path(teacher_path).name.startswith("embedded-teacher-")
    kinds = sorted(p.name.split("-")[1] for p in tmp_path.iterdir() if p.name.startswith("embedded-"))
    assert kinds == ["teacher", "tokenizer"]
    # an embedded student beside a teacher from elsewhere prepares the student alone
    mixed = dataclasses.replace(cfg, student="embedded:student", teacher=teacher_path)
    student_path, other = resolve_pair(mixed, task, progress=False)
    assert Path(student_path).name.startswith("embedded-student-") and other == teacher_path
    # the whole pair afterwards reuses both entries
    assert resolve_pair(cfg, task, progress=False) == (student_path, teacher_path)
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir() if p.name.startswith("embedded-")) == ["student", "teacher", "tokenizer"]
