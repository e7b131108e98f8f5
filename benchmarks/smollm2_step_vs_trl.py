"""One on-policy distillation step on the SmolLM2 pair: opd-exp's trainer vs TRL's DistillationTrainer.

Same pair (the converted SmolLM2-135M-Instruct teacher and its layer-pruned student, from the
cache ``opd-prepare model_pair=smollm2`` builds), same prompts in the same order (the
chat_arithmetic training problems, rendered by the task: chat template plus the opened answer),
same batch, response cap, sampling (temperature 1, no top-k/top-p) and objective (reverse KL
over the whole vocabulary at every sampled position; TRL: ``beta=1.0``), AdamW at lr 1e-4.

Each measurement is a fresh process with one torch thread; the two implementations alternate
(``opd trl trl opd opd trl ...``) so load on a shared machine hits both alike. Per step: wall
time and CPU time (``time.process_time``) split into rollout / teacher scoring / the rest
(student forward + loss + backward + optimizer step), response tokens, and the process's peak
RSS. The first step of every process is a warm-up and is left out; medians over the others.

    python benchmarks/smollm2_step_vs_trl.py                      # 3 repetitions x 4 steps each
    python benchmarks/smollm2_step_vs_trl.py --reps 5 --steps 6 --batch 8 --json out.json

What each split contains:
  opd  rollout = ``Trainer.sample`` (generate, layout); teacher = ``InProcessTeacher.logits``
       (teacher forward, logits on the response positions); rest = student forward, exact
       chunked reverse KL, backward, clip, AdamW step.
  trl  rollout = ``_generate_and_score_completions`` (tokenize, generate, pad); teacher = the
       teacher backbone forward (``_get_last_hidden_state`` on the teacher); rest = student
       backbone forward, the chunked divergence (which also projects the teacher's hidden states
       through its head, so some teacher work sits here), backward, clip, AdamW step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-4


class Clock:
    """Wall and CPU seconds spent inside wrapped calls (not re-entrant: no nesting here)."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - w
                self.cpu += time.process_time() - c

        return timed

    def take(self) -> tuple[float, float]:
        out = (self.wall, self.cpu)
        self.wall = self.cpu = 0.0
        return out


def _config(batch: int, max_new: int):
    from opd_exp.cli.compose import compose_config

    return compose_config(
        "experiment=smollm2_recovery",
        f"trainer.batch_size={batch}",
        f"rollout.max_new_tokens={max_new}",
        f"trainer.lr={LR}",
        "trainer.warmup_steps=0",
        "trainer.progress=false",
        "scale.num_threads=1",
    )


def _prompts(cfg, task, tokenizer, steps: int) -> list[list[str]]:
    """The prompts the opd trainer draws at each step (its data cursor), rendered by the task."""
    from opd_exp.training.state import DataCursor

    problems = task.train_problems()
    cursor = DataCursor(len(problems), cfg.seed)
    return [[task.render_prompt(problems[i], tokenizer) for i in cursor.next(cfg.trainer.batch_size)] for _ in range(steps)]


def worker_opd(steps: int, batch: int, max_new: int) -> list[dict]:
    from opd_exp.pairs import load_pair
    from opd_exp.tasks import build_task
    from opd_exp.training.trainer import Trainer

    cfg = _config(batch, max_new)
    task = build_task(cfg.task)
    pair = load_pair(cfg.model_pair, cfg.task, "cpu", progress=False)
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="opd-bench-")), pair=pair, task=task)
    rollout, teacher = Clock(), Clock()
    trainer.sample = rollout.wrap(trainer.sample)
    trainer.teacher_scorer.logits = teacher.wrap(trainer.teacher_scorer.logits)
    rows = []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        metrics = trainer.train_step()
        wall, cpu = time.perf_counter() - w, time.process_time() - c
        (rw, rc), (tw, tc) = rollout.take(), teacher.take()
        tokens = metrics["response/length_mean"] * batch
        rows.append(_row(wall, cpu, rw, rc, tw, tc, tokens, float(metrics["loss"])))
    return rows


