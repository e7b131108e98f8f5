# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The lab: the field's claims, reproduced on the embedded worlds
#
# Reads the lab sweeps' folders (`multirun/lab_<claim>/<model_pair>/`, written by
# `opd-train -m sweep=lab_<claim>`), prints per claim the table of final eval values
# (mean ± 95% CI over seeds, Student's t), and draws the eval curves with the spread over seeds as a band
# into `docs/results/lab_<claim>.png`. A sweep whose folder is missing is skipped.
#
# `OPD_LAB_ROOT` (default: `multirun`, or `../multirun` from `notebooks/`) is where the sweep
# folders live; `OPD_LAB_FIGURES` (default: `docs/results`) where the figures go
# (empty: do not save).

# %%
import math
import os
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from opd_exp.analysis import curve, format_ci95, group_by_variant, load_runs

ROOT = Path(os.environ.get("OPD_LAB_ROOT") or ("multirun" if Path("multirun").exists() else "../multirun"))
FIGURES = os.environ.get("OPD_LAB_FIGURES", "docs/results" if Path("docs").exists() else "../docs/results")

# claim -> (metrics of its table and figure, short label of a variant from its overrides)
CLAIMS = {
    "lab_kl_direction": [
        "eval/precision",
        "eval/coverage",
        "eval/entropy",
        "eval/pass@k",
        "eval/accuracy",
        "eval/kl_reverse",
        "eval/kl_forward",
    ],
    "lab_legacy_jsd": ["eval/jsd", "eval/kl_reverse", "eval/kl_forward", "eval/precision", "eval/accuracy"],
    "lab_on_policy": ["eval/accuracy", "eval/precision", "eval/kl_reverse", "eval/kl_forward", "eval/jsd"],
    "lab_prefix_x_kl": ["eval/accuracy", "eval/precision", "eval/kl_reverse", "eval/kl_forward"],
    "lab_token_fraction": ["eval/accuracy", "eval/precision", "eval/kl_reverse", "eval/kl_forward"],
}


def folder(claim):
    found = sorted(p for p in (ROOT / claim).glob("*") if p.is_dir()) if (ROOT / claim).is_dir() else []
    return found[0] if found else None


def present(runs, metrics):
    """The metrics some run logged (a sweep without eval samples has no eval/precision)."""
    return [m for m in metrics if any(r.steps(m) for r in runs)]


def table(runs, metrics):
    groups = group_by_variant(runs)
    head = ["variant", "seeds", *metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, rs in groups.items():
        seeds = ",".join(str(r.seed) for r in rs)
        lines.append("| " + " | ".join([variant, seeds, *[format_ci95(r.final(m) for r in rs) for m in metrics]]) + " |")
    return "\n".join(lines)


def figure(runs, metrics, title):
    groups = group_by_variant(runs)
    n = len(metrics)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.3 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for variant, rs in groups.items():
            c = curve(rs, metric)
            if not c["step"]:
                continue
            (line,) = ax.plot(c["step"], c["mean"], marker="o", ms=3, label=variant)
            ax.fill_between(c["step"], c["min"], c["max"], color=line.get_color(), alpha=0.18, lw=0)
        lows = [v for line in ax.get_lines() for v in line.get_ydata() if v > 0]
        if metric.startswith(("eval/kl", "eval/jsd")) and lows and max(lows) > 8 * min(lows):
            ax.set_yscale("log")  # variants orders of magnitude apart: each stays readable
        ax.set_title(metric + (" (log scale)" if ax.get_yscale() == "log" else ""), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    per_row = 5 if max(map(len, labels), default=0) < 25 else 2  # long variant names: fewer per row
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), per_row), fontsize=9, frameon=False)
    steps = max(max(r.steps("eval/accuracy"), default=0) for r in runs)
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    fig.suptitle(f"{title}: {len(runs)} jobs, {steps} steps, seeds {seeds}; mean over seeds, band = min..max", fontsize=11)
    fig.tight_layout(rect=(0, 0.04 * math.ceil(len(labels) / per_row) + 0.03, 1, 0.95))
    return fig


# %% [markdown]
# ## Every claim: table and curves

# %%
for claim, metrics in CLAIMS.items():
    where = folder(claim)
    if where is None:
        print(f"{claim}: no runs under {ROOT / claim} (run `opd-train -m sweep={claim}`)")
        continue
    runs = load_runs(where)
    metrics = present(runs, metrics)
    last = max(max(r.steps("eval/accuracy"), default=0) for r in runs)
    head = f"### {claim}\n`{where}`: {len(runs)} jobs; final eval (step {last}), mean ± 95% CI over seeds\n\n"
    display(Markdown(head + table(runs, metrics)))
    fig = figure(runs, metrics, claim)
    if FIGURES:
        Path(FIGURES).mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(FIGURES) / f"{claim}.png", dpi=110)
    plt.show()

# %% [markdown]
# ## Prefix source x KL direction: the interaction, per seed
#
# Independence of the two axes means the effect of student prefixes (on_policy_fraction 1
# minus 0) is the same under reverse and forward KL. Per seed, the interaction is
# (rkl: student - teacher prefixes) - (fkl: student - teacher prefixes) of each final eval
# metric; the table gives both effects and the interaction, mean ± 95% CI over seeds.


# %%
def prefix_x_kl_interaction(runs, metrics):
    cells = {}
    for r in runs:
        key = (r.divergence or r.overrides.get("divergence"), float(r.overrides.get("rollout.on_policy_fraction", "nan")), r.seed)
        cells[key] = r
    seeds = sorted({s for (_, _, s) in cells if all((d, f, s) in cells for d in ("fkl", "rkl") for f in (0.0, 1.0))})
    lines = ["| metric | student-prefix effect under fkl | under rkl | interaction | per seed |", "|---|---|---|---|---|"]
    for m in metrics:

        def effect(div, s, m=m):
            return cells[(div, 1.0, s)].final(m) - cells[(div, 0.0, s)].final(m)

        fkl, rkl = [effect("fkl", s) for s in seeds], [effect("rkl", s) for s in seeds]
        inter = [b - a for a, b in zip(fkl, rkl)]
        per_seed = ", ".join(f"{x:+.3f}" for x in inter)
        lines.append(f"| {m} | {format_ci95(fkl)} | {format_ci95(rkl)} | {format_ci95(inter)} | {per_seed} |")
    return f"seeds {seeds}\n\n" + "\n".join(lines)


where = folder("lab_prefix_x_kl")
if where is None:
    print(f"lab_prefix_x_kl: no runs under {ROOT / 'lab_prefix_x_kl'}")
else:
    runs = load_runs(where)
    display(Markdown(prefix_x_kl_interaction(runs, present(runs, [*CLAIMS["lab_prefix_x_kl"], "eval/entropy"]))))
