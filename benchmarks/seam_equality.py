"""Short runs on the embedded pair, recorded before a refactor and compared after it: a change of
structure must leave them equal on one machine (1e-6 relative), per step, for every logged metric.

    python benchmarks/seam_equality.py --record /tmp/before.json      # on the old code
    python benchmarks/seam_equality.py --compare /tmp/before.json     # on the new code

The runs are the ones the seams review names (the default and six variants), 3 steps each, no
eval in between, logger off; every number in metrics.jsonl except times is compared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS: dict[str, list[str]] = {
    "default": [],
    "ppo_jsd_sequence": [
        "estimator=sampled",
        "loss=ppo",
        "divergence=jsd",
        "divergence.beta=0.3",
        "loss.credit=sequence",
        "loss.gamma=0.9",
    ],
    "on_policy_half": ["rollout.on_policy_fraction=0.5", "divergence=rkl"],
    "ppo_epochs": ["estimator=sampled", "loss=ppo", "loss.ppo_epochs=2", "loss.ppo_mini_batches=2"],
    "reward": ["reward.coef=0.5", "rollout.n_samples=2"],
    "iw_opd": ["positions=iw_opd", "estimator=sampled", "loss=reinforce", "divergence=rkl"],
    "topk_union": ["estimator=topk_union", "estimator.k=8"],
}
COMMON = ["logger=none", "trainer.max_steps=3", "eval.every=0", "trainer.progress=false"]
TIMES = ("perf/", "time", "_s")


def run_one(overrides: list[str], folder: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "opd_exp.cli.train", *COMMON, *overrides, f"hydra.run.dir={folder}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if isinstance(v, (int, float)) and not any(t in k for t in TIMES)} for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser()
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--record")
    g.add_argument("--compare")
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    names = a.only or list(RUNS)
    with tempfile.TemporaryDirectory() as tmp:
        got = {n: run_one(RUNS[n], Path(tmp) / n) for n in names}
    if a.record:
        Path(a.record).write_text(json.dumps(got, indent=1, sort_keys=True))
        print(f"recorded {len(got)} runs to {a.record}")
        return 0
    want, bad = json.loads(Path(a.compare).read_text()), 0
    for n in names:
        for i, (w, h) in enumerate(zip(want[n], got[n], strict=True)):
            for k, v in w.items():
                x = h.get(k)
                if x is None or not math.isclose(x, v, rel_tol=a.rtol, abs_tol=1e-12):
                    bad += 1
                    print(f"{n} row {i} {k}: before {v!r} after {x!r}")
            for k in sorted(set(h) - set(w)):
                print(f"{n} row {i}: new key {k}={h[k]!r}")
        print(f"{n}: {len(want[n])} rows compared")
    print("equal" if not bad else f"{bad} values differ")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
