"""Short reference runs whose per-step losses and eval metrics are pinned in
``tests/data/golden_runs.json``: a change of layout or speed must leave them equal."""

from __future__ import annotations

import json
from pathlib import Path

GOLDEN_FILE = Path(__file__).resolve().parent.parent / "data" / "golden_runs.json"

# name -> config groups (on top of the tiny test config; every run evaluates at steps 0, 2, 4)
GOLDEN_RUNS: dict[str, dict] = {
    "default": {},
    "sampled_ppo_jsd_sequence": dict(
        estimator={"name": "sampled"},
        loss={"name": "ppo", "credit": "sequence", "gamma": 1.0},
        divergence={"name": "jsd", "beta": 0.5},
    ),
    "on_policy_half": dict(rollout={"on_policy_fraction": 0.5}),
}

STEP_KEYS = ("loss", "jsd/mean", "kl/reverse", "kl/forward", "grad/norm")
EVAL_KEYS = ("eval/accuracy", "eval/jsd", "eval/kl_reverse", "eval/kl_forward")


def golden_groups(name: str) -> dict:
    groups = {g: dict(v) for g, v in GOLDEN_RUNS[name].items()}
    groups.setdefault("trainer", {}).update(max_steps=4, eval_every=2)
    # Recorded with HF generate drawing from torch's global RNG: another engine draws other
    # (equally distributed) tokens, so the pinned runs name theirs.
    groups.setdefault("rollout", {}).setdefault("engine", "hf")
    return groups


def read_record(run_dir: Path) -> dict[str, list]:
    """The pinned numbers of a finished run folder: per-step values and eval values."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    record: dict[str, list] = {}
    for r in rows:
        keys = EVAL_KEYS if "eval/accuracy" in r else ()
        keys = keys + (STEP_KEYS if r["step"] > 0 else ())
        for k in keys:
            if k in r:
                record.setdefault(k, []).append([r["step"], r[k]])
    return record
