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
# # Compare the variants of a sweep
#
# Loads an `opd-train` multirun (one Hydra job folder per variant x seed), plots the
# training curves per variant with the seeds as a band, and prints the final comparison
# table: the same numbers `opd-compare <folder>` prints.
#
# **Where the runs come from** (first that applies):
# 1. `OPD_MULTIRUN=<folder>`: a multirun folder (`multirun/<date>/<time>`) or one run folder;
# 2. `WANDB_PROJECT=<project>` (and optionally `WANDB_ENTITY`, `OPD_WANDB_GROUP` = the sweep's
#    group) with W&B online: the runs through the W&B public API. Offline, or if W&B cannot
#    be reached, the notebook falls back to 3;
# 3. the newest folder under `./multirun` (or `../multirun` when started from `notebooks/`).
#
# A *variant* is a job's Hydra overrides minus the seed and minus the overrides every job
# shares; e.g. `divergence=jsd,divergence.beta=0.5`.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from opd_exp.analysis import (
    format_table,
    group_by_variant,
    latest_multirun,
    load_runs,
    load_wandb,
    plot_curves,
    short_label,
    summary_table,
)

MULTIRUN = os.environ.get("OPD_MULTIRUN")
WANDB_PROJECT = os.environ.get("WANDB_PROJECT")
WANDB_ENTITY = os.environ.get("WANDB_ENTITY")
WANDB_GROUP = os.environ.get("OPD_WANDB_GROUP")
BAND = "range"  # seeds as min..max; "std" for mean ± std

# %%
runs, source = None, None
wandb_online = os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled")
if not MULTIRUN and WANDB_PROJECT and wandb_online:
    try:
        runs = load_wandb(WANDB_PROJECT, entity=WANDB_ENTITY, group=WANDB_GROUP)
        source = f"W&B {WANDB_ENTITY + '/' if WANDB_ENTITY else ''}{WANDB_PROJECT}"
    except Exception as ex:  # no network, no login, no such project: local folders still work
        print(f"W&B not reachable ({type(ex).__name__}: {ex}); reading local run folders instead")
        runs = None
if not runs:
    folder = Path(MULTIRUN) if MULTIRUN else latest_multirun()
    if folder is None:
        raise FileNotFoundError(
            "no multirun folder found: set OPD_MULTIRUN=<multirun/date/time> or run a sweep first, e.g. `opd-train -m sweep=divergence`"
        )
    runs, source = load_runs(folder), str(folder)

groups = group_by_variant(runs)
print(f"{source}: {len(runs)} jobs, {len(groups)} variants")
for variant, rs in groups.items():
    print(f"  {short_label(variant)}: seeds {[r.seed for r in rs]}, {max(len(r.steps('loss')) for r in rs)} logged training steps")

# %% [markdown]
# ## Training curves
# The train JSD is an unbiased estimate of JSD_beta logged for every divergence, so all
# variants share this axis; the train KL(S‖T) is the per-token reverse KL on the student's
# own samples. Both are EMA-smoothed (the raw mean drawn faintly behind); the dashed line is
# the teacher's eval accuracy.

# %%
fig, axes = plt.subplots(1, 3, figsize=(16, 4.4), layout="constrained")
plot_curves(runs, ["jsd/mean", "kl/reverse", "eval/accuracy"], axes=axes, band=BAND, title=f"{source}: training")
plt.show()

# %% [markdown]
# ## Evaluation divergences
# Exact over the vocabulary at every position of the student's greedy eval responses; the
# last panel is each variant's own divergence (the one it trains on, at its parameters).

# %%
fig, axes = plt.subplots(1, 4, figsize=(20, 4.4), layout="constrained")
plot_curves(runs, ["eval/jsd", "eval/kl_reverse", "eval/kl_forward", "own"], axes=axes, band=BAND, title=f"{source}: evaluation")
plt.show()

# %% [markdown]
# ## Final comparison
# Per variant: each metric before training, after, and the change, as mean ± sample std over
# its seeds; then its own divergence the same way.

# %%
rows = summary_table(runs)
for row in rows:
    row["variant"] = short_label(row["variant"])
display(Markdown(format_table(rows, fmt="markdown")))
teacher = [r.final("eval/teacher_accuracy") for r in runs if r.final("eval/teacher_accuracy") is not None]
if teacher:
    print(f"teacher eval accuracy: {teacher[0]:.4g}")