def worker_trl(steps: int, batch: int, max_new: int) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    from opd_exp.pairs import resolve_pair
    from opd_exp.tasks import build_task

    cfg = _config(batch, max_new)
    task = build_task(cfg.task)
    student_dir, teacher_dir = resolve_pair(cfg.model_pair, cfg.task, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(student_dir, padding_side="left")
    prompts = [p for step in _prompts(cfg, task, tokenizer, steps) for p in step]
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32, use_safetensors=True)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32, use_safetensors=True)
    args = DistillationConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        max_completion_length=max_new,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=1.0,  # reverse KL
        shuffle_dataset=False,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        disable_dropout=True,
        seed=cfg.seed,
    )
    trainer = DistillationTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer
    )
    torch.set_num_threads(1)
    rollout, teacher_clock = Clock(), Clock()
    tokens = []
    score = trainer._generate_and_score_completions

    def scored(inputs):
        out = score(inputs)
        tokens.append(float(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = rollout.wrap(scored)
    hidden = trainer._get_last_hidden_state
    teacher_hidden = teacher_clock.wrap(hidden)
    trainer._get_last_hidden_state = lambda model, *a, **k: (teacher_hidden if model is trainer.teacher_model else hidden)(model, *a, **k)
    rows = []

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.w, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            wall, cpu = time.perf_counter() - self.w, time.process_time() - self.c
            (rw, rc), (tw, tc) = rollout.take(), teacher_clock.take()
            rows.append(_row(wall, cpu, rw, rc, tw, tc, tokens[-1] if tokens else 0.0, float("nan")))

    trainer.add_callback(Steps())
    # the same prompt ids as opd-exp's rollout (no special tokens added to a rendered chat prompt)?
    ours = tokenizer(prompts[0], add_special_tokens=False)["input_ids"]
    theirs = trainer._tokenize_prompts([prompts[0]])[0][0]
    trainer.train()
    rows[0]["same_prompt_ids"] = ours == list(theirs)
    return rows


def _row(wall, cpu, rw, rc, tw, tc, tokens, loss) -> dict:
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "rollout_wall_s": rw,
        "rollout_cpu_s": rc,
        "teacher_wall_s": tw,
        "teacher_cpu_s": tc,
        "rest_wall_s": wall - rw - tw,
        "rest_cpu_s": cpu - rc - tc,
        "response_tokens": tokens,
        "loss": loss,
    }


def run_worker(impl: str, steps: int, batch: int, max_new: int) -> dict:
    """One fresh process: its per-step rows and peak RSS."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        impl,
        "--steps",
        str(steps),
        "--batch",
        str(batch),
        "--max-new",
        str(max_new),
        "--out",
        out,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{impl} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(Path(out).read_text())


def summarise(results: dict[str, list[dict]]) -> dict:
    table = {}
    for impl, runs in results.items():
        steps = [r for run in runs for r in run["rows"][1:]]  # drop each process's warm-up step
        med = {k: statistics.median(r[k] for r in steps) for k in steps[0] if k not in ("loss", "same_prompt_ids")}
        med["tokens_per_s"] = statistics.median(r["response_tokens"] / r["wall_s"] for r in steps)
        med["peak_rss_mib"] = statistics.median(run["peak_rss_mib"] for run in runs)
        med["n_steps"] = len(steps)
        table[impl] = med
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="fresh processes per implementation")
    parser.add_argument("--steps", type=int, default=4, help="steps per process (the first is a warm-up)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per step (one response each)")
    parser.add_argument("--max-new", type=int, default=6, help="response cap in tokens")
    parser.add_argument("--json", type=Path, default=None, help="also write every row here")
    parser.add_argument("--worker", choices=("opd", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(1)
        rows = (worker_opd if args.worker == "opd" else worker_trl)(args.steps, args.batch, args.max_new)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        Path(args.out).write_text(json.dumps({"rows": rows, "peak_rss_mib": peak}))
        return
    order = [("opd", "trl") if i % 2 == 0 else ("trl", "opd") for i in range(args.reps)]
    results: dict[str, list[dict]] = {"opd": [], "trl": []}
    started = time.perf_counter()
    for pair in order:
        for impl in pair:
            results[impl].append(run_worker(impl, args.steps, args.batch, args.max_new))
            print(f"  {impl}: {[round(r['wall_s'], 2) for r in results[impl][-1]['rows']]} s/step", flush=True)
    table = summarise(results)
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    print(
        f"\nbatch {args.batch} prompts x 1 response, <= {args.max_new} new tokens; {args.reps} processes x {args.steps - 1} timed steps each; "
        f"one torch thread; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; total {time.perf_counter() - started:.0f} s"
    )
    cols = [
        ("wall_s", "step wall s"),
        ("cpu_s", "step CPU s"),
        ("rollout_wall_s", "rollout wall"),
        ("teacher_wall_s", "teacher wall"),
        ("rest_wall_s", "student fwd+bwd+opt wall"),
        ("rollout_cpu_s", "rollout CPU"),
        ("teacher_cpu_s", "teacher CPU"),
        ("rest_cpu_s", "student fwd+bwd+opt CPU"),
        ("response_tokens", "response tokens"),
        ("tokens_per_s", "tokens/s (wall)"),
        ("peak_rss_mib", "peak RSS MiB"),
    ]
    print("| median per step | " + " | ".join(table) + " |")
    print("|---|" + "---|" * len(table))
    for key, label in cols:
        print(f"| {label} | " + " | ".join(f"{table[i][key]:.2f}" for i in table) + " |")
    same = results["trl"][0]["rows"][0].get("same_prompt_ids")
    print(f"TRL tokenises the rendered prompt to the same ids as opd-exp: {same}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "medians": table, "args": vars(args) | {"json": str(args.json)}}, indent=1))


if __name__ == "__main__":
    main()
