"""Asynchronous OPD against the synchronous loop, side by side in one run: steps per second of
`rollout.staleness` 0 / 1 / 2 (correction=recompute) on the embedded default world, each a fresh
`opd-train` process (one torch thread per op: the producer thread and the learner can use one core
each), implementations interleaved over repetitions, wall and CPU time, medians.

    python benchmarks/staleness_step.py                      # defaults: --repeats 3 --steps 12 --warmup 2
    python benchmarks/staleness_step.py --repeats 2 --steps 8 --staleness 0 1

Per row: the median wall seconds per step after the warm-up steps (perf/step_s), steps/s, the CPU
seconds per step of the process (user + sys, over the whole process / steps: start-up included, the
same for every row), the learner's phases of the synchronous run (generate, teacher, train, sync,
wait; medians) and, for k > 0, the learner's wait for the producer. The overlap floor is what a
perfect overlap could reach with one core for the producer and one for the learner:
max(generate, teacher + train + sync) of the synchronous run, the learner's phases being serial.
Every row must report the staleness it was asked for (`async/staleness` = min(step - 1, k)) or the
benchmark stops: it measures asynchronous runs, not the loop under another name.

``--sync-threads 2`` adds a row: the synchronous loop with two torch threads per op
(``scale.num_threads=2``), the fair rival where a model is large enough for one step to use both
cores (the asynchronous rows give each process one).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("generate", "teacher", "train", "sync", "wait")


def run_one(k: int, steps: int, folder: Path, extra: list[str], threads: int = 1) -> tuple[list[dict], float, float]:
    """One opd-train process at ``threads`` torch threads: (metric rows, wall s, CPU s of the child)."""
    cmd = [
        sys.executable, "-m", "opd_exp.cli.train", "logger=none", f"trainer.max_steps={steps}", "eval.every=0",
        "eval.size=8", "checkpoint.every=0", "trainer.progress=false", f"rollout.staleness={k}",
        *(["rollout.correction=recompute"] if k else []), f"scale.num_threads={threads}", *extra, f"hydra.run.dir={folder}",
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "loss" in r], wall, cpu


def check_staleness(rows: list[dict], k: int) -> None:
    got = [int(r.get("async/staleness", 0)) for r in rows]
    want = [min(i, k) for i in range(len(rows))]
    if got != want:
        sys.exit(f"staleness_step: the staleness={k} run logged async/staleness {got}, not {want}: not what this benchmark measures")


def summarise(runs: list[tuple[list[dict], float, float]], warmup: int, steps: int) -> dict:
    step_s = [statistics.median(r["perf/step_s"] for r in rows[warmup:]) for rows, _, _ in runs]
    out = {
        "wall_step_s": statistics.median(step_s),
        "wall_step_s_range": (min(step_s), max(step_s)),
        "cpu_step_s": statistics.median(cpu / steps for _, _, cpu in runs),
        "loss_last": statistics.median(rows[-1]["loss"] for rows, _, _ in runs),
    }
    for p in PHASES:
        out[p] = statistics.median(statistics.median(r.get(f"perf/{p}_s", 0.0) for r in rows[warmup:]) for rows, _, _ in runs)
    out["learner_wait_s"] = statistics.median(
        statistics.median(r.get("async/learner_wait_s", 0.0) for r in rows[warmup:]) for rows, _, _ in runs
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sync-threads", type=int, nargs="*", default=[], help="extra synchronous rows at these torch threads")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("extra", nargs="*", help="opd-train overrides for every row (e.g. model_pair=smollm2)")
    a = ap.parse_args(argv)
    if a.steps <= a.warmup:
        sys.exit(f"staleness_step: --steps={a.steps} is not allowed; allowed: more than --warmup={a.warmup}")
    rows_wanted = [(k, 1) for k in a.staleness] + [(0, t) for t in a.sync_threads if t != 1]
    runs: dict[tuple[int, int], list] = {key: [] for key in rows_wanted}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):  # interleaved: each repetition runs every row once
            for k, t in rows_wanted:
                rows, wall, cpu = run_one(k, a.steps, Path(tmp) / f"k{k}_t{t}_r{rep}", a.extra, threads=t)
                check_staleness(rows, k)
                runs[(k, t)].append((rows, wall, cpu))
    table = {key: summarise(v, a.warmup, a.steps) for key, v in runs.items()}
    base = table[rows_wanted[0]]
    floor = max(base["generate"], base["teacher"] + base["train"] + base["sync"])
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; {a.repeats} repetitions x {a.steps} steps, warm-up {a.warmup}")
    print(
        "| rollout.staleness | threads | wall s/step median [range] | steps/s | x first row | CPU s/step | learner wait s | loss (last) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (k, threads), t in table.items():
        lo, hi = t["wall_step_s_range"]
        print(
            f"| {k} | {threads} | {t['wall_step_s']:.3f} [{lo:.3f}, {hi:.3f}] | {1 / t['wall_step_s']:.2f} | "
            f"{base['wall_step_s'] / t['wall_step_s']:.2f} | {t['cpu_step_s']:.3f} | {t['learner_wait_s']:.3f} | {t['loss_last']:.4g} |"
        )
    print(
        f"synchronous phases (s/step, first row): generate {base['generate']:.3f}, teacher {base['teacher']:.3f}, train "
        f"{base['train']:.3f}, sync {base['sync']:.3f}; overlap floor max(generate, teacher + train + sync) = {floor:.3f} "
        f"({base['wall_step_s'] / floor:.2f}x the synchronous step at best)"
    )
    if a.json:
        Path(a.json).write_text(json.dumps({"table": {f"{k}@{t}": v for (k, t), v in table.items()}, "floor_s": floor}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
