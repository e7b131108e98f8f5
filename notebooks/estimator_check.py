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
# # Do the estimators descend the divergence?
#
# In on-policy distillation the student samples y ~ S and sees s = log S(y), t = log T(y).
# A per-token cost c(y) trains along the REINFORCE direction; over a small vocabulary its
# expectation is a finite sum, so it can be computed exactly (z = student logits):
#
# $$\mathbb{E}_{y\sim S}\big[c(y)\,\nabla_z \log S(y)\big] = S\odot c - S\,(S\cdot c)$$
#
# The update is minus that. Below: its cosine with $-\nabla_z D$ for each estimator, on random
# categorical pairs (standard-normal logits over `VOCAB` tokens). *far*: teacher logits drawn
# independently (the setting of the Trinity-RFT fix); *near*: teacher = student + 0.2 * noise.
# The computations live in `opd_exp/divergences/check.py` and are pinned by
# `tests/test_estimator_check.py`.

# %%
import matplotlib.pyplot as plt
import numpy as np

from opd_exp.divergences import get_divergence
from opd_exp.divergences.check import (
    cosine_table,
    cost_cosine,
    format_rows,
    random_pair,
    seed_table,
    shipped_jsd_cost,
    variance_table,
)

SEEDS = (0, 1, 2)
VOCAB = 8

# %% [markdown]
# ## The cosine table of the Trinity-RFT fix
# *before*: the cost shipped before the fix, the JSD value
# β·(t − log m) + (1 − β)·(s − log m) used as the cost; *after*: this project's
# `token_cost` = (1 − β)·(s − log m). Ranges are over the random draws. The fix's report gives
# −0.22…−0.58, −0.39…−0.79, −0.69…−0.96 (β = 0.3, 0.5, 0.9) on its own draws.

# %%
print(format_rows(seed_table(seeds=SEEDS, vocab=VOCAB), ["beta", "before", "after"]))

# %% [markdown]
# Across β on the same far pairs: the shipped cost still points partly the right way at
# small β, turns against −∇JSD_β from β ≈ 0.1–0.2 on, the more so the larger β; ours stays
# at +1 everywhere:

# %%
betas = np.linspace(0.05, 0.95, 19)
fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")
for seed in SEEDS:
    zs, zt = random_pair(seed, VOCAB)
    shipped = [cost_cosine(shipped_jsd_cost(b), get_divergence("jsd", beta=b), zs, zt) for b in betas]
    ours = [cost_cosine(get_divergence("jsd", beta=b).token_cost, get_divergence("jsd", beta=b), zs, zt) for b in betas]
    ax.plot(betas, shipped, color="C3", alpha=0.8, label="Trinity-RFT before the fix" if seed == SEEDS[0] else None)
    ax.plot(betas, ours, color="C0", alpha=0.8, label="ours: (1-β)(s - log m)" if seed == SEEDS[0] else None)
ax.axhline(0, color="k", lw=0.5)
ax.set_xlabel("β")
ax.set_ylabel("cos(expected update, -∇JSD_β)")
ax.legend()
plt.show()

# %% [markdown]
# ## Every estimator
# `ours` marks the estimators this project ships as unbiased (cosine 1). The others: forward
# KL with a clipped importance weight (biased once the clip bites), top-k renormalised over
# the teacher's top-k (the ms-swift / NeMo-RL form, offered only as `topk_renorm`), and the
# two costs Trinity-RFT shipped before the fix, including the β = 1 branch (cost t − s), which ascends reverse KL
# exactly and is measured against both KLs.

# %%
print(format_rows(cosine_table(seeds=SEEDS, vocab=VOCAB), ["estimator", "regime", "ours", "cosines"]))

# %% [markdown]
# ## Variance of the value estimators
# `token_value` is a one-sample estimate of D used for logging (`jsd/mean`, `kl/*`). All are
# unbiased (bias 0) except the shipped JSD value, whose expectation is ≤ 0. `std` is the
# standard deviation of one sample, `rel_std` = std / D, averaged over the seeds: the number
# of tokens needed for a given relative precision grows as rel_std². Near the teacher the
# plain log-ratio forms (s − t, r·(t − s), the skew KLs) have rel_std ≈ 20: their noise
# swamps a small D, while `r − 1 − log r`, the JSD values and TVD stay near 1. Far from the
# teacher the importance-weighted forward forms (fkl, skl) are the noisiest, and the exact
# head of top-k cuts the JSD spread.

# %%
print(format_rows(variance_table(seeds=SEEDS, vocab=VOCAB), ["estimator", "regime", "D", "bias", "std", "rel_std"]))
