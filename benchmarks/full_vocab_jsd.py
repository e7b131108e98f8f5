"""Full-vocabulary JSD forward+backward: opd-exp vs TRL's generalized_jsd_loss.

Each measurement runs in a fresh process (so peak RSS belongs to one implementation), the
two alternate, and the table reports medians. "extra" is peak RSS minus RSS once the inputs
exist (the inputs, 2 x B*T*V fp32, are the same for both).

    python benchmarks/full_vocab_jsd.py                 # B=4, T=512, V=151936, 3 repeats
    python benchmarks/full_vocab_jsd.py --B 2 --T 64 --V 32000 --repeats 1   # quick look
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


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(impl: str, B: int, T: int, V: int, beta: float, seed: int) -> dict:
    import torch

    torch.manual_seed(seed)
    student = torch.randn(B, T, V).mul_(2.0).requires_grad_(True)
    teacher = torch.randn(B, T, V).mul_(2.0)
    if impl == "opd-exp":
        from opd_exp.divergences import get_divergence

        jsd = get_divergence("jsd", beta=beta)
        compute = lambda: jsd.full(student, teacher).sum()
    else:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.gkd import GKDTrainer

        compute = lambda: GKDTrainer.generalized_jsd_loss(student, teacher, beta=beta, reduction="sum")
    base = _rss_bytes()  # after imports and inputs: what remains is the computation's own
    start = time.perf_counter()
    loss = compute()
    loss.backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "impl": impl,
        "seconds": elapsed,
        "extra_gib": (peak - base) / 2**30,
        "loss": loss.item(),
        "grad_norm": student.grad.norm().item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", default="opd-exp,trl")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.B, args.T, args.V, args.beta, seed=0)))
        return

    impls = args.impls.split(",")
    runs: dict[str, list[dict]] = {i: [] for i in impls}
    for _ in range(args.repeats):
        for impl in impls:  # alternate, so drift on a shared machine hits both
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                impl,
                "--B",
                str(args.B),
                "--T",
                str(args.T),
                "--V",
                str(args.V),
                "--beta",
                str(args.beta),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[impl].append(json.loads(out.strip().splitlines()[-1]))

    med = {i: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "extra_gib")} for i, rs in runs.items()}
    print(
        f"full-vocab JSD(beta={args.beta}) forward+backward, B={args.B} T={args.T} V={args.V} fp32 CPU, "
        f"torch threads={os.cpu_count()}, median of {args.repeats} fresh processes"
    )
    print("| implementation | time (s) | extra peak memory (GiB) | loss | grad norm |")
    print("|---|---|---|---|---|")
    for impl, rs in runs.items():
        print(f"| {impl} | {med[impl]['seconds']:.2f} | {med[impl]['extra_gib']:.2f} | {rs[0]['loss']:.6e} | {rs[0]['grad_norm']:.6e} |")
    if {"opd-exp", "trl"} <= set(runs):
        a, b = runs["opd-exp"][0], runs["trl"][0]
        rel = abs(a["loss"] - b["loss"]) / abs(b["loss"])
        relg = abs(a["grad_norm"] - b["grad_norm"]) / abs(b["grad_norm"])
        print(
            f"time ratio opd-exp/trl = {med['opd-exp']['seconds'] / med['trl']['seconds']:.2f}; "
            f"relative difference: loss {rel:.1e}, grad norm {relg:.1e}"
        )


if __name__ == "__main__":
    main()
