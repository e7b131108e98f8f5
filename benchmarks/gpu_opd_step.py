"""Tokens/s and peak GPU memory of one OPD step (rollout + teacher scoring + student
forward/backward + optimizer step), for the sampled and the full-vocabulary estimators.

Two layouts, both with RANDOM weights built from config (no hub access needed):

* ``default``: the embedded world's architectures (opd_exp/config/world.py sizes, the embedded
  tokenizer and the arithmetic task);
* ``real``: a Qwen2.5-1.5B-shaped student (hidden 1536, 28 layers, 12/2 heads, vocab 151936,
  tied) and a Qwen2.5-7B-shaped teacher (hidden 3584, 28 layers, 28/4 heads, 152064 embedding
  rows), prompts of random token ids.

Random weights rarely emit EOS, so every response runs to ``--max-new-tokens``: the numbers are
for full-length responses. The step goes through ``opd_exp.training.trainer.Trainer.train_step`` (the
loop users run); the first step is a warm-up and is not counted.

    python benchmarks/gpu_opd_step.py                       # both layouts, on the GPU
    python benchmarks/gpu_opd_step.py --layout real --batch-size 16 --max-new-tokens 256 \\
        --precision bf16 --teacher-dtype bf16 --grad-checkpointing
    python benchmarks/gpu_opd_step.py --tiny                # CPU smoke test (tests/test_gpu_bench.py)

Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the process's peak RSS
(a coarser number that includes Python and the libraries) is reported instead.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

REAL = {  # Qwen2.5-1.5B-Instruct <- Qwen2.5-Math-7B-Instruct shapes (config.json of each)
    "student": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "teacher": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "tokenizer_vocab": 151936,
}
TINY = {  # the same layout shrunk for a CPU smoke run (padded teacher embedding rows kept)
    "student": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "teacher": dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=520,
        tie_word_embeddings=False,
    ),
    "tokenizer_vocab": 512,
}


class IdTokenizer:
    """Text of space-separated token ids <-> ids: prompts of random ids for the real layout."""

    def __init__(self, vocab: int):
        self.vocab, self.eos_token_id, self.pad_token_id = vocab, vocab - 1, vocab - 2

    def __len__(self) -> int:
        return self.vocab

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


@dataclass
class RandomPromptTask:
    prompts: list[str]

    def train_problems(self):
        return [SimpleNamespace(prompt=p, answer="") for p in self.prompts]

    def eval_problems(self):
        return self.train_problems()[:1]

    def render_prompt(self, problem, tokenizer):
        return problem.prompt

    def verify(self, completion: str, answer: str) -> bool:
        return False


def qwen2(spec: dict, dtype: torch.dtype, device: str, seed: int, eos: int, pad: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**spec, max_position_embeddings=4096, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):  # build on the device: a 7B teacher never sits in CPU memory
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def real_layout(args) -> tuple[Any, Any, str]:
    spec = TINY if args.tiny else REAL
    tok = IdTokenizer(spec["tokenizer_vocab"])
    dev = args.device
    s_dtype = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
    t_dtype = torch.bfloat16 if args.teacher_dtype == "bf16" else torch.float32
    student = qwen2(spec["student"], s_dtype, dev, 1, tok.eos_token_id, tok.pad_token_id)
    teacher = qwen2(spec["teacher"], t_dtype, dev, 2, tok.eos_token_id, tok.pad_token_id)
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(map(str, torch.randint(0, tok.vocab - 2, (args.prompt_tokens,), generator=g).tolist())) for _ in range(256)]
    pair = SimpleNamespace(student=student, teacher=teacher, tokenizer=tok, vocab_size=len(tok))
    name = "real-tiny" if args.tiny else "real (1.5B student, 7B teacher)"
    return pair, RandomPromptTask(prompts), name


def default_layout(args) -> tuple[Any, Any, str]:
    """The embedded world's shapes with random weights (its cached trained pair is not needed)."""
    import tempfile

    from opd_exp.config.world import EmbeddedPairConfig, TaskConfig
    from opd_exp.pairs.embedded.models import build_model
    from opd_exp.pairs.embedded.tokenizer import load_tokenizer, save_tokenizer
    from opd_exp.tasks import build_task

    folder = tempfile.mkdtemp(prefix="opd-bench-tok-")
    save_tokenizer(folder)
    tok = load_tokenizer(folder)
    pc = EmbeddedPairConfig()
    pair = SimpleNamespace(
        student=build_model(pc.student, tok, 1), teacher=build_model(pc.teacher, tok, 2), tokenizer=tok, vocab_size=len(tok)
    )
    return pair, build_task(TaskConfig()), "default (embedded world shapes)"


