"""The cache: location, atomic entries with checksums, reuse, key change, broken entries rebuilt;
and the embedded pair prepared through it with a tiny budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opd_exp.cli.prepare import main as prepare_main
from opd_exp.config.world import EmbeddedModelConfig, EmbeddedPairConfig, TaskConfig
from opd_exp.pairs.embedded import cache, prepare
from opd_exp.pairs.embedded.prepare import prepare_embedded


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("OPD_EXP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "opd-exp"
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("OPD_EXP_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_root() == Path.home() / ".cache" / "opd-exp"


def test_key_hash_is_order_independent():
    assert cache.key_hash({"a": 1, "b": {"c": 2}}) == cache.key_hash({"b": {"c": 2}, "a": 1})
    assert cache.key_hash({"a": 1}) != cache.key_hash({"a": 2})


class Builder:
    def __init__(self):
        self.calls = 0

    def __call__(self, folder: Path):
        self.calls += 1
        (folder / "sub").mkdir()
        (folder / "weights.bin").write_bytes(b"w" * 100)
        (folder / "sub" / "config.json").write_text("{}")
        return {"accuracy": 0.5}


def test_reuse_key_change_and_manifest(tmp_path):
    build = Builder()
    a = cache.get_or_build("thing", {"x": 1}, build, root=tmp_path)
    assert build.calls == 1 and a.name == f"thing-{cache.key_hash({'x': 1})}"
    manifest = cache.read_manifest(a)
    assert set(manifest["files"]) == {"weights.bin", "sub/config.json"}
    assert manifest["info"] == {"accuracy": 0.5} and manifest["key"] == {"x": 1}
    stamp = (a / cache.MANIFEST).stat().st_mtime_ns
    assert cache.get_or_build("thing", {"x": 1}, build, root=tmp_path) == a
    assert build.calls == 1 and (a / cache.MANIFEST).stat().st_mtime_ns == stamp  # reused, not rebuilt
    b = cache.get_or_build("thing", {"x": 2}, build, root=tmp_path)
    assert build.calls == 2 and b != a and cache.check_entry(a) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda e: (e / "weights.bin").write_bytes(b"x" * 100), "file weights.bin does not match its checksum"),
        (lambda e: (e / "weights.bin").write_bytes(b"w" * 50), "file weights.bin does not match its checksum"),
        (lambda e: (e / "sub" / "config.json").unlink(), "file sub/config.json is missing"),
        (lambda e: (e / cache.MANIFEST).unlink(), "no readable opd-exp-manifest.json (partial build?)"),
        (lambda e: (e / cache.MANIFEST).write_text("{trunc"), "no readable opd-exp-manifest.json (partial build?)"),
    ],
)
def test_broken_entry_is_detected_and_rebuilt(tmp_path, damage, reason, caplog):
    build = Builder()
    entry = cache.get_or_build("thing", {"x": 1}, build, root=tmp_path)
    damage(entry)
    assert cache.check_entry(entry) == reason
    with caplog.at_level("WARNING", logger="opd_exp.pairs"):
        again = cache.get_or_build("thing", {"x": 1}, build, root=tmp_path)
    assert again == entry and build.calls == 2 and cache.check_entry(entry) is None
    assert (entry / "weights.bin").read_bytes() == b"w" * 100
    assert reason in caplog.text


def test_failed_build_leaves_no_entry(tmp_path):
    def boom(folder: Path):
        (folder / "half.bin").write_bytes(b"1")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        cache.get_or_build("thing", {"x": 1}, boom, root=tmp_path)
    assert cache.check_entry(cache.entry_path("thing", {"x": 1}, tmp_path)) == "missing"
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def _tiny(steps: int = 5) -> EmbeddedModelConfig:
    return EmbeddedModelConfig(
        hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, sft_steps=steps, batch_size=8, lr=1e-3
    )


def test_prepare_embedded_builds_reuses_and_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    pair = EmbeddedPairConfig(teacher=_tiny(), student=_tiny(), n_sft=64, n_check=8, threads=1)
    task = TaskConfig(n_train=10, n_eval=20)
    first = prepare_embedded(pair, task, progress=False)
    assert torch.get_num_threads() == threads  # restored
    assert first.teacher.parent == tmp_path and first.teacher.name.startswith("embedded-teacher-")
    for folder in (first.teacher, first.student):
        assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    info = first.info["teacher"]
    assert info["n_check"] == 8 and 0.0 <= info["accuracy"] <= info["format_rate"] <= 1.0
    stamps = {r: (getattr(first, r) / cache.MANIFEST).stat().st_mtime_ns for r in ("teacher", "student")}

    # Reuse: same folders, nothing rebuilt; threads and task.seed are not part of the key.
    again = prepare_embedded(
        EmbeddedPairConfig(teacher=_tiny(), student=_tiny(), n_sft=64, n_check=8, threads=2),
        TaskConfig(n_train=10, n_eval=20, seed=5),
        progress=False,
    )
    assert (again.teacher, again.student) == (first.teacher, first.student)
    assert {r: (getattr(again, r) / cache.MANIFEST).stat().st_mtime_ns for r in stamps} == stamps

    # Key change: the teacher recipe changes the teacher entry only.
    changed = prepare_embedded(EmbeddedPairConfig(teacher=_tiny(6), student=_tiny(), n_sft=64, n_check=8, threads=1), task, progress=False)
    assert changed.teacher != first.teacher and changed.student == first.student
    # So does the task's difficulty (the models are trained for that task).
    harder = prepare_embedded(pair, TaskConfig(n_train=10, n_eval=20, max_digits=3), progress=False)
    assert harder.teacher != first.teacher and harder.student != first.student

    # A corrupted weights file is detected and rebuilt, never loaded.
    weights = first.teacher / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert "model.safetensors" in cache.check_entry(first.teacher)
    rebuilt = prepare_embedded(pair, task, progress=False)
    assert rebuilt.teacher == first.teacher and cache.check_entry(first.teacher) is None
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(rebuilt.teacher), use_safetensors=True)


def test_opd_prepare_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))
    args = [
        "--quiet",
        "model_pair.embedded.n_sft=32",
        "model_pair.embedded.n_check=4",
        "model_pair.embedded.threads=1",
        "task.n_eval=10",
        "task.n_train=5",
    ]
    for role in ("teacher", "student"):
        args += [
            f"model_pair.embedded.{role}.{k}={v}"
            for k, v in dict(
                hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, sft_steps=2, batch_size=4
            ).items()
        ]
    assert prepare_main(args) == 0
    out = capsys.readouterr().out
    assert f"cache: {tmp_path}" in out and "teacher: " in out and "greedy accuracy=" in out
    assert prepare_main(["model_pair.embedded.teacher.lr=2"]) == 2
    assert capsys.readouterr().err.strip() == "error: model_pair.embedded.teacher.lr=2.0 is not allowed; allowed: a float in (0, 1)"
    assert prepare_main(["lr=2"]) == 2
    assert "allowed: key=value with a key under model_pair. or task." in capsys.readouterr().err


def test_every_build_is_announced_with_its_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))
    pair = EmbeddedPairConfig(teacher=_tiny(), student=_tiny(), n_sft=64, n_check=8, threads=1)
    teacher_entry = cache.entry_path("embedded-teacher", prepare.model_key("teacher", pair, TaskConfig(n_eval=20)))
    # a build killed by SIGKILL left its temp folder; another entry's build is in progress
    (tmp_path / f".tmp-{teacher_entry.name}-dead").mkdir(parents=True)
    (tmp_path / ".tmp-embedded-other-0123-live").mkdir()
    capsys.readouterr()
    first = prepare_embedded(pair, TaskConfig(n_train=10, n_eval=20), progress=False)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("opd-exp:")]
    assert err[0] == (
        "opd-exp: building the embedded teacher once (5 SFT steps, under a minute on a laptop CPU): "
        f"not in the cache yet (first run on this machine); cached in {first.teacher}"
    )
    assert err[1].startswith("opd-exp: building the embedded student once (5 SFT steps")
    assert first.teacher == teacher_entry
    assert not (tmp_path / f".tmp-{teacher_entry.name}-dead").exists()  # swept under the entry's lock
    assert (tmp_path / ".tmp-embedded-other-0123-live").exists()  # not ours to remove
    assert first.info["teacher"]["hash"] == teacher_entry.name.rsplit("-", 1)[1]
    # the same recipe again: no rebuild, nothing announced
    again = prepare_embedded(pair, TaskConfig(n_train=10, n_eval=20), progress=False)
    assert (again.teacher, again.student) == (first.teacher, first.student)
    assert "opd-exp:" not in capsys.readouterr().err
    # another eval set is another teacher (the SFT data excludes it): announced with the reason
    prepare_embedded(pair, TaskConfig(n_train=10, n_eval=30), progress=False)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("opd-exp:")]
    assert len(lines) == 2 and "task.n_eval: 20 -> 30" in lines[0], lines
    # a recipe change is announced with its reason
    prepare_embedded(
        EmbeddedPairConfig(teacher=_tiny(3), student=_tiny(), n_sft=64, n_check=8, threads=1),
        TaskConfig(n_train=10, n_eval=30),
        progress=False,
    )
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("opd-exp:")]
    assert line.startswith("opd-exp: building the embedded teacher once (3 SFT steps")
    assert "its recipe differs from the cached one (model.sft_steps: 5 -> 3)" in line


def test_ctrl_c_during_opd_prepare_is_one_line_and_caches_nothing_half_built(tmp_path, monkeypatch, capsys):
    import opd_exp.pairs.embedded.models as models_mod

    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))

    def interrupted_save(model, tokenizer, folder):  # Ctrl-C while the teacher's files are written
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models_mod, "save_model", interrupted_save)
    args = ["--quiet", "model_pair.embedded.n_sft=16", "model_pair.embedded.n_check=2", "model_pair.embedded.threads=1"]
    args += [f"model_pair.embedded.teacher.{k}={v}" for k, v in dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                                                        intermediate_size=32, sft_steps=1, batch_size=4).items()]  # fmt: skip
    try:
        code = prepare_main(args)
    except KeyboardInterrupt:
        code = "traceback"
    err = capsys.readouterr().err
    assert code == 130
    assert err.splitlines()[-1] + "\n" == (
        f"opd-prepare: interrupted (Ctrl-C): the entry being built was discarded, nothing half-built is in the cache {tmp_path}; "
        "run the same command again to build it (exit code 130)\n"
    )
    assert "Traceback" not in err and err.count("\n") == 2  # the build's announcement, then the one line
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock"))
    assert [n for n in left if "teacher" in n or n.startswith(".tmp")] == []  # only finished entries (the tokenizer)
    assert all(cache.check_entry(tmp_path / n) is None for n in left)


def test_a_disk_problem_inside_the_cache_names_opd_exp_cache_not_the_run_folder(tmp_path, monkeypatch, capsys):
    from opd_exp.cli.errors import io_error

    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path / "cache"))
    inside = str(tmp_path / "cache" / "embedded-teacher-0123" / "model.safetensors")
    line = str(io_error(OSError(28, "No space left on device", inside)))
    assert line == (
        f"the model cache cannot be written ({inside}): No space left on device; allowed: OPD_EXP_CACHE set to a writable "
        f"folder with free space (OPD_EXP_CACHE is {tmp_path / 'cache'})"
    )
    outside = str(io_error(OSError(28, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))))
    assert "hydra.run.dir" in outside and "OPD_EXP_CACHE" not in outside
    # end to end: a cache root under a file, through opd-prepare (one line, exit 2, no traceback)
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path / "afile" / "cache"))
    assert prepare_main(["--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: the model cache cannot be written ({tmp_path / 'afile' / 'cache'}): ")
    assert f"allowed: OPD_EXP_CACHE set to a writable folder with free space (OPD_EXP_CACHE is {tmp_path / 'afile' / 'cache'})" in err


def test_a_full_cache_disk_while_copying_a_shipped_entry_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """``shutil.copytree`` gathers each file's failure into one ``shutil.Error`` list (no strerror):
    the line names the first file, why, and OPD_EXP_CACHE; the partial copy is removed."""
    import errno
    import functools
    import shutil

    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))
    copied = []

    def full_disk(src, dst, **kw):
        if copied:  # the first file fits, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        copied.append(dst)
        return shutil.copy2(src, dst, **kw)

    monkeypatch.setattr(cache.shutil, "copytree", functools.partial(shutil.copytree, copy_function=full_disk))
    assert prepare_main(["--quiet"]) == 2  # the default world: its tokenizer is copied from the package first
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "[(" not in err, err
    assert err.startswith(f"error: the model cache cannot be written ({tmp_path}/.tmp-embedded-tokenizer-")
    assert ": copying the shipped entry embedded-tokenizer-" in err and "No space left on device" in err
    assert err.rstrip().endswith(f"allowed: OPD_EXP_CACHE set to a writable folder with free space (OPD_EXP_CACHE is {tmp_path})")
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []  # no partial entry


@pytest.mark.parametrize(
    "damage, found",
    [
        (lambda e: (e / "weights.bin").write_bytes(b"x" * 100), "file weights.bin does not match its checksum"),
        (lambda e: (e / cache.MANIFEST).write_text("{trunc"), "no readable opd-exp-manifest.json (partial build?)"),
    ],
)
def test_a_damaged_entry_is_announced_as_damaged_not_as_a_changed_recipe(tmp_path, monkeypatch, damage, found):
    monkeypatch.setenv("OPD_EXP_CACHE", str(tmp_path))
    older, key = {"model": {"sft_steps": 5}}, {"model": {"sft_steps": 3}}
    cache.get_or_build("embedded-teacher", older, Builder())  # another recipe's entry, older
    entry = cache.get_or_build("embedded-teacher", key, Builder())
    damage(entry)
    line = prepare.build_announcement("teacher", _tiny(3), key)
    assert line == (
        f"opd-exp: building the embedded teacher once (3 SFT steps, under a minute on a laptop CPU): its cached entry is damaged "
        f"({found}): it is discarded and rebuilt from the same recipe; cached in {entry}"
    )
    assert "recipe differs" not in line
