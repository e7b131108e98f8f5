"""Safety: remote code only when configured, weights never unpickled (safetensors, or
torch.load(weights_only=True) for optimizer/RNG state), no credentials in the run folder."""

from __future__ import annotations

import ast
import hashlib
import json
import pickle
from pathlib import Path

import pytest

from helpers.reliability import BASE, pair_args, run_in_process
from helpers.tiny import AddTask, small_config
from opd_exp.runtime import checkpoint
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.trainer import Trainer

PACKAGE = Path(__file__).resolve().parents[1] / "opd_exp"
FAKE_WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"
FAKE_HF_TOKEN = "hf_SeCrEtToKeN1234567890abcdef"


def _calls(name: str):
    """(file, call node) for every call of ``<something>.<name>(...)`` or ``<name>(...)`` in the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if called == name:
                    yield path.relative_to(PACKAGE.parent), node


def _kw(node, key):
    return next((k.value for k in node.keywords if k.arg == key), None)


def test_torch_load_is_always_weights_only():
    found = list(_calls("load"))
    loads = [(p, n) for p, n in found if isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", "") == "torch"]
    assert loads, "expected the checkpoint's torch.load calls"
    for path, node in loads:
        value = _kw(node, "weights_only")
        assert isinstance(value, ast.Constant) and value.value is True, f"{path}:{node.lineno} torch.load without weights_only=True"


def test_models_load_only_safetensors_and_remote_code_only_from_config():
    for path, node in _calls("from_pretrained"):
        owner = getattr(node.func.value, "id", "") if isinstance(node.func, ast.Attribute) else ""
        if "Model" in owner:
            value = _kw(node, "use_safetensors")
            assert isinstance(value, ast.Constant) and value.value is True, f"{path}:{node.lineno} model load without use_safetensors=True"
        trust = _kw(node, "trust_remote_code")
        assert not (isinstance(trust, ast.Constant) and trust.value), f"{path}:{node.lineno} trust_remote_code hard-coded on"


def test_trust_remote_code_reaches_transformers_only_as_configured(local_pair_dir, monkeypatch):
    import transformers

    from opd_exp.config.world import ModelPairConfig
    from opd_exp.pairs import load_pair

    seen = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = cls.from_pretrained.__func__

        def spy(klass, *a, _real=real, **kw):
            seen.append((klass.__name__, kw.get("trust_remote_code", False), kw.get("use_safetensors")))
            return _real(klass, *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    for trust in (False, True):
        seen.clear()
        load_pair(
            ModelPairConfig(student=str(local_pair_dir / "student"), teacher=str(local_pair_dir / "teacher"), trust_remote_code=trust)
        )
        assert seen and all(t is trust for _, t, _ in seen), seen
        assert all(s is True for name, _, s in seen if "Model" in name)


class _Payload:
    """Runs code when unpickled (what a tampered checkpoint would carry)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_tampered_optimizer_file_is_refused_not_executed(tiny_pair, tmp_path):
    cfg = small_config(trainer={"max_steps": 2, "keep_checkpoints": 1})
    Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask()).run()
    ckpt = checkpoint.latest(tmp_path)
    marker = tmp_path / "pwned"
    with open(ckpt / "optimizer.pt", "wb") as f:
        pickle.dump({"optimizer": _Payload(marker)}, f, protocol=2)
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())  # an attacker fixes size and hash too
    manifest["files"]["optimizer.pt"] = {
        "size": (ckpt / "optimizer.pt").stat().st_size,
        "sha256": hashlib.sha256((ckpt / "optimizer.pt").read_bytes()).hexdigest(),
    }
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    t = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    lines = []
    t.warn = lines.append
    with pytest.raises(ConfigError, match="no checkpoint in .* can be loaded"):
        t.run()
    assert not marker.exists()  # the payload never ran
    assert lines and "cannot be loaded" in lines[0]


def _files_containing(root: Path, needles) -> list[str]:
    hits = []
    for f in root.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            hits += [f"{f.relative_to(root)}: {n[:6]}..." for n in needles if n.encode() in data]
    return hits


def test_no_credentials_in_the_run_folder(local_pair_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    monkeypatch.setenv("HF_TOKEN", FAKE_HF_TOKEN)
    run = tmp_path / "run"
    # A key pasted as an override: refused (unknown key), but Hydra has already written .hydra/.
    code, _, err = run_in_process(
        pair_args(local_pair_dir) + BASE + ["trainer.max_steps=1", "+logger.api_key=pasted-key-4242"], run, monkeypatch, capsys
    )
    assert code == 2 and "logger.api_key: unknown key" in err
    code, _, err = run_in_process(
        pair_args(local_pair_dir) + BASE + ["trainer.max_steps=2", "checkpoint.every=1", f"name=run-{FAKE_HF_TOKEN}"],
        run,
        monkeypatch,
        capsys,
    )
    assert code == 0, err
    assert (run / ".hydra" / "config.yaml").is_file() and list(run.glob("checkpoints/step_*/state.json"))
    assert _files_containing(run, [FAKE_WANDB_KEY, FAKE_HF_TOKEN, "pasted-key-4242"]) == []
    assert "<redacted>" in (run / ".hydra" / "overrides.yaml").read_text()
    assert "max_new_tokens: 6" in (run / ".hydra" / "config.yaml").read_text()  # only credentials are redacted


@pytest.mark.slow
def test_no_credentials_in_the_wandb_offline_run(local_pair_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    monkeypatch.setenv("HF_TOKEN", FAKE_HF_TOKEN)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    args = [a for a in pair_args(local_pair_dir) + BASE if a != "logger=none"]
    code, _, err = run_in_process(args + ["logger=wandb", "logger.mode=offline", "trainer.max_steps=1"], run, monkeypatch, capsys)
    assert code == 0, err
    assert list((run / "wandb").glob("offline-run-*"))
    assert _files_containing(run, [FAKE_WANDB_KEY, FAKE_HF_TOKEN]) == []
