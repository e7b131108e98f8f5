"""What the lab's table scripts (``benchmarks/lab_*.py``) share: a refusal in one line, and the
finished runs of sweep folders grouped by arm and seed."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NoReturn

from opd_exp.analysis.runs import AnalysisError, Run, load_runs


def lab_fail(script: str, line: str) -> NoReturn:
    """A lab script's refusal (a missing or empty folder, another world's runs): ``<script>: <line>``,
    one line on stderr, exit code 2."""
    print(f"{script}: {line}", file=sys.stderr)
    sys.exit(2)


def lab_arms(
    folders: Iterable[str | Path], script: str, allowed: str, *, metrics: Sequence[str] = (), world: str = ""
) -> dict[str, dict[int, Run]]:
    """{arm: {seed: run}} over every finished run of the folders, pooled (an arm is the job's
    ``variant`` override, else its variant label). Refused through ``lab_fail``, each line ending
    in ``; <allowed>``: a folder that cannot be read or holds no finished run, and a run that logs
    no final value of one of ``metrics`` (``not a run of <world>``: another world's, or another sweep's)."""
    out: dict[str, dict[int, Run]] = {}
    for folder in folders:
        try:
            runs = load_runs(folder)
        except AnalysisError as exc:  # no such folder, not a folder, no metrics.jsonl under it
            lab_fail(script, f"{exc}; {allowed}")
        finished = [r for r in runs if r.finished]
        if not finished:
            lab_fail(script, f"{folder}: no finished run ({len(runs)} still running or stopped); {allowed}")
        for r in finished:
            missing = [m for m in metrics if r.final(m) is None]
            if missing:
                recorded = ", ".join(f"{k}={r.choices[k]}" for k in ("sweep", "model_pair") if k in r.choices) or "no sweep recorded"
                lab_fail(script, f"{r.path}: logs no {missing[0]} ({recorded}): not a run of {world}; {allowed}")
            out.setdefault(r.overrides.get("variant", r.variant), {})[r.seed] = r
    return out
