"""Per-step wall time on the SmolLM2 pair: the in-process teacher, a served teacher (a real vLLM
server on this machine) without overlap, and with overlap (every micro-batch's request sent at
the step's start). Same config otherwise: experiment=smollm2_recovery, estimator=topk k=16,
batch 8 in micro-batches of 2, one torch thread, fused head off (a served teacher has none).

    python benchmarks/served_teacher_step.py [--steps 6] [--url http://127.0.0.1:PORT]

Without --url it starts a server with opd-serve-teacher's launcher (and stops it). Prints the
median over steps 2..N of perf/step_s and of the step without its rollout (teacher + student).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--url", default=None)
    ap.add_argument("--port", type=int, default=18777)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from test_served_teacher import smollm2_config  # the same composed config as the tests

    from opd_exp.cli.serve_teacher import TeacherServer, options_from_args
    from opd_exp.cli.train import build_inputs
    from opd_exp.training.trainer import Trainer

    server = None
    url = args.url
    if url is None:
        server = TeacherServer(options_from_args(["model_pair=smollm2", f"port={args.port}", "teacher.k=16"])).start()
        url = server.o.url
    # monitors off: a sparse teacher has no exact/* or overlap/*, so all three variants do the same work
    common = [f"trainer.max_steps={args.steps}", "trainer.batch_size=8", "trainer.micro_batch_size=2", "eval.size=2"]
    common += ["trainer.exact_metrics=false", "trainer.overlap_k=0"]
    variants = {
        "in_process": [],
        "served": ["teacher=served", f"teacher.url={url}", "teacher.overlap=false"],
        "served+overlap": ["teacher=served", f"teacher.url={url}", "teacher.overlap=true"],
    }
    try:
        inputs = build_inputs(smollm2_config(*common))
        out = {}
        for name, extra in variants.items():
            pair = copy.copy(inputs["pair"])
            pair.student = copy.deepcopy(inputs["pair"].student)
            with tempfile.TemporaryDirectory() as run:
                Trainer(smollm2_config(*common, *extra), Path(run), pair=pair, task=inputs["task"]).run()
                rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in rows if "perf/step_s" in r][1:]
            out[name] = {
                "step_s": statistics.median(r["perf/step_s"] for r in steps),
                "teacher_student_s": statistics.median(r["perf/step_s"] - r["perf/rollout_s"] for r in steps),
                "losses": [round(r["loss"], 5) for r in rows if "loss" in r],
            }
            print(name, json.dumps(out[name]), flush=True)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
