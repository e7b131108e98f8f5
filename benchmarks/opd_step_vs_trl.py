"""One OPD training step, opd-exp vs TRL 1.16's ``DistillationTrainer``, side by side.

Both sides train the same random student (embedded size: hidden 48, 2 layers) against the same
random teacher (hidden 64, 2 layers) over the embedded tokenizer (V=259), from the same prompts
(arithmetic problems), 64 prompts x 1 sample per step, full-vocabulary loss (opd-exp:
estimator=full loss=direct, the GKD objective TRL computes), AdamW at the same lr, fp32, one
torch thread per process. Every response is forced to the same length on both sides (EOS
banned until ``--length`` tokens: TRL through ``generation_kwargs.min_new_tokens``, opd-exp
through the lean sampler's ``min_new_tokens``), so both generate and train on the same amount.

Each (implementation, divergence) run is a fresh process; repetitions interleave the
implementations so drift on a shared machine hits all of them. Reported per step (after
``--warmup`` steps): CPU time and wall time (median and range over steps and repetitions),
response tokens/s, peak RSS, mean completion length, and the loss of the first and last
steps (a learning check).

    python benchmarks/opd_step_vs_trl.py                      # 3 repetitions x fkl, jsd, rkl
    python benchmarks/opd_step_vs_trl.py --repeats 1 --steps 6 --divergences jsd   # quick look

Implementations: ``trl`` (DistillationTrainer), ``opd-hf`` (opd-exp, rollout.engine=hf:
generate, lengths not forced: compare per token), ``opd-lean`` (opd-exp, rollout.engine=lean),
``opd-quiet`` (opd-lean without the per-step monitors: trainer.exact_metrics=false
trainer.overlap_k=0),
``floor`` (the training pass alone on one sampled batch: teacher forward, student forward, the
exact divergence, backward; no sampling, monitors or optimizer step -- the shared work no OPD
step of this kind can skip, so no implementation's ratio can fall below floor/trl).
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

DIVERGENCES = {"fkl": 0.0, "jsd": 0.5, "rkl": 1.0}  # TRL's beta for each (GKD/TRL convention)
FORCED = ("trl", "opd-lean", "opd-quiet", "floor")  # every response exactly --length tokens


def _tokenizer_dir() -> Path:
    """The embedded tokenizer (V=259), from the cache or the package on first use."""
    from opd_exp.pairs.embedded.prepare import embedded_tokenizer_dir

    return Path(embedded_tokenizer_dir())


def build_pair(root: Path) -> None:
    """Random Qwen2 student and teacher of the embedded sizes, saved with the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(_tokenizer_dir())
    for name, hidden, inter, seed in (("student", 48, 192, 1), ("teacher", 64, 256, 2)):
        torch.manual_seed(seed)
        cfg = Qwen2Config(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
        )
        model = AutoModelForCausalLM.from_config(cfg)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)


def prompts(n: int) -> list[str]:
    import random

    from opd_exp.tasks.arithmetic import ArithmeticSpec, sample_problem

    rng = random.Random(0)
    return [sample_problem(rng, ArithmeticSpec()).prompt for _ in range(n)]


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_trl(root: Path, div: str, a) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    tok = AutoTokenizer.from_pretrained(root / "student")
    student = AutoModelForCausalLM.from_pretrained(root / "student")
    teacher = AutoModelForCausalLM.from_pretrained(root / "teacher")
    data = Dataset.from_dict({"prompt": prompts(a.batch * a.steps)})
    times: list[tuple[float, float]] = []
    lengths: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = (time.process_time(), time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times.append((time.process_time() - self.t[0], time.perf_counter() - self.t[1]))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    args = DistillationConfig(
        output_dir=str(root / f"trl-{div}"),
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=DIVERGENCES[div],
        temperature=1.0,
        max_completion_length=a.length,
        generation_kwargs={"min_new_tokens": a.length},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        seed=0,
    )
    trainer = DistillationTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=data, processing_class=tok, callbacks=[Clock()]
    )
    torch.set_num_threads(1)
    trainer.train()
    return {"times": times, "losses": losses, "length": statistics.mean(lengths) if lengths else float("nan"), "lengths": lengths}


