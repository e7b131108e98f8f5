"""Issue 36, "Elsewhere": edges that ran silently or ended in a traceback, each now one line
(or the documented notice). Each test runs in this process and asserts the exact line."""

from __future__ import annotations

from pathlib import Path

from helpers.reliability import run_cli
from opd_exp.config.folders import SWEEPS_DIR

ALLOWED_SWEEPS = ", ".join(sorted(p.stem for p in (SWEEPS_DIR / "sweep").glob("*.yaml")))


# -- hydra/launcher=dry ------------------------------------------------------------------------
def test_dry_launcher_without_multirun_acts_dry(tmp_path, monkeypatch, capsys):
    """Before: `opd-train hydra/launcher=dry` (no -m) trained for real. After: checked, one line, nothing written."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    code, out, err = run_cli(["hydra/launcher=dry", "logger=none", "trainer.max_steps=1", f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert code == 0, err
    assert out.strip() == "opd-train: dry run (one run, no -m): logger=none trainer.max_steps=1: ok; nothing trained, nothing written"
    assert not run.exists() and sorted(tmp_path.iterdir()) == []


def test_dry_launcher_without_multirun_refuses_a_bad_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["hydra/launcher=dry", "logger=none", "trainer.lr=-1"], monkeypatch, capsys)
    assert code == 2 and not out.strip()
    assert err.strip() == "opd-train: error: trainer.lr=-1.0 is not allowed; allowed: >= 0"
    assert sorted(tmp_path.iterdir()) == []


def test_dry_launcher_refuses_an_unknown_sweep(tmp_path, monkeypatch, capsys):
    """Before: `-m sweep=nonexistent_xyz hydra/launcher=dry` said "job #0 ... ok"; the real launcher's job refuses it."""
    monkeypatch.chdir(tmp_path)
    args = ["-m", "sweep=nonexistent_xyz", "hydra/launcher=dry", "logger=none", f"hydra.sweep.dir={tmp_path / 'sw'}"]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2
    line = f"sweep=nonexistent_xyz: no such option; allowed: {ALLOWED_SWEEPS}"
    assert out.strip() == f"opd-train: dry run: job #0 sweep=nonexistent_xyz logger=none: error: {line}"
    assert err.strip().startswith(f"opd-train: error: 1 of 1 jobs of the multirun failed: #0 (no folder: dry run): {line}")
    assert not Path(tmp_path / "sw").exists()


# -- credentials -------------------------------------------------------------------------------
HF = "hf_" + "Q" * 34
BEARER = "s3cr3t-Bearer-value-4242"


def _files_holding(folder: Path, needle: str) -> list[str]:
    return [str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file() and needle.encode() in f.read_bytes()]


def test_an_authorization_header_in_an_override_is_redacted_in_the_record(local_pair_dir, tmp_path, monkeypatch, capsys):
    """Before: `+teacher.headers.Authorization=Bearer ...` was kept verbatim in .hydra/ (refused as an
    unknown key after the record was written). After: `Bearer <redacted>`, on disk and on stderr."""
    from helpers.reliability import BASE, pair_args

    run = tmp_path / "run"
    args = [*pair_args(local_pair_dir), *BASE, f"+teacher.headers.Authorization=Bearer {BEARER}", f"hydra.run.dir={run}"]
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and err.strip().startswith("opd-train: error: teacher.headers: unknown key; allowed: ")
    assert (run / ".hydra" / "overrides.yaml").is_file()
    assert _files_holding(run, BEARER) == [] and BEARER not in err + out
    assert "+teacher.headers.Authorization=Bearer <redacted>" in (run / ".hydra" / "overrides.yaml").read_text()


def test_redaction_of_http_credentials_keeps_ordinary_words():
    from opd_exp.runtime.secrets import REDACTED, redact_line, scrub, scrub_text

    assert scrub_text(f"- name=Authorization: Bearer {BEARER}\n", secrets=[]) == f"- name=Authorization: Bearer {REDACTED}\n"
    assert redact_line("Authorization: Basic dXNlcjpwYXNzd29yZA==", secrets=[]) == f"Authorization: Basic {REDACTED}"
    assert scrub({"notes": f'-H "Authorization: Bearer {BEARER}"'}, secrets=[]) == {"notes": f'-H "Authorization: Bearer {REDACTED}"'}
    for text in ("a basic settings file", "per token averaged", "max_new_tokens: 40"):
        assert scrub_text(text, secrets=[]) == text


def test_a_token_in_the_run_folder_name_never_reaches_w_and_b(local_pair_dir, tmp_path, monkeypatch, capsys):
    """Before: hydra.run.dir=.../hf_.../run with logger=wandb wrote the token into wandb/debug.log and
    run-*.wandb. After: refused in one line before W&B starts (logger=none still runs there)."""
    from helpers.reliability import BASE, pair_args

    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / HF / "run"
    args = [a for a in pair_args(local_pair_dir) + BASE if a != "logger=none"] + ["logger=wandb", "logger.mode=offline"]
    code, out, err = run_cli([*args, f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert code == 2 and not out.strip()
    assert err.strip().splitlines() == [
        f"opd-train: error: hydra.run.dir={tmp_path / '<redacted>' / 'run'}: the run folder's path holds a credential (a token, "
        "not shown), and W&B records that path in its files (debug.log, run-*.wandb); allowed: a run folder whose path has no "
        "credential, or logger=none"
    ]
    assert not (run / "wandb").exists()
