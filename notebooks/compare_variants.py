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
# shares; e.g. `divergence=jsd,divergence.beta=0.5` (the name W&B gives the run). Tables and
# legends name it from the run's config in a paper's words (`JSD β=0.5`, `reverse KL`), and
# every table and legend says its statistic over seeds: `STAT` (`ci95`: mean ± 95% CI,
# Student's t; `std`; `minmax`). `AT_STEP`, `REACH` and `BASE` are the paper tables of
# `opd-compare --at-step N --reach METRIC=VALUE --base KEY=VALUE`; `X` the figures' x axis.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from opd_exp.analysis import (
    at_step_table,
    figure_title,
    format_table,
    group_by_variant,
    latest_multirun,
    load_runs,
    load_wandb,
    missing_line,
    paired_table,
    paper_labels,
    parse_reach,
    plot_curves,
    reach_table,
    reached,
    stat_name,
    summary_table,
)

MULTIRUN = os.environ.get("OPD_MULTIRUN")
WANDB_PROJECT = os.environ.get("WANDB_PROJECT")
WANDB_ENTITY = os.environ.get("WANDB_ENTITY")
WANDB_GROUP = os.environ.get("OPD_WANDB_GROUP")
STAT = os.environ.get("OPD_STAT", "ci95")  # ci95 (mean ± 95% CI, Student's t), std, minmax
X = os.environ.get("OPD_X", "steps")  # the figures' x axis: steps, tokens (sampled), seconds (training)
AT_STEP = int(os.environ["OPD_AT_STEP"]) if os.environ.get("OPD_AT_STEP") else None  # None: the last step every run reached
REACH = os.environ.get("OPD_REACH", "eval/accuracy=0.5")  # steps to a threshold
BASE = os.environ.get("OPD_BASE")  # KEY=VALUE (or a variant): paired differences; None: the first variant

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
labels = paper_labels(groups)
title = figure_title([(source, Path(source))], runs)
print(title)
for variant, rs in groups.items():
    print(f"  {labels[variant]} ({variant}): seeds {[r.seed for r in rs]}, {max(len(r.steps('loss')) for r in rs)} logged training steps")

# %% [markdown]
# ## Training curves
# The train JSD is an unbiased estimate of JSD_beta logged for every divergence, so all
# variants share this axis; the train KL(S‖T) is the per-token reverse KL on the student's
# own samples. Both are EMA-smoothed (the raw mean drawn faintly behind); the dashed line is
# the teacher's eval accuracy.

# %%
fig, axes = plt.subplots(1, 3, figsize=(16, 4.4), layout="constrained")
plot_curves(runs, ["jsd/mean", "kl/reverse", "eval/accuracy"], axes=axes, stat=STAT, x=X, labels=labels, title=f"{title}: training")
plt.show()

# %% [markdown]
# ## Evaluation divergences
# Exact over the vocabulary at every position of the student's greedy eval responses; the
# last panel is each variant's own divergence (the one it trains on, at its parameters).

# %%
fig, axes = plt.subplots(1, 4, figsize=(20, 4.4), layout="constrained")
plot_curves(
    runs, ["eval/jsd", "eval/kl_reverse", "eval/kl_forward", "own"], axes=axes, stat=STAT, x=X, labels=labels, title=f"{title}: evaluation"
)
plt.show()

# %% [markdown]
# ## Final comparison
# Per variant: each metric before training, after, and the change, over its seeds (`STAT`);
# then its own divergence the same way.

# %%
finished = [r for r in runs if r.finished]
rows = summary_table(finished, stat=STAT)
for row in rows:
    row["variant"] = labels[row["variant"]]
print(f"final values, {stat_name(STAT)}")
display(Markdown(format_table(rows, fmt="markdown")))
teacher = [r.final("eval/teacher_accuracy") for r in runs if r.final("eval/teacher_accuracy") is not None]
if teacher:
    print(f"teacher eval accuracy: {teacher[0]:.4g}")

# %% [markdown]
# ## For the paper: a common step, steps to a threshold, differences from a base
# Every run read at one step (`AT_STEP`; by default the last step every run reached), the
# steps, sampled tokens and training seconds until `REACH` holds (per seed; runs that never
# get there are counted), and each variant minus its base, paired by seed.

# %%
step = AT_STEP if AT_STEP is not None else min(r.last_step() or 0 for r in runs)
head, table, missing = at_step_table(runs, step, stat=STAT, fmt="markdown", labels=labels)
display(Markdown(f"{head}\n\n{table}"))
if missing:
    print(missing_line(step, missing, labels))
head, table = reach_table(runs, *parse_reach(REACH), stat=STAT, fmt="markdown", labels=labels)
display(Markdown(f"{head}\n\n{table}"))
if len(groups) > 1:
    head, table, notes = paired_table(
        reached(runs, step)[0], BASE or next(iter(groups)), step=step, stat=STAT, fmt="markdown", labels=labels
    )
    display(Markdown(f"{head}\n\n{table}"))
    for note in notes:
        print(note)
