"""Measure the embedded world's targets from a cold cache (issue 3).

    python benchmarks/prepare_world.py [--cache DIR] [--n-eval N] [overrides ...]

Builds the tokenizer, teacher and student into an empty cache folder (a fresh temporary
one unless --cache is given), then evaluates both models greedily on the task's eval set and
prints a table: preparation time, teacher accuracy, student accuracy (and its ratio to the
teacher's) and the student's format rate, each against its target. Overrides are the same
``model_pair.embedded.*`` / ``task.*`` keys ``opd-prepare`` accepts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--cache", default=None, help="cache folder (default: a new temporary folder = cold cache)")
    parser.add_argument("--n-eval", type=int, default=0, help="eval problems to score (0 = the task's n_eval)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    os.environ["OPD_EXP_CACHE"] = args.cache or tempfile.mkdtemp(prefix="opd-exp-cold-")

    from opd_exp.cli.prepare import _parse_overrides
    from opd_exp.pairs.embedded import cache
    from opd_exp.pairs.embedded.models import load_model
    from opd_exp.pairs.embedded.prepare import prepare_embedded, torch_threads, world_task_config
    from opd_exp.pairs.embedded.tokenizer import load_tokenizer
    from opd_exp.tasks.arithmetic import ArithmeticTask
    from opd_exp.training.evaluate import evaluate_accuracy

    pair_cfg, task_cfg = _parse_overrides(args.overrides)
    cold = not any(p.name.startswith("embedded-") for p in cache.cache_root().glob("*")) if cache.cache_root().exists() else True
    started = time.perf_counter()
    prepared = prepare_embedded(pair_cfg.embedded, task_cfg, progress=not args.quiet)
    prep_s = time.perf_counter() - started

    task = ArithmeticTask(world_task_config(task_cfg))
    problems = task.eval_problems()[: args.n_eval or None]
    tokenizer = load_tokenizer(prepared.tokenizer)
    max_new = max(len(p.solution) for p in problems) + 8
    scores = {}
    with torch_threads(pair_cfg.embedded.threads):
        for role in ("teacher", "student"):
            model = load_model(getattr(prepared, role))
            scores[role] = evaluate_accuracy(model, tokenizer, task, problems, batch_size=256, max_new_tokens=max_new)
    t, s = scores["teacher"], scores["student"]
    ratio = s["accuracy"] / t["accuracy"] if t["accuracy"] else float("nan")
    rows = [
        ("preparation time (s)" + ("" if cold else ", WARM cache"), f"{prep_s:.1f}", "<= 300", prep_s <= 300),
        ("teacher greedy accuracy", f"{t['accuracy']:.3f}", ">= 0.95", t["accuracy"] >= 0.95),
        ("student greedy accuracy", f"{s['accuracy']:.3f}", "", True),
        ("student / teacher accuracy", f"{ratio:.3f}", "<= 0.5", ratio <= 0.5),
        ("student format rate", f"{s['format_rate']:.3f}", ">= 0.90", s["format_rate"] >= 0.9),
        ("teacher format rate", f"{t['format_rate']:.3f}", "", True),
    ]
    print(f"\ncache: {cache.cache_root()}   eval problems: {len(problems)}   cpus: {os.cpu_count()}")
    for role in ("teacher", "student"):
        i = prepared.info[role]
        print(f"{role}: {i['params']} params, SFT {i['sft_seconds']} s")
    print(f"\n| {'measure':<34} | {'value':>8} | {'target':>8} | ok  |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 10}|-----|")
    for name, value, target, ok in rows:
        print(f"| {name:<34} | {value:>8} | {target:>8} | {'yes' if ok else 'NO':<3} |")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
