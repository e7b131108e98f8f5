"""The prepared embedded worlds the package ships: they are what the shipped configs ask for, a
fresh cache copies them (checked by hash) instead of building, a damaged copy is refused in one
line, and ``--force`` builds from scratch."""

from __future__ import annotations

import json
import shutil

import pytest
from hydra import compose, initialize_config_dir

import opd_exp.cli.train as T
from opd_exp.pairs.embedded import cache, prepare
from opd_exp.runtime import files
from opd_exp.runtime.errors import ConfigError

INDEX = json.loads((cache.SHIPPED_ROOT / cache.SHIPPED_INDEX).read_text())
WORLDS = {
    "default": [],
    "multimodal": ["model_pair=embedded_multimodal", "task=multimodal"],
    "chain": ["model_pair=embedded_chain", "task=chain"],
    "self_distill": ["model_pair=embedded_self_distill", "teacher=live", "teacher.privileged=solution"],
    "tool": ["model_pair=embedded_tool", "task=calc_tool"],
}


def _entry_names(overrides: list[str]) -> dict[str, str]:
    with initialize_config_dir(config_dir=T.CONF_DIR, version_base="1.3"):
        cfg = T.to_train_config(compose("train", overrides=[*overrides, "logger=none"]))
    task = prepare.world_task_config(cfg.task)
    pair = cfg.model_pair.embedded
    names = {"tokenizer": cache.entry_path("embedded-tokenizer", prepare.tokenizer_key()).name}
    for role in ("teacher", "student"):
        names[role] = cache.entry_path(f"embedded-{role}", prepare.model_key(role, pair, task)).name
    return names


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_every_shipped_config_finds_its_prepared_world(world):
    """A recipe change without re-shipping fails here (the first run would build again)."""
    names = _entry_names(WORLDS[world])
    for role, name in names.items():
        assert name in INDEX["entries"], f"{world} {role}: {name} is not shipped (python -m opd_exp.pairs.embedded.ship)"
        folder = cache.shipped_entry(name)
        assert folder is not None and cache.check_entry(folder) is None
        assert files.sha256_file(folder / cache.MANIFEST) == INDEX["entries"][name]
    assert INDEX["built_on"]["torch"] and INDEX["built_on"]["cpu"]


def test_a_fresh_cache_copies_the_shipped_world_and_builds_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))

    def no_build(*a, **k):
        raise AssertionError("built although the package ships this entry")

    monkeypatch.setattr(prepare, "_build_model", no_build)
    monkeypatch.setattr(prepare, "_build_tokenizer", no_build)
    prepared = prepare.prepare_embedded(progress=False)
    names = _entry_names([])
    for role in ("tokenizer", "teacher", "student"):
        got = getattr(prepared, role)
        assert got == tmp_path / names[role] and cache.check_entry(got) is None
        assert cache.read_manifest(got) == cache.read_manifest(cache.SHIPPED_ROOT / names[role])  # the same files, bit for bit
    assert prepared.info["teacher"]["accuracy"] == cache.read_manifest(cache.SHIPPED_ROOT / names["teacher"])["info"]["accuracy"]


def test_a_damaged_shipped_entry_is_one_line_not_a_silent_rebuild(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shutil.copytree(cache.SHIPPED_ROOT, shipped)
    teacher = _entry_names([])["teacher"]
    weights = shipped / teacher / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(cache, "SHIPPED_ROOT", shipped)
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as info:
        prepare.prepare_embedded(progress=False)
    assert str(info.value) == (
        f"model_pair: the shipped entry {shipped / teacher} is damaged (file model.safetensors does not match its checksum); "
        "allowed: reinstall opd-exp, or opd-prepare --force to build the pair from scratch"
    )
    assert not (tmp_path / "cache" / teacher).exists()


def test_force_builds_from_scratch_instead_of_copying(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))
    built = []

    def fake_build(folder, role, *a, **k):
        built.append(role)
        (folder / "model.safetensors").write_bytes(role.encode())
        return {"accuracy": 0.5}

    monkeypatch.setattr(prepare, "_build_model", fake_build)
    prepared = prepare.prepare_embedded(progress=False, force=True)
    assert built == ["teacher", "student"]
    assert (prepared.teacher / "model.safetensors").read_bytes() == b"teacher"
