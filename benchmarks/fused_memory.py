"""Peak memory and time of one OPD step at real vocabulary sizes: materialised vs fused vs TRL.

One step = student forward (with grad) + teacher forward (no grad) + the full-vocabulary JSD
(beta=0.5, estimator=full loss=direct) + backward, on small random Qwen2 models (hidden 64, 2
layers, tied embeddings) whose vocabulary is V, over N sequences of an 8-token prompt and R
response tokens (every position counts). Implementations:

  materialised  opd-exp with scale.fused_lm_head=off: the models' LM heads give [N, R, V]
                logits for both, then the chunked divergence
  fused         opd-exp's fused path (opd_exp/training/fused.py): backbones only, then LM heads,
                objective and gradient a chunk of positions at a time
  trl           TRL 1.16 DistillationTrainer's loss: backbones, then its
                ``_chunked_divergence_loss`` (hidden states + LM-head weights, tiled)

Each measurement is a fresh process; "extra" is peak RSS minus RSS once the models and the
batch exist. A materialised run whose estimate (5 x N*R*V fp32) exceeds --max-gib is skipped
and reported with its estimate.

    python benchmarks/fused_memory.py                               # V in {49152, 151936}, N x R in {16x512, 32x1024}
    python benchmarks/fused_memory.py --sizes 4x128 --vocabs 49152  # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(impl: str, V: int, N: int, R: int, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.set_num_threads(1)

    def model(s):
        torch.manual_seed(s)
        cfg = Qwen2Config(
            vocab_size=V,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        return AutoModelForCausalLM.from_config(cfg)

    student, teacher = model(seed + 1), model(seed + 2).requires_grad_(False)
    # every import before the baseline: what is left is the step's own memory
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from opd_exp.config import schema as S
    from opd_exp.config.world import ModelPairConfig, TaskConfig
    from opd_exp.training.fused import fused_accumulate
    from opd_exp.training.monitors import Monitors
    from opd_exp.training.objective import Objective
    from opd_exp.training.rollout import Batch
    from opd_exp.training.sampling import SamplingSpec
    from opd_exp.training.scoring import InProcessTeacher, response_hidden, student_logits, teacher_logits

    P = 8
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (N, P + R), generator=g)
    mask = torch.ones(N, P + R, dtype=torch.long)
    batch = Batch(
        input_ids=ids,
        attention_mask=mask,
        position_ids=torch.arange(P + R).expand(N, -1),
        prompt_len=P,
        response_mask=torch.ones(N, R, dtype=torch.bool),
        prompt_index=torch.arange(N),
    )
    base = _rss()
    start = time.perf_counter()
    if impl in ("materialised", "fused"):
        cfg = S.TrainConfig(
            model_pair=ModelPairConfig(),
            task=TaskConfig(),
            divergence=S.DivergenceConfig(name=S.DivergenceName.jsd, beta=0.5),
            estimator=S.EstimatorConfig(name=S.EstimatorName.full),
            loss=S.LossConfig(name=S.LossName.direct),
        )
        objective, monitors = Objective(cfg), Monitors(cfg)
        n = N * R
        if impl == "materialised":
            zs = student_logits(student, batch, V, SamplingSpec())
            zt = teacher_logits(teacher, batch, V, temperature=1.0)
            out = objective(zs, zt, batch.response_ids, batch.response_mask, on_policy=True, normalizer=n)
            monitors(zs, zt, out)
            out.loss.backward()
            loss = float(out.loss)
        else:
            ft = InProcessTeacher(teacher, V, temperature=1.0, device="cpu")
            out = fused_accumulate(
                objective, monitors, student, ft, batch, vocab_size=V, sampling=SamplingSpec(), on_policy=True, normalizer=n
            )
            loss = float(out.loss)
    else:
        hs = response_hidden(student, batch)
        with torch.no_grad():
            ht = response_hidden(teacher, batch)
        loss_t, _, _ = _chunked_divergence_loss(
            hs,
            ht,
            student.get_output_embeddings().weight,
            teacher.get_output_embeddings().weight,
            batch.response_mask.long(),
            0.5,
            num_items_in_batch=N * R,
        )
        loss_t.backward()
        loss = float(loss_t)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grad = torch.cat([p.grad.flatten() for p in student.parameters() if p.grad is not None]).norm().item()
    return {"impl": impl, "seconds": elapsed, "extra_gib": (peak - base) / 2**30, "loss": loss, "grad_norm": grad}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default="49152,151936")
    p.add_argument("--sizes", default="16x512,32x1024", help="N x R pairs")
    p.add_argument("--impls", default="materialised,fused,trl")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-gib", type=float, default=12.0, help="skip a materialised run estimated above this")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        impl, V, N, R = a.worker.split(":")
        print("RESULT " + json.dumps(_worker(impl, int(V), int(N), int(R))))
        return
    rows = []
    for V in (int(v) for v in a.vocabs.split(",")):
        for size in a.sizes.split(","):
            N, R = (int(x) for x in size.split("x"))
            for impl in a.impls.split(","):
                est = 5 * N * R * V * 4 / 2**30
                if impl == "materialised" and est > a.max_gib:
                    rows.append((V, size, impl, None, f"skipped: needs ~{est:.0f} GiB"))
                    continue
                res = []
                for _ in range(a.repeats):
                    cmd = [sys.executable, __file__, "--worker", f"{impl}:{V}:{N}:{R}"]
                    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                    if out.returncode or not line:
                        res = None
                        rows.append((V, size, impl, None, f"failed (rc={out.returncode}): {out.stderr.strip().splitlines()[-1:]}"))
                        break
                    res.append(json.loads(line[-1][7:]))
                if res:
                    rows.append((V, size, impl, res, ""))
                print(f"done {impl} V={V} {size}", file=sys.stderr, flush=True)
    print("one OPD step (student fwd + teacher fwd + JSD(0.5) full + backward), fp32 CPU, 1 thread, random hidden-64 models")
    print("| V | N x R | implementation | time (s) | extra peak memory (GiB) | loss | grad norm | note |")
    print("|---|---|---|---|---|---|---|---|")
    for V, size, impl, res, note in rows:
        if res is None:
            print(f"| {V} | {size} | {impl} | - | - | - | - | {note} |")
            continue
        t = statistics.median(r["seconds"] for r in res)
        m = statistics.median(r["extra_gib"] for r in res)
        print(f"| {V} | {size} | {impl} | {t:.1f} | {m:.2f} | {res[0]['loss']:.6e} | {res[0]['grad_norm']:.6e} | {note} |")


if __name__ == "__main__":
    main()
