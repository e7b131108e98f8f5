"""Credentials in other shapes and names than hf_/sk-/api_key: GitHub, AWS, Slack tokens and
*_KEY / *_PAT names are redacted in .hydra/, history.yaml, multirun.yaml and train.log, and a
W&B key pasted as logger.project is refused before W&B starts."""

from __future__ import annotations

import pytest

from helpers.reliability import BASE, pair_args, run_cli
from opd_exp.runtime.secrets import REDACTED, TOKEN_SHAPE, scrub, scrub_text, secret_values

GHP = "ghp_" + "A1b2C3d4E5" * 3 + "xyz789"  # 36 characters after the prefix
GITHUB_PAT = "github_pat_11ABCDEFG0123456789_" + "Zq" * 20
AWS = "AKIAIOSFODNN7EXAMPLE"
SLACK_BOT = "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOp"
SLACK_USER = "xoxp-123456789012-1234567890123-AbCdEfGhIjKl"
HF = "hf_" + "Q" * 34
SHAPES = [GHP, GITHUB_PAT, AWS, SLACK_BOT, SLACK_USER]
WANDB_KEY = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("token", SHAPES)
def test_token_shapes_are_redacted_wherever_they_appear(token):
    assert scrub_text(f"name: run-{token}\nnote={token},x", secrets=[]) == f"name: run-{REDACTED}\nnote={REDACTED},x"
    assert scrub({"tags": [f"t={token}"]}, secrets=[]) == {"tags": [f"t={REDACTED}"]}


def test_names_ending_in_key_or_pat_are_credentials_and_look_alikes_are_not():
    assert scrub_text("service_key: s3cr3t-v4lue\n+logger.github_pat=abcdef123\n", secrets=[]) == (
        f"service_key: {REDACTED}\n+logger.github_pat={REDACTED}\n"
    )
    env = {
        "GITHUB_PAT": "plain-value-1234",
        "MY_SERVICE_KEY": "another-value-99",
        "LD_LIBRARY_PATH": "/usr/lib/x86",
        "SORT_KEYS": "abcdefghij",
    }
    assert secret_values(env) == ["another-value-99", "plain-value-1234"]
    for text in ("exclude_keys: []", "max_new_tokens: 40", "LD_LIBRARY_PATH=/usr/lib", "kv_sep: ="):
        assert scrub_text(text, secrets=[]) == text
    assert not TOKEN_SHAPE.search("AKIAIOSFODNN7EXAMPLEX")  # 17 characters: not an access key id


def _leaks(folder, needles) -> list[str]:
    out = []
    for f in folder.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            out += [f"{f.name}: {n[:12]}" for n in needles if n.encode() in data]
    return out


def test_a_run_keeps_no_credential_in_its_records_or_train_log(local_pair_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MY_SERVICE_KEY", "svc-value-0042x")
    run = tmp_path / HF / "run"
    args = [*BASE, *pair_args(local_pair_dir), "trainer.max_steps=1", f"name=n-{GHP}", f"logger.tags=[{AWS},{SLACK_BOT}]"]
    args += [f"+task.note={GITHUB_PAT}", f"hydra.run.dir={run}"]
    code, _out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and "task.note: unknown key" in err  # refused after the folder's record was written
    assert (run / ".hydra" / "overrides.yaml").is_file()
    code, _out, err = run_cli([a for a in args if not a.startswith("+task.note")], monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert (run / "train.log").is_file() and (run / "history.yaml").is_file()
    assert f"run folder {tmp_path / REDACTED / 'run'}" in (run / "train.log").read_text()
    assert _leaks(run, [*SHAPES, HF, "svc-value-0042x"]) == []


def test_a_multirun_record_keeps_no_credential(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    args = ["-m", "trainer.batch_size=0", f"name=a-{GHP},b-{SLACK_USER}", f"logger.tags=[{AWS}]", f"hydra.sweep.dir={sweep}", "logger=none"]
    code, _out, _err = run_cli(args, monkeypatch, capsys)
    assert code == 2
    assert (sweep / "multirun.yaml").is_file()
    assert _leaks(sweep, SHAPES) == []


def test_a_w_and_b_key_pasted_as_the_project_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "run"
    code, _out, err = run_cli(
        ["logger=wandb", f"logger.project={WANDB_KEY}", "scale.device=cpu", f"hydra.run.dir={run}"], monkeypatch, capsys
    )
    assert code == 2
    assert err.strip().splitlines() == [
        "opd-train: error: logger.project: the value looks like a credential (an API key or token, not shown); allowed: a W&B project name"
    ]
    assert not (run / "wandb").exists()
    assert _leaks(run, [WANDB_KEY]) == []


def test_an_error_line_that_quotes_a_credential_prints_it_redacted():
    """A served teacher's URL (or any value an error line quotes) with a token in it: the line
    opd-train prints on stderr, which lands in CI logs, carries no credential."""
    from opd_exp.cli.errors import one_line
    from opd_exp.runtime.errors import ConfigError

    token = "ghp_" + "abcdefghijklmnopqrstuvwxyz0123456789"
    line = one_line(ConfigError(f"teacher.url=http://u:{token}@127.0.0.1:9 (model 'teacher'): cannot reach the server"))
    assert token not in line and line == f"teacher.url=http://u:{REDACTED}@127.0.0.1:9 (model 'teacher'): cannot reach the server"
