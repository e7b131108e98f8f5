"""The importance weights and eval divergences of the stale arms (docs/lab.md: lab_staleness).

    python benchmarks/lab_staleness.py multirun/lab_staleness/embedded_multimodal [more sweep folders]

Per folder and arm, mean ± 95% CI over seeds (Student's t) of each run's mean over its trained
steps at full lag (``async/staleness`` = k; the first k steps ramp up) of ``async/is_weight_mean``
(the applied, truncated weight per trained token), ``async/is_weight_max`` (the step's largest
untruncated weight) and ``async/is_clip_frac``; the largest ``async/is_weight_max`` of the run;
and the mean of eval reverse and forward KL over the evals after step 0 (less noisy than the
final eval alone). How far the student moves per update decides whether a lag matters: weights
~1 mean the stale arms are the synchronous run. A synchronous arm (staleness 0) logs no weights.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from opd_exp.analysis import AnalysisError, group_by_variant, lab_fail, load_runs
from opd_exp.analysis import format_ci95 as ci95
from opd_exp.analysis.labels import paper_labels

fail = partial(lab_fail, "lab_staleness")


def at_full_lag(run, metric: str) -> list[float]:
    lag = dict(run.get("async/staleness"))
    k = max(lag.values(), default=0.0)
    return [v for s, v in run.get(metric) if k > 0 and lag.get(s) == k]


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def evals_after_start(run, metric: str) -> float | None:
    return mean([v for s, v in run.get(metric) if s > 0])


def report(folder: Path) -> None:
    try:
        runs = load_runs(folder)
    except AnalysisError as exc:
        fail(str(exc))
    unfinished = [f"{r.path.name} ({r.status()})" for r in runs if not r.finished]
    if unfinished:
        fail(f"{folder}: unfinished jobs, no table: {', '.join(unfinished)}")
    groups = group_by_variant(runs)
    labels = paper_labels(groups)
    head = [
        "arm",
        "seeds",
        "is_weight_mean",
        "is_weight_max (step mean)",
        "is_weight_max (run max)",
        "is_clip_frac",
        "eval/kl_reverse (mean of evals)",
        "eval/kl_forward (mean of evals)",
    ]
    print(f"\n## {folder}\n")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for variant, rs in groups.items():
        row = [
            labels[variant],
            ",".join(str(r.seed) for r in rs),
            ci95([mean(at_full_lag(r, "async/is_weight_mean")) for r in rs], 4),
            ci95([mean(at_full_lag(r, "async/is_weight_max")) for r in rs], 2),
            ci95([max(at_full_lag(r, "async/is_weight_max"), default=None) for r in rs], 1),
            ci95([mean(at_full_lag(r, "async/is_clip_frac")) for r in rs], 4),
            ci95([evals_after_start(r, "eval/kl_reverse") for r in rs]),
            ci95([evals_after_start(r, "eval/kl_forward") for r in rs]),
        ]
        print("| " + " | ".join(row) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path)
    for folder in p.parse_args().folders:
        if not folder.is_dir():
            fail(f"{folder}: no such folder (run opd-train -m sweep=lab_staleness first)")
        report(folder)


if __name__ == "__main__":
    main()
