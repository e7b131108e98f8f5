"""How far each estimator's one-step gradient is from the exact one, on the same rollouts.

    OMP_NUM_THREADS=1 python benchmarks/estimator_variance.py [--rollouts 8] [--divergence rkl] [overrides ...]

The embedded pair's student (as shipped, before training) samples ``--rollouts`` batches of the
default size (``trainer.batch_size`` prompts, as step 1, 2, ... would); on each, every estimator's
gradient of the loss over all student parameters is compared with the exact one,
``estimator=full`` on the same tokens (the per-token objective with the prefixes fixed, whose
expectation every unbiased estimator shares): the cosine and the relative error
|g - g_exact| / |g_exact|, mean (and worst) over the rollouts. The sampled estimator follows one
token per position, so its error is noise around the exact gradient; a baseline lowers it without
moving its mean. ``overrides`` are opd-train's (e.g. ``estimator.k=8``).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from statistics import fmean

import torch

ESTIMATORS = {
    "full": ["estimator=full", "loss=direct"],
    "topk (k=16)": ["estimator=topk", "loss=direct"],
    "topk_student (k=16)": ["estimator=topk_student", "loss=direct"],
    "topk_union (k=16)": ["estimator=topk_union", "loss=direct"],
    "sampled": ["estimator=sampled", "loss=ppo", "estimator.baseline=none"],
    "sampled + baseline=topk (k=16)": ["estimator=sampled", "loss=ppo", "estimator.baseline=topk"],
    "sampled + baseline=exact": ["estimator=sampled", "loss=ppo", "estimator.baseline=exact"],
}


def gradient(trainer, objective, batch, scores) -> torch.Tensor:
    """The flattened gradient of ``objective``'s loss on ``batch`` over the student's parameters."""
    from opd_exp.training.scoring import dropout_off

    trainer.optimizer.zero_grad(set_to_none=True)
    with dropout_off(trainer.student):
        zs = trainer.student_logits(trainer.student, batch)
        out = objective(zs, scores, batch.response_ids, batch.response_mask, on_policy=True, normalizer=batch.num_response_tokens)
        out.loss.backward()
    g = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in trainer.params]).double()
    trainer.optimizer.zero_grad(set_to_none=True)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--divergence", default="rkl", help="a divergence option, e.g. rkl, fkl, jsd")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from opd_exp.cli.compose import build_inputs, compose_config
    from opd_exp.training.objective import Objective
    from opd_exp.training.trainer import Trainer

    common = [f"divergence={args.divergence}", "logger=none", "trainer.progress=false", *args.overrides]
    configs = {name: compose_config(*common, *extra) for name, extra in ESTIMATORS.items()}
    base = configs["full"]
    with tempfile.TemporaryDirectory(prefix="estimator_variance_") as tmp:
        trainer = Trainer(base, Path(tmp), **build_inputs(base))
        objectives = {name: Objective(cfg) for name, cfg in configs.items()}
        stats: dict[str, list[tuple[float, float]]] = {name: [] for name in ESTIMATORS if name != "full"}
        for step in range(args.rollouts):
            batch = trainer.sample(step)
            scores = trainer.teacher_scorer.submit(batch).result()
            exact = gradient(trainer, objectives["full"], batch, scores)
            for name in stats:
                g = gradient(trainer, objectives[name], batch, scores)
                cos = float(g @ exact / (g.norm() * exact.norm()))
                stats[name].append((cos, float((g - exact).norm() / exact.norm())))
    print(f"divergence={args.divergence}, {args.rollouts} rollouts of {base.trainer.batch_size} prompts, the shipped student")
    print("| estimator | gradient cosine with the exact | relative error |g - g_exact| / |g_exact| |")
    print("|---|---|---|")
    for name, rows in stats.items():
        cos, err = zip(*rows)
        print(f"| {name} | {fmean(cos):.3f} (worst {min(cos):.3f}) | {fmean(err):.3f} (worst {max(err):.3f}) |")
        assert all(math.isfinite(x) for x in cos + err)


if __name__ == "__main__":
    main()