def build_opd(root: Path, div: str, engine: str, a, monitors: bool = True):
    """opd-exp's Trainer on the benchmark pair and prompts (full-vocabulary loss, direct);
    ``monitors=False``: trainer.exact_metrics=false trainer.overlap_k=0."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd_exp.config import schema as S
    from opd_exp.config.world import ModelPairConfig, TaskConfig
    from opd_exp.training.trainer import Trainer

    tok = AutoTokenizer.from_pretrained(root / "student")
    pair = SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(root / "student"),
        teacher=AutoModelForCausalLM.from_pretrained(root / "teacher"),
        tokenizer=tok,
        vocab_size=len(tok),
    )
    texts = prompts(a.batch * a.steps)
    task = SimpleNamespace(
        train_problems=lambda: [SimpleNamespace(prompt=p, answer="0") for p in texts],
        eval_problems=lambda: [SimpleNamespace(prompt=texts[0], answer="0")],
        render_prompt=lambda p, tokenizer: p.prompt,
        verify=lambda completion, answer: False,
    )
    dname = S.DivergenceName(div)
    cfg = S.TrainConfig(
        model_pair=ModelPairConfig(),
        task=TaskConfig(),
        divergence=S.DivergenceConfig(name=dname, beta=0.5),
        estimator=S.EstimatorConfig(name=S.EstimatorName.full),
        loss=S.LossConfig(name=S.LossName.direct),
        rollout=S.RolloutConfig(max_new_tokens=a.length, max_prompt_tokens=64, engine=S.RolloutEngine(engine)),
        trainer=S.TrainerConfig(
            max_steps=a.steps,
            batch_size=a.batch,
            lr=a.lr,
            warmup_steps=0,
            schedule=S.Schedule.constant,
            progress=False,
            exact_metrics=monitors,
            overlap_k=8 if monitors else 0,
        ),
        eval=S.EvalConfig(every=0, size=1),
        checkpoint=S.CheckpointConfig(every=0),
        scale=S.ScaleConfig(device="cpu", num_threads=1),
        logger=S.LoggerConfig(name=S.LoggerName.none),
    )
    return Trainer(cfg, root / f"opd-{engine}-{div}", pair=pair, task=task)


def _force_lengths(tr, a) -> None:
    """Fixed lengths, as on the TRL side: the lean sampler bans EOS until --length tokens.
    Set on the trainer's own student engine: it bound ``lean_generate`` when it was built, so
    patching ``sampler.lean_generate`` afterwards changes nothing (the bug that let responses
    end early: 36.5 tokens against TRL's 40)."""
    import functools

    from opd_exp.training.sampler import lean_generate

    engine = tr.engines.student
    if getattr(engine, "decoder", None) is not lean_generate:
        sys.exit(f"opd-lean: the student's engine does not decode with lean_generate ({type(engine).__name__}); cannot force lengths")
    engine.decoder = functools.partial(lean_generate, min_new_tokens=a.length)


def check_forced(impl: str, lengths: list[float], a) -> None:
    """Every step of a forced implementation (trl, opd-lean, opd-quiet, floor) has exactly
    --length tokens per response; anything else would compare different amounts of work."""
    if impl in FORCED and any(x != a.length for x in lengths):
        sys.exit(f"{impl}: responses not forced to --length {a.length}: mean lengths per step {lengths}")


def run_opd(root: Path, div: str, engine: str, a, monitors: bool = True) -> dict:
    import torch

    tr = build_opd(root, div, engine, a, monitors)
    if engine == "lean":
        _force_lengths(tr, a)
    torch.set_num_threads(1)
    times, losses, lengths = [], [], []
    for _ in range(a.steps):
        c0, w0 = time.process_time(), time.perf_counter()
        m = tr.train_step()
        times.append((time.process_time() - c0, time.perf_counter() - w0))
        losses.append(m["loss"])
        lengths.append(m["response/length_mean"])
    return {"times": times, "losses": losses, "length": statistics.mean(lengths), "lengths": lengths}


def run_floor(root: Path, div: str, a) -> dict:
    """The training pass alone, on one batch the lean sampler drew: teacher forward, student
    forward, the exact full-vocabulary divergence and backward -- work every OPD step of this
    kind does on both sides (TRL computes the same forwards, loss and backward). Any step that
    also samples, monitors and updates costs more: this is the floor the ratio cannot beat."""
    import torch

    from opd_exp.training.scoring import dropout_off

    tr = build_opd(root, div, "lean", a)
    _force_lengths(tr, a)
    torch.set_num_threads(1)
    batch = tr.sample(0)
    d, n = tr.objective.div, batch.num_response_tokens
    times, losses = [], []
    for _ in range(a.steps):
        c0, w0 = time.process_time(), time.perf_counter()
        tr.optimizer.zero_grad(set_to_none=True)
        zt = tr.teacher_scorer.logits(batch)
        with dropout_off(tr.student):
            zs = tr.student_logits(tr.train_module, batch)
            loss = d.full(zs, zt, mask=batch.response_mask.bool()).sum() / n
            loss.backward()
        times.append((time.process_time() - c0, time.perf_counter() - w0))
        losses.append(float(loss))
    return {"times": times, "losses": losses, "length": n / batch.num_sequences, "lengths": [n / batch.num_sequences]}


def _worker(a) -> None:
    root = Path(a.root)
    impl, div = a.worker.split(":")
    if impl == "floor":
        out = run_floor(root, div, a)
    elif impl == "opd-quiet":
        out = run_opd(root, div, "lean", a, monitors=False)
    else:
        out = run_trl(root, div, a) if impl == "trl" else run_opd(root, div, impl.split("-")[1], a)
    check_forced(impl, out["lengths"], a)
    out["peak_gib"] = _peak_gib()
    print("RESULT " + json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=40, help="response tokens per row (forced on trl and opd-lean)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--divergences", default="fkl,jsd,rkl")
    p.add_argument("--impls", default="trl,opd-hf,opd-lean,opd-quiet,floor")
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        _worker(a)
        return
    impls, divs = a.impls.split(","), a.divergences.split(",")
    known = ("trl", "opd-hf", "opd-lean", "opd-quiet", "floor")
    for name, given, allowed in (("--impls", impls, known), ("--divergences", divs, tuple(DIVERGENCES))):
        if bad := [x for x in given if x not in allowed]:
            p.error(f"{name}: {','.join(bad)} unknown; allowed: {', '.join(allowed)}")
    os.environ["OMP_NUM_THREADS"] = "1"
    root = Path(tempfile.mkdtemp(prefix="opd_vs_trl_"))
    build_pair(root)
    runs: dict[tuple[str, str], list[dict]] = {(i, d): [] for d in divs for i in impls}
    for _ in range(a.repeats):
        for d in divs:
            for i in impls:  # interleaved
                cmd = [sys.executable, __file__, "--worker", f"{i}:{d}", "--root", str(root)]
                cmd += [f"--{k}={getattr(a, k)}" for k in ("steps", "batch", "length", "lr")]
                res = subprocess.run(cmd, capture_output=True, text=True)
                line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
                if res.returncode or not line:
                    sys.exit(f"{i}:{d} failed:\n{res.stderr[-3000:]}")
                runs[(i, d)].append(json.loads(line[-1][7:]))

    print(
        f"one OPD step, {a.batch} prompts x 1 sample, {a.length} response tokens, embedded-size random pair "
        f"(V=259), fp32 CPU, 1 thread, {a.repeats} fresh processes x {a.steps - a.warmup} steps after {a.warmup} warm-up"
    )
    print(
        "| divergence | implementation | CPU s/step median [range] | wall s/step median [range] | tokens/s | peak RSS GiB | mean length | loss first -> last | CPU ratio vs trl |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    med_cpu = {}
    for d in divs:
        for i in impls:
            rs = runs[(i, d)]
            cpu = [t[0] for r in rs for t in r["times"][a.warmup :]]
            wall = [t[1] for r in rs for t in r["times"][a.warmup :]]
            med_cpu[(i, d)] = statistics.median(cpu)
            length = statistics.mean(r["length"] for r in rs)
            tps = a.batch * length / statistics.median(wall)
            peak = statistics.median(r["peak_gib"] for r in rs)
            lf = statistics.mean(r["losses"][0] for r in rs)
            ll = statistics.mean(statistics.mean(r["losses"][-3:]) for r in rs)
            ratio = med_cpu[(i, d)] / med_cpu[("trl", d)] if ("trl", d) in med_cpu else float("nan")
            print(
                f"| {d} | {i} | {statistics.median(cpu):.3f} [{min(cpu):.3f}, {max(cpu):.3f}] | "
                f"{statistics.median(wall):.3f} [{min(wall):.3f}, {max(wall):.3f}] | {tps:.0f} | {peak:.2f} | "
                f"{length:.1f} | {lf:.4f} -> {ll:.4f} | {ratio:.2f} |"
            )
    (root / "runs.json").write_text(json.dumps({f"{i}:{d}": v for (i, d), v in runs.items()}))
    print(f"raw runs: {root / 'runs.json'}")


if __name__ == "__main__":
    main()
