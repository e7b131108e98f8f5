"""What a researcher meets at the command line: `--cfg` shows only a config that would run,
`variant=` without `+`, per-pair training defaults, a default run folder two starts cannot
share, and a lab pair refused with the wrong task."""

from __future__ import annotations

import pytest

from helpers.reliability import run_cli


@pytest.mark.parametrize(
    "args, line",
    [
        (["--cfg", "job", "divergence.beta=1.5"], "opd-train: error: divergence.beta=1.5 is not allowed; allowed: 0 <= beta <= 1"),
        (["-c", "all", "trainer.batch_size=0"], "opd-train: error: trainer.batch_size=0 is not allowed; allowed: integer >= 1"),
        (["--cfg", "job", "+trainer.nope=1"], "opd-train: error: trainer.nope: unknown key; allowed: "),
    ],
)
def test_cfg_shows_no_invalid_config(args, line, monkeypatch, capsys):
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2, (out, err)
    assert out == ""
    assert err.strip().splitlines()[0].startswith(line) and len(err.strip().splitlines()) == 1


def test_cfg_shows_a_valid_config(monkeypatch, capsys):
    code, out, err = run_cli(["--cfg", "job", "divergence=jsd", "divergence.beta=0.9"], monkeypatch, capsys)
    assert code == 0, err
    assert "beta: 0.9" in out
