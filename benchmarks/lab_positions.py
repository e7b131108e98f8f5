"""Tables of the position lab sweeps (docs/lab.md, lab_early_stop and lab_token_fraction): final
eval per arm, mean ± 95% CI over seeds (Student's t), and what each arm cost to train: sampled
response tokens (the sum over steps of response/length_mean x sequences per step) and training
seconds (the sum of perf/step_s: wall time on a shared machine, noisy). With --budget, each
shortened arm's final accuracy is set against the full arm's eval at the step where the full
arm had sampled the same number of tokens (linear between its evals).

    python benchmarks/lab_positions.py FOLDER [FOLDER ...] [--budget]

FOLDER: a sweep folder (multirun/lab_early_stop/embedded_chain); runs are grouped by their
variant label (the overrides that differ), so several folders of one recipe can be pooled.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

from opd_exp.analysis import AnalysisError, group_by_variant, lab_fail
from opd_exp.analysis import format_ci95 as ci95
from opd_exp.analysis.runs import load_sources

METRICS = ("eval/accuracy", "eval/kl_reverse", "eval/kl_forward")
SWEEPS = ("lab_early_stop", "lab_token_fraction")
ALLOWED = "allowed: folders of `opd-train -m sweep=lab_early_stop` or `sweep=lab_token_fraction` (one world)"


fail = partial(lab_fail, "lab_positions")  # a missing or empty folder, another world's runs


def world(run) -> str:
    """The run's world as its config names it (else Hydra's choices): the model pair and the task."""
    names = []
    for key in ("model_pair", "task"):
        node = run.config.get(key)
        name = node.get("name") if isinstance(node, dict) else None
        if name or key in run.choices:
            names.append(f"{key}={name or run.choices[key]}")
    return ", ".join(names) or "no world recorded"


def check(runs) -> None:
    """Runs of the position labs only, all of one world, each with the series the tables read."""
    for r in runs:
        sweep = r.choices.get("sweep")
        if sweep not in (None, "None", "null", *SWEEPS):
            fail(f"{r.path}: a run of sweep={sweep} ({world(r)}), not of a position lab; {ALLOWED}")
        if not r.get("response/length_mean") or not r.get("eval/accuracy"):
            fail(f"{r.path}: logs no response/length_mean or eval/accuracy: not an opd-train run of a position lab; {ALLOWED}")
    worlds = {world(r): r for r in runs}
    if len(worlds) > 1:
        (a, ra), (b, rb) = list(worlds.items())[:2]
        fail(f"runs of two worlds pooled: {ra.path} ({a}) and {rb.path} ({b}); {ALLOWED}")


def sampled_tokens(run, per_step: int) -> list[tuple[int, float]]:
    """(step, response tokens sampled up to and including it)."""
    total, out = 0.0, [(0, 0.0)]
    for step, length in run.get("response/length_mean"):
        total += length * per_step
        out.append((step, total))
    return out


def at_budget(run, tokens: float, per_step: int) -> float | None:
    """The run's eval accuracy interpolated at the step where it had sampled ``tokens``."""
    cum = dict(sampled_tokens(run, per_step))
    evals = run.get("eval/accuracy")
    pts = [(cum[s], a) for s, a in evals if s in cum]
    for (t0, a0), (t1, a1) in itertools.pairwise(pts):
        if t0 <= tokens <= t1:
            return a0 + (a1 - a0) * (tokens - t0) / (t1 - t0)
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--budget", action="store_true", help="each arm against the longest-rollout arm at equal sampled tokens")
    ap.add_argument("--per-step", type=int, default=64, help="sequences per step (batch_size x n_samples)")
    args = ap.parse_args(argv)
    try:
        runs, _ = load_sources(args.folders)
    except AnalysisError as exc:  # no such folder, not a folder, no metrics.jsonl under it
        fail(f"{exc}; {ALLOWED}")
    check(runs)
    groups = group_by_variant(runs)
    head = ["arm", "seeds", *METRICS, "sampled tokens (k)", "train s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    cost = {}
    for arm, rs in groups.items():
        toks = [sampled_tokens(r, args.per_step)[-1][1] / 1e3 for r in rs]
        secs = [sum(v for _, v in r.get("perf/step_s")) for r in rs]
        cost[arm] = sum(toks) / len(toks) * 1e3
        cells = [ci95([r.final(m) for r in rs]) for m in METRICS]
        print(f"| {arm} | {','.join(str(r.seed) for r in rs)} | " + " | ".join(cells) + f" | {ci95(toks)} | {ci95(secs)} |")
    if args.budget:
        full = max(cost, key=cost.get)
        print(f"\nfull arm: {full}; its accuracy at each arm's token budget (per seed), vs the arm's own final")
        by_seed = {r.seed: r for r in groups[full]}
        for arm, rs in groups.items():
            if arm == full:
                continue
            own = [r.final("eval/accuracy") for r in rs]
            ref = [at_budget(by_seed[r.seed], sampled_tokens(r, args.per_step)[-1][1], args.per_step) for r in rs if r.seed in by_seed]
            print(f"| {arm} | own {ci95(own)} | full arm at the same tokens {ci95(ref)} |")


if __name__ == "__main__":
    main()
