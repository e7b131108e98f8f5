"""A local teacher is fingerprinted by its content, not only its path: replacing the weights in
the same folder is refused on resume, naming the teacher's hash; hub ids and prepared pairs
are fingerprinted by their id and recipe as before, and a checkpoint written before the hash
was kept still resumes."""

from __future__ import annotations

import shutil

from helpers.reliability import BASE, one_error_line, pair_args, run_cli
from opd_exp.runtime import fingerprint


def test_the_teacher_content_hash_follows_the_bytes_not_the_path(local_pair_dir, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(local_pair_dir / "teacher", teacher)
    first = fingerprint.teacher_content(str(teacher))
    assert first is not None and len(first) == 64
    (teacher / ".cache").mkdir()
    (teacher / ".cache" / "note").write_text("download bookkeeping")  # dot-files are not the model
    assert fingerprint.teacher_content(str(teacher)) == first
    weights = teacher / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert fingerprint.teacher_content(str(teacher)) != first
    for spec in ("embedded:teacher", "smollm2:teacher", "Qwen/Qwen2.5-Math-7B-Instruct", None):
        assert fingerprint.teacher_content(spec) is None
    # a checkpoint written before the hash was kept: not a difference
    stored = {"model_pair.teacher": str(teacher)}
    assert fingerprint.differences(stored, {**stored, fingerprint.TEACHER_CONTENT: first}) == {}


def test_replacing_the_teacher_weights_in_place_is_refused_on_resume(local_pair_dir, tmp_path, monkeypatch, capsys):
    pair = tmp_path / "pair"
    shutil.copytree(local_pair_dir, pair)
    run = tmp_path / "run"
    args = [*BASE, *pair_args(pair), "trainer.max_steps=1", f"hydra.run.dir={run}"]
    code, _out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    before = fingerprint.teacher_content(str(pair / "teacher"))
    weights = pair / "teacher" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # other weights, same folder, same file names
    weights.write_bytes(bytes(data))
    after = fingerprint.teacher_content(str(pair / "teacher"))
    code, _out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2
    assert one_error_line(err) == (
        f"opd-train: error: hydra.run.dir: {run} holds a run made with other settings "
        f"({fingerprint.TEACHER_CONTENT}: {before!r} -> {after!r}); allowed: the same settings to resume it, "
        f"checkpoint.extend=true to continue it with these (recorded in history.yaml), or a new hydra.run.dir"
    )
