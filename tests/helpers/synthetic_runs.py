"""Synthetic opd-train multirun folders (the trainer's folder contract, made-up numbers)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

# variant overrides -> (final eval accuracy at seed 0, final eval jsd at seed 0)
VARIANTS = {
    ("divergence=rkl",): (0.50, 0.020),
    ("divergence=jsd", "divergence.beta=0.5"): (0.60, 0.010),
}
SEEDS = (0, 1, 2)
STEPS = 4
STEP_S = {0: 0.5, 1: 0.25, 2: 0.25}  # seconds per step by seed -> steps/s 2, 4, 4


def final_accuracy(base: float, seed: int) -> float:
    return base + 0.01 * seed


def metrics_rows(base_acc: float, base_jsd: float, seed: int, steps: int = STEPS) -> list[dict]:
    """Step 0 is the eval before training (eval keys only), as opd-train logs it."""
    rows = [
        {"step": 0, "eval/accuracy": 0.1, "eval/jsd": 0.5, "eval/kl_reverse": 1.0, "eval/kl_forward": 1.2, "eval/teacher_accuracy": 0.9}
    ]
    for step in range(1, steps + 1):
        frac = step / steps
        row = {
            "step": step,
            "jsd/mean": 0.4 * (1 - frac) + 0.01 * seed,
            "kl/reverse": 0.8 * (1 - frac) + 0.02 * seed,
            "kl/forward": 0.9 * (1 - frac),
            "loss": 0.8 * (1 - frac),
            "advantages/mean": -0.1,
            "student/logprob_mean": -1.0,
            "teacher/logprob_mean": -1.2,
            "response/length_mean": 3.0,
            "student/entropy": 1.5,
            "perf/tokens_per_s": 100.0,
            "perf/step_s": STEP_S[seed],
        }
        if step % 2 == 0:  # eval every 2 steps (and at the last)
            acc = final_accuracy(base_acc, seed) if step == steps else 0.3
            row.update(
                {
                    "eval/accuracy": acc,
                    "eval/jsd": base_jsd * (1 + seed) if step == steps else 0.2,
                    "eval/kl_reverse": 0.1 + 0.01 * seed,
                    "eval/kl_forward": 0.12,
                }
            )
        rows.append(row)
    return rows


def write_run(run_dir: Path, overrides: list[str], rows: list[dict] | None, seed: int = 0) -> Path:
    """A Hydra job folder: .hydra/{overrides,config}.yaml and (unless rows is None) metrics.jsonl."""
    hydra = run_dir / ".hydra"
    hydra.mkdir(parents=True, exist_ok=True)
    (hydra / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (hydra / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "trainer": {"max_steps": STEPS}}))
    if rows is not None:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def write_multirun(root: Path, *, steps: int = STEPS) -> Path:
    """multirun/<date>/<time>/<job>/ with 2 variants x 3 seeds (jobs 0..5, seeds innermost),
    plus a shared override that every job carries, like one given once on the command line."""
    folder = root / "multirun" / "2025-01-01" / "12-00-00"
    job = 0
    for variant, (acc, jsd) in VARIANTS.items():
        for seed in SEEDS:
            overrides = [*variant, f"seed={seed}", f"trainer.max_steps={steps}"]
            write_run(folder / str(job), overrides, metrics_rows(acc, jsd, seed, steps), seed)
            job += 1
    (folder / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"mode": "MULTIRUN"}}))
    return folder
