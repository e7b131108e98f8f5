"""Which learning rates let an estimator learn on the embedded pair: short runs, eval curves.

    OMP_NUM_THREADS=1 python benchmarks/sampled_lr.py [--steps 120 --every 40 --size 100 --seeds 0 1 2] \\
        --run "sampled+baseline lr=3e-3: estimator=sampled loss=ppo divergence=rkl trainer.lr=3e-3" \\
        --run "full lr=3e-3: divergence=rkl trainer.lr=3e-3" [--out results.json]

Each ``--run`` is ``label: opd-train overrides``; every label runs once per seed, one after the
other, one thread each (``opd-train ... trainer.max_steps=STEPS eval.every=EVERY
eval.size=SIZE checkpoint.every=0 logger=none``, its own run folder under a temporary
directory; ``--stop-after N`` ends it after its eval at step N: the steps before are the full
run's, as the schedule follows ``trainer.max_steps``). Printed per run: the run's own eval divergence (``eval/<divergence>``) before
training -> at each eval, and whether it "learns": below its value before training at every eval
after the first (the bar of docs/training.md, "Learning rate and variance per estimator").
``--out`` writes every run's eval rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_one(overrides: list[str], seed: int, args, folder: Path) -> dict:
    """One opd-train run: its eval rows {step: {eval/...}} and the name of its own divergence."""
    cmd = [
        sys.executable,
        "-m",
        "opd_exp.cli.train",
        *overrides,
        f"seed={seed}",
        f"trainer.max_steps={args.steps}",
        f"eval.every={args.every}",
        f"eval.size={args.size}",
        "checkpoint.every=0",
        "trainer.progress=false",
        "logger=none",
        f"hydra.run.dir={folder}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    t0, cpu0 = time.perf_counter(), os.times()
    log = (folder.parent / f"{folder.name}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    stopped = False
    while proc.poll() is None:
        time.sleep(2)
        if args.stop_after and _evaluated_at(folder / "metrics.jsonl", args.stop_after):
            proc.kill()  # the steps so far are the whole run's (the schedule is max_steps'): the rest is not needed
            proc.wait()
            stopped = True
    cpu1 = os.times()
    log.close()
    if proc.returncode != 0 and not stopped:
        tail = (folder.parent / f"{folder.name}.log").read_text().strip().splitlines()[-1:]
        raise SystemExit(f"sampled_lr: {' '.join(cmd)} failed ({proc.returncode}): {tail}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    warnings = [line for line in (folder.parent / f"{folder.name}.log").read_text().splitlines() if "opd-train: warning: eval/" in line]
    evals = {int(r["step"]): {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows if any(k.startswith("eval/") for k in r)}
    return {
        "evals": evals,
        "warnings": warnings,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": (cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system),
    }


def _evaluated_at(metrics: Path, step: int) -> bool:
    """Whether the run has logged its evaluation at ``step`` (or later)."""
    if not metrics.is_file():
        return False
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if int(row.get("step", -1)) >= step and any(k.startswith("eval/") for k in row):
            return True
    return False


def own_key(overrides: list[str], evals: dict) -> str:
    """eval/<divergence> of the run (the trained divergence's eval value)."""
    name = next((o.split("=", 1)[1] for o in overrides if o.startswith("divergence=")), "fkl")
    return f"eval/{name}"


def learns(curve: list[float]) -> bool:
    """Below the value before training at every eval after it."""
    return len(curve) > 1 and all(v < curve[0] for v in curve[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, help='"label: overrides ..."')
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=40)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--stop-after", type=int, default=0, help="end each run after its eval at this step (0: run to the end)")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="sampled_lr_") as tmp:
        for spec in args.run:
            label, _, rest = spec.partition(":")
            overrides = rest.split()
            for seed in args.seeds:
                out = run_one(overrides, seed, args, Path(tmp) / f"{len(results)}")
                key = own_key(overrides, out["evals"])
                curve = [out["evals"][s][key] for s in sorted(out["evals"])]
                ok = learns(curve)
                text = f"{curve[0]:.3f} -> " + " / ".join(f"{v:.3f}" for v in curve[1:])
                said = " | warned" if out["warnings"] else ""
                print(
                    f"{label.strip()} | seed {seed} | {key} {text} | {'learns' if ok else 'no'} | {out['cpu_s']:.0f} CPU s{said}",
                    flush=True,
                )
                results.append(
                    {"label": label.strip(), "overrides": overrides, "seed": seed, "key": key, "curve": curve, "learns": ok, **out}
                )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
