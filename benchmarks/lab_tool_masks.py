"""lab_tool_masks's table (docs/lab.md): per arm, the final eval on the tool world's greedy episodes
and what the student writes in its own turns, mean ± 95% CI over seeds (Student's t).

    python benchmarks/lab_tool_masks.py multirun/lab_tool_masks/embedded_tool [more sweep folders ...]

Columns: ``eval/accuracy`` (final), ``eval/tools/result_used_rate`` (of the episodes the calculator
answered with a number, the share whose answer is its result), ``eval/tools/self_result_rate`` (the
share of episodes whose own turns write ``<result>``: the tool's text, which only the calculator
should write), and ``tools/self_result_rate`` over the training episodes (the mean of the run's
last quarter of steps, temperature 1). Runs of several folders (the sweep, fresh seeds) are pooled
by arm.
"""

from __future__ import annotations

import sys
from functools import partial

from opd_exp.analysis import format_ci95 as ci95
from opd_exp.analysis import lab_arms, lab_fail

EVAL = ("eval/accuracy", "eval/tools/result_used_rate", "eval/tools/self_result_rate")
TRAIN = "tools/self_result_rate"
ALLOWED = "allowed: folders of `opd-train -m sweep=lab_tool_masks` (multirun/lab_tool_masks/embedded_tool)"


fail = partial(lab_fail, "lab_tool_masks")


def late_mean(run, metric: str) -> float:
    """The mean of ``metric`` over the run's last quarter of logged steps (at least one)."""
    values = [v for _, v in run.get(metric)]
    tail = values[len(values) - max(1, len(values) // 4) :]
    return sum(tail) / len(tail)


def main(folders) -> None:
    # a run without the tool metrics (another world's, or another sweep's) is refused
    by_arm = lab_arms(folders, "lab_tool_masks", ALLOWED, metrics=(*EVAL, TRAIN), world="the tool world")
    step = max(r.last_step() for runs in by_arm.values() for r in runs.values())
    print(f"final eval (step {step}; greedy episodes), mean ± 95% CI over seeds\n")
    head = ["arm", "seeds", *EVAL, "train tools/self_result_rate (last quarter)"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for arm, runs in by_arm.items():
        rs = [runs[s] for s in sorted(runs)]
        cells = [arm, ",".join(map(str, sorted(runs)))]
        cells += [ci95(r.final(m) for r in rs) for m in EVAL]
        cells.append(ci95(late_mean(r, TRAIN) for r in rs))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        fail(f"no folder given; usage: {__doc__.strip().splitlines()[3].strip()}")
    main(sys.argv[1:])
