"""``estimator.baseline``: the control variate subtracted from ``estimator=sampled``'s cost, and what
each kind needs of the rest of a run (``divergences/baseline.py`` has the math)."""

from __future__ import annotations

from enum import Enum

from opd_exp.config.checks import fail as _fail


class Baseline(Enum):
    none = "none"  # the sampled cost as it is
    # minus the score-weighted mean cost sum_v S_v w_v c_v / sum_v S_v w_v, w_v = |e_v - S|^2, over the
    # whole vocabulary (divergences/baseline.py; needs the teacher's whole distribution)
    exact = "exact"
    topk = "topk"  # the same from the teacher's top-k (estimator.k), its remaining mass spread evenly over the tail
    # from the prompt's OTHER samples (rollout.n_samples >= 2): RLOO on each row's whole return with undiscounted
    # sequence credit, else their mean return at each position; unbiased for any teacher, another tokenizer's too
    loo = "loo"

    @property
    def reads_teacher(self) -> bool:
        """Built from the teacher's distribution over the student's tokens (a teacher with another
        vocabulary has none)."""
        return self in (Baseline.exact, Baseline.topk)


def whole_groups(cfg) -> tuple[str, int] | None:
    """(what needs it, rollout.n_samples) where every micro-batch and rank must hold each prompt's
    samples whole (the leave-one-out baseline reads them in one forward), else None."""
    if cfg.estimator.baseline is Baseline.loo:
        return ("estimator.baseline=loo", cfg.rollout.n_samples)
    return None


def validate_baseline(cfg) -> None:
    """The baseline's combinations with the rest of a ``TrainConfig`` (one line each); the ranks are
    checked when the trainer starts (``runtime.distributed.shard``), PPO's mini-batches are drawn as
    whole groups (``training/ppo.py``)."""
    kind, est = cfg.estimator.baseline, cfg.estimator.name.value
    if kind is Baseline.none:
        return
    if est != "sampled":
        _fail("estimator.baseline", kind.value, f"none with estimator={est} (the baseline is subtracted from estimator=sampled's cost)")
    group = whole_groups(cfg)
    if group is None:
        return
    n, mbs = group[1], cfg.trainer.micro_batch_size
    if n < 2:
        _fail(
            "estimator.baseline",
            kind.value,
            f"none | exact | topk with rollout.n_samples={n} (leave-one-out needs >= 2 samples of each prompt)",
        )
    if mbs % n:
        _fail(
            "trainer.micro_batch_size",
            mbs,
            f"0 or a multiple of rollout.n_samples={n} with {group[0]} (a prompt's samples share one micro-batch)",
        )
