"""Lab tables with paired differences (docs/lab.md: lab_reward_vs_opd*, lab_on_policy_mismatch).

    python benchmarks/lab_ci.py multirun/lab_reward_vs_opd/embedded_warm [more sweep folders] \\
        [--base opd] [--at 0.2 --at 0.25] [--metric eval/accuracy ...]

Per folder: final eval values per arm, mean ± 95% CI over seeds (Student's t); the mean eval
accuracy over all evals after step 0 (the area under the curve, less noisy than one eval); per
seed the first eval step whose greedy accuracy reaches each ``--at`` level ("-" if it never
does), and each arm's difference from the ``--base`` arm, paired by seed (the two runs of a seed
share the seed of their prompt order and sampling), mean ± 95% CI. An arm is its sweep override without
``variant=`` (``opd``, ``rollout.on_policy_fraction=0.0``). The pairing of arms with their base
and the per-seed differences are the package's (``opd_exp.analysis.base_variants`` and
``paired``, as ``opd-compare --base`` uses them); this script keeps the lab's table layout.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from opd_exp.analysis import AnalysisError, base_variants, first_reach, group_by_variant, load_runs, paired
from opd_exp.analysis import format_ci95 as ci95

METRICS = ["eval/accuracy", "eval/kl_reverse", "eval/kl_forward", "reward/mean"]


def label(variant: str) -> str:
    return variant.replace("variant=", "")


def mean_after_start(run, metric: str = "eval/accuracy") -> float | None:
    """Mean of the metric over the evals after step 0."""
    xs = [v for s, v in run.get(metric) if s > 0]
    return sum(xs) / len(xs) if xs else None


def final_mean(run, metric: str, last: int = 50) -> float | None:
    """A per-step training metric (reward/mean) averaged over its last ``last`` logged steps."""
    xs = [v for _, v in run.get(metric)][-last:]
    return sum(xs) / len(xs) if xs else None


def reach_accuracy(run, level: float) -> int | None:
    return first_reach(run, "eval/accuracy", ">=", level)


def report(folder: Path, levels: list[float], metrics: list[str], base_arm: str) -> None:
    try:
        runs = load_runs(folder)
    except AnalysisError as exc:
        raise SystemExit(f"lab_ci: {exc}") from None
    unfinished = [f"{r.path.name} ({r.status()})" for r in runs if not r.finished]
    if unfinished:  # a job still running (or stopped) would enter the table with its last eval
        raise SystemExit(f"{folder}: unfinished jobs, no table: {', '.join(unfinished)}")
    groups = {label(k): v for k, v in group_by_variant(runs).items()}
    if "=" not in base_arm and base_arm not in groups:  # a typo would silently drop the differences
        raise SystemExit(f"--base {base_arm!r}: no such arm in {folder}; arms: {', '.join(groups)}")
    print(f"\n## {folder}\n")
    head = ["arm", "seeds", "step 0 accuracy", *metrics, "mean accuracy over the evals after step 0"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for arm, rs in groups.items():
        cells = [ci95([(final_mean(r, m) if m.startswith("reward/") else r.final(m)) for r in rs]) for m in metrics]
        row = [arm, ",".join(str(r.seed) for r in rs), ci95([r.first("eval/accuracy") for r in rs]), *cells]
        print("| " + " | ".join([*row, ci95([mean_after_start(r) for r in rs])]) + " |")
    if levels:
        print("\nfirst eval step with greedy accuracy >= level, per seed:\n")
        head = ["arm", *[f">= {x:g}" for x in levels]]
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for arm, rs in groups.items():
            cells = [", ".join(str(reach_accuracy(r, x)) if reach_accuracy(r, x) is not None else "-" for r in rs) for x in levels]
            print("| " + " | ".join([arm, *cells]) + " |")
    try:
        bases = base_variants(groups, base_arm)
    except AnalysisError as exc:  # KEY=VALUE that no arm of this folder sets: no differences here
        print(f"\nno differences from {base_arm}: {exc}")
        bases = {}
    diffs = [(arm, groups[arm], base) for arm, base in bases.items()]
    if diffs:
        print(f"\ndifference from {base_arm}, per seed, then mean ± 95% CI:\n")
        head = ["arm", "final accuracy", "mean accuracy over the evals after step 0", "final eval/kl_reverse"]
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for arm, rs, base in diffs:
            cols = []
            for get in (lambda r: r.final("eval/accuracy"), mean_after_start, lambda r: r.final("eval/kl_reverse")):
                d, _, _ = paired(rs, groups[base], get)
                cols.append(f"{ci95(d)} ({', '.join(f'{x:+.3f}' for x in d)})")
            print("| " + " | ".join([arm, *cols]) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--at", type=float, action="append", default=None, help="accuracy levels for 'steps to reach'")
    p.add_argument("--metric", action="append", default=None)
    p.add_argument(
        "--base", default="opd", help="the arm the per-seed differences are taken from, or key=value: each arm with that key set so"
    )
    args = p.parse_args()
    for folder in args.folders:
        report(folder, args.at or [0.2], args.metric or METRICS, args.base)


if __name__ == "__main__":
    main()
