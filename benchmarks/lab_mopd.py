"""lab_mopd's tables (docs/lab.md): the student's final accuracy per domain and arm, its
teachers', and the routed student's gap to each expert, mean ± 95% CI over seeds.

    python benchmarks/lab_mopd.py multirun/lab_mopd/embedded_mopd [more sweep folders ...]

Every arm of ``sweeps/sweep/lab_mopd.yaml`` names two domains through ``teachers.map``
(``addsub``: the + and - prompts, ``mul``: the * prompts), so each run logs the student's eval
accuracy per domain (``eval/teacher/<domain>/accuracy``) and, at its first eval, the accuracy of
the teacher that domain was routed to (``eval/teacher/<domain>/teacher_accuracy``). The gaps are
paired by seed: (routed student) - (the domain's expert), and (routed student) - (another arm's
student). Runs of several folders (the sweep, fresh seeds) are pooled by arm.
"""

from __future__ import annotations

import sys
from functools import partial

from opd_exp.analysis import format_ci95 as ci95
from opd_exp.analysis import lab_arms, lab_fail

DOMAINS = ("addsub", "mul")
ROUTED = "mopd_routed"
ALLOWED = "allowed: folders of `opd-train -m sweep=lab_mopd` (multirun/lab_mopd/embedded_mopd)"


fail = partial(lab_fail, "lab_mopd")


def main(folders) -> None:
    # a run that logs no per-domain accuracy (another world's, or another sweep's) is refused
    metrics = [f"eval/teacher/{d}/accuracy" for d in DOMAINS]
    by_arm = lab_arms(folders, "lab_mopd", ALLOWED, metrics=metrics, world="the lab_mopd world")
    step = max(r.last_step() for runs in by_arm.values() for r in runs.values())
    print(f"final eval (step {step}), mean ± 95% CI over seeds\n")
    head = ["arm", "seeds", "student: + and -", "student: *", "student: all", "teacher of + and -", "teacher of *"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for arm, runs in by_arm.items():
        rs = [runs[s] for s in sorted(runs)]
        cells = [arm, ",".join(map(str, sorted(runs)))]
        cells += [ci95(r.final(f"eval/teacher/{d}/accuracy") for r in rs) for d in DOMAINS]
        cells.append(ci95(r.final("eval/accuracy") for r in rs))
        cells += [ci95(r.first(f"eval/teacher/{d}/teacher_accuracy") for r in rs) for d in DOMAINS]
        print("| " + " | ".join(cells) + " |")
    routed = by_arm.get(ROUTED)
    if not routed:
        return
    print("\npaired by seed: (routed student) - (other), per domain\n")
    print("| other | + and - | * |\n|---|---|---|")
    print("| " + " | ".join(["the domain's expert"] + [_gap(routed, routed, d, teacher=True) for d in DOMAINS]) + " |")
    for arm, runs in by_arm.items():
        if arm != ROUTED:
            print("| " + " | ".join([f"{arm} student"] + [_gap(routed, runs, d) for d in DOMAINS]) + " |")


def _gap(routed, other, domain: str, *, teacher: bool = False) -> str:
    seeds = sorted(set(routed) & set(other))
    key = f"eval/teacher/{domain}/accuracy"
    mine = [routed[s].final(key) for s in seeds]
    theirs = [other[s].first(f"eval/teacher/{domain}/teacher_accuracy") if teacher else other[s].final(key) for s in seeds]
    diffs = [a - b for a, b in zip(mine, theirs)]
    return f"{ci95(diffs)} (per seed: {', '.join(f'{d:+.3f}' for d in diffs)})"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        fail(f"no folder given; usage: {__doc__.strip().splitlines()[3].strip()}")
    main(sys.argv[1:])