def make_config(args, estimator: str):
    from opd_exp.config import schema as S
    from opd_exp.config.world import ModelPairConfig, TaskConfig

    loss = "reinforce" if estimator == "sampled" else "direct"
    return S.TrainConfig(
        model_pair=ModelPairConfig(),
        task=TaskConfig(),
        divergence=S.DivergenceConfig(name=S.DivergenceName(args.divergence)),
        estimator=S.EstimatorConfig(name=S.EstimatorName(estimator)),
        loss=S.LossConfig(name=S.LossName(loss)),
        rollout=S.RolloutConfig(max_new_tokens=args.max_new_tokens, max_prompt_tokens=max(args.prompt_tokens, 8)),
        trainer=S.TrainerConfig(
            max_steps=args.steps + 1,
            batch_size=args.batch_size,
            micro_batch_size=args.micro_batch_size,
            lr=1e-5,
            warmup_steps=0,
            schedule=S.Schedule.constant,
            progress=False,
        ),
        eval=S.EvalConfig(every=0),
        checkpoint=S.CheckpointConfig(every=0),
        scale=S.ScaleConfig(
            device=args.device,
            precision=S.Precision(args.precision),
            param_dtype=S.ParamDtype(args.param_dtype),
            teacher_dtype=S.ParamDtype(args.teacher_dtype),
            grad_checkpointing=args.grad_checkpointing,
            num_threads=0 if args.device != "cpu" else 1,
        ),
        logger=S.LoggerConfig(name=S.LoggerName.none),
    )


def peak_memory_gib(device: str) -> tuple[float, str]:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30, "gpu"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "cpu_rss"  # KiB on Linux


def bench(pair, task, layout: str, estimator: str, args) -> dict:
    import tempfile

    from opd_exp.training.trainer import Trainer

    cfg = make_config(args, estimator)
    trainer = Trainer(cfg, tempfile.mkdtemp(prefix="opd-bench-run-"), pair=pair, task=task)
    trainer.train_step()  # warm-up: kernels, allocator, caches
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = trainer.train_step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens = m["response/length_mean"] * args.batch_size
        steps.append({"step_s": dt, "tokens": tokens, "rollout_s": m["perf/rollout_s"], "loss": m["loss"]})
    mem, kind = peak_memory_gib(args.device)
    step_s = statistics.median(s["step_s"] for s in steps)
    tokens = statistics.median(s["tokens"] for s in steps)
    return {
        "layout": layout,
        "estimator": estimator,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "precision": args.precision,
        "param_dtype": args.param_dtype,
        "teacher_dtype": args.teacher_dtype,
        "grad_checkpointing": args.grad_checkpointing,
        "device": args.device,
        "tokens_per_step": tokens,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "rollout_s": statistics.median(s["rollout_s"] for s in steps),
        "train_s": step_s - statistics.median(s["rollout_s"] for s in steps),
        f"peak_{kind}_gib": mem,
        "finite": all(s["loss"] == s["loss"] for s in steps),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=["default", "real", "both"], default="both")
    ap.add_argument("--estimators", default="sampled,full", help="comma-separated: sampled, full")
    ap.add_argument("--tiny", action="store_true", help="shrink the real layout and run on CPU (smoke test)")
    ap.add_argument("--device", default=None, help="default: cuda if available (cpu with --tiny)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--divergence", default="jsd")
    ap.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="autocast (default: bf16 on cuda)")
    ap.add_argument("--param-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--teacher-dtype", default=None, choices=["fp32", "bf16"], help="default: bf16 on cuda")
    ap.add_argument("--grad-checkpointing", action="store_true")
    ap.add_argument("--out", default=None, help="append one JSON line per measurement here")
    args = ap.parse_args(argv)
    if args.tiny:
        args.device = args.device or "cpu"
        args.batch_size, args.max_new_tokens, args.prompt_tokens, args.steps = (
            min(args.batch_size, 2),
            min(args.max_new_tokens, 4),
            min(args.prompt_tokens, 6),
            min(args.steps, 1),
        )
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = args.device.startswith("cuda")
    args.precision = args.precision or ("bf16" if on_gpu else "fp32")
    args.teacher_dtype = args.teacher_dtype or ("bf16" if on_gpu else "fp32")
    if not on_gpu and not args.tiny:
        print("gpu_opd_step: warning: no CUDA device; CPU numbers (use --tiny for a quick smoke run)", file=sys.stderr)
    layouts = ["default", "real"] if args.layout == "both" else [args.layout]
    rows = []
    for layout in layouts:
        pair, task, name = (default_layout if layout == "default" else real_layout)(args)
        for est in [e.strip() for e in args.estimators.split(",") if e.strip()]:
            row = bench(pair, task, name, est, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        del pair
        if on_gpu:
            torch.cuda.empty_cache()
    mem_key = "peak_gpu_gib" if on_gpu else "peak_cpu_rss_gib"
    print(f"\n| layout | estimator | tokens/step | tokens/s | step s (rollout s) | peak {'GPU' if on_gpu else 'RSS'} GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['estimator']} | {r['tokens_per_step']:.0f} | {r['tokens_per_s']:.1f} | "
            f"{r['step_s']:.2f} ({r['rollout_s']:.2f}) | {r[mem_key]:.2f} |"
        )
    return 0 if all(r["finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
