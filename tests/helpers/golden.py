"""Short reference runs whose per-step losses and eval metrics are pinned in
``tests/data/golden_runs.json``: a change of layout or speed must leave them equal.

The runs are float64 (weights, optimizer, objective; the scorer still rounds teacher logits
to float32, a rounding of float64 values that every CPU does alike) on a pair whose weights
are exact dyadic numbers, so the pins hold on any x86-64 CPU: in float32 another CPU's kernels
round differently and the numbers move by ~3e-5 relative after four steps; in float64 by
~6e-14. Re-record after a change that is meant to move them (from the repository root)::

    PYTHONPATH=tests python -m helpers.golden --record
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

GOLDEN_FILE = Path(__file__).resolve().parent.parent / "data" / "golden_runs.json"

# name -> config groups (on top of the tiny test config; every run evaluates at steps 0, 2, 4)
GOLDEN_RUNS: dict[str, dict] = {
    "default": {},
    "sampled_ppo_jsd_sequence": dict(
        estimator={"name": "sampled"},
        loss={"name": "ppo", "credit": "sequence", "gamma": 1.0},
        divergence={"name": "jsd", "beta": 0.5},
    ),
    "on_policy_half": dict(rollout={"on_policy_fraction": 0.5}),
}

STEP_KEYS = ("loss", "jsd/mean", "kl/reverse", "kl/forward", "grad/norm", "student/logprob_mean")
# eval/accuracy is left out: the tiny pair never answers right, so a pinned 0 could not fail
EVAL_KEYS = ("eval/jsd", "eval/kl_reverse", "eval/kl_forward")

# Measured spread of the float64 pins: 0 between repeats; <= 6e-14 relative between 1 and 2
# threads and between CPU kernel sets (ATEN_CPU_CAPABILITY=default|avx2|avx512, MKL and oneDNN
# limited to AVX2, MKL_CBWR=COMPATIBLE), where float32 pins moved by up to 3e-5. RTOL leaves 1e4
# of margin above that and still fails a 1e-6 relative change of any one value (tests/test_golden.py
# checks both). No pinned value is near 0 (checked), so ATOL only keeps the comparison defined.
RTOL, ATOL = 1e-9, 1e-15


def golden_groups(name: str) -> dict:
    groups = {g: dict(v) for g, v in GOLDEN_RUNS[name].items()}
    groups.setdefault("trainer", {}).update(max_steps=4, eval_every=2)
    # Recorded with HF generate drawing from torch's global RNG: another engine draws other
    # (equally distributed) tokens, so the pinned runs name theirs.
    groups.setdefault("rollout", {}).setdefault("engine", "hf")
    return groups


def build_pair(root: Path) -> Path:
    """The golden runs' own tiny pair, saved under ``root`` (independent of the test fixtures,
    so a change there does not move the pins)."""
    from helpers.tiny import build_model, build_tokenizer

    tok = build_tokenizer(root / "tokenizer")
    for role, vocab, layers, seed in (("student", len(tok), 1, 1), ("teacher", len(tok) + 8, 2, 2)):  # padded teacher rows
        model = build_model(root / role, vocab, hidden=32, layers=layers, seed=seed)
        portable_weights(model, seed)
        model.save_pretrained(root / role)
    return root


def portable_weights(model, seed: int) -> None:
    """Every weight matrix drawn again as k / 4096, k uniform in [-142, 142] (std ~0.02, as
    transformers' init): integers from torch's generator, exact in float32 and float64. The
    library's normal init goes through log and cos, whose float32 rounding differs between
    CPUs (~2e-7 relative in the pins otherwise). Norm weights 1, biases 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim >= 2:
                p.copy_(torch.randint(-142, 143, p.shape, generator=g).to(p.dtype) / 4096)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)


def load_pair(root: Path) -> SimpleNamespace:
    """The saved pair in float64 (built in float32: the same bytes on every CPU, then widened)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    return SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(root / "student").double(),
        teacher=AutoModelForCausalLM.from_pretrained(root / "teacher").double(),
        tokenizer=tok,
        vocab_size=len(tok),
    )


@contextlib.contextmanager
def float64():
    """The trainer in float64 for the duration: it has no float64 setting (scale.param_dtype
    is fp32 or bf16), so its fp32 maps to float64, and new tensors default to float64."""
    from opd_exp.runtime import precision

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with mock.patch.dict(precision.DTYPES, fp32=torch.float64):
            yield
    finally:
        torch.set_default_dtype(previous)


def run(name: str, run_dir: Path, pair_root: Path, **changes):
    """One golden run in float64; returns the trainer. ``changes`` updates config groups."""
    from helpers.tiny import AddTask, small_config
    from opd_exp.training.trainer import Trainer

    groups = golden_groups(name)
    for group, fields in changes.items():
        groups.setdefault(group, {}).update(fields)
    with float64():
        trainer = Trainer(small_config(**groups), run_dir, pair=load_pair(pair_root), task=AddTask())
        trainer.run()
    return trainer


def read_record(run_dir: Path) -> dict[str, list]:
    """The pinned numbers of a finished run folder: per-step values and eval values."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    record: dict[str, list] = {}
    for r in rows:
        keys = EVAL_KEYS if "eval/jsd" in r else ()
        keys = keys + (STEP_KEYS if r["step"] > 0 else ())
        for k in keys:
            if k in r:
                record.setdefault(k, []).append([r["step"], r[k]])
    return record


def mismatches(got: dict[str, list], want: dict[str, list]) -> list[str]:
    """Every pinned value that ``got`` does not reproduce within RTOL/ATOL (empty: equal)."""
    out = [f"keys: got {sorted(got)}, pinned {sorted(want)}"] if sorted(got) != sorted(want) else []
    for key in sorted(set(got) & set(want)):
        if [s for s, _ in got[key]] != [s for s, _ in want[key]]:
            out.append(f"{key}: steps {[s for s, _ in got[key]]}, pinned {[s for s, _ in want[key]]}")
            continue
        for (step, a), (_, b) in zip(got[key], want[key]):
            if not math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL):
                out.append(f"{key} at step {step}: {a!r}, pinned {b!r} (rel {abs(a - b) / max(abs(b), 1e-300):.1e})")
    return out


def degenerate(pinned: dict[str, dict[str, list]]) -> list[str]:
    """What would make the pins unable to fail: a value at 0 (or not finite), a metric that
    repeats a value across steps, a run whose losses equal another run's."""
    out = []
    for name, record in pinned.items():
        for key, rows in record.items():
            values = [v for _, v in rows]
            if not all(math.isfinite(v) and abs(v) > 1e-6 for v in values):
                out.append(f"{name} {key}: a value at 0 or not finite: {values}")
            if len(set(values)) != len(values):
                out.append(f"{name} {key}: repeats a value across steps: {values}")
    losses = {name: tuple(v for _, v in record.get("loss", [])) for name, record in pinned.items()}
    if len(set(losses.values())) != len(losses):
        out.append(f"two runs have the same losses: {losses}")
    return out


def record_all(pair_root: Path, work: Path) -> dict[str, dict[str, list]]:
    return {name: read_record(run(name, work / name, pair_root).run_dir) for name in sorted(GOLDEN_RUNS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the golden runs and compare them with the pins, or re-record the pins.")
    parser.add_argument("--record", action="store_true", help=f"overwrite {GOLDEN_FILE.name} with this machine's runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as in the tests (the pins do not depend on it: measured)
    with tempfile.TemporaryDirectory() as tmp:
        got = record_all(build_pair(Path(tmp) / "pair"), Path(tmp) / "runs")
    problems = degenerate(got)
    if args.record:
        if problems:
            print("not recorded: the runs would give pins that cannot fail:\n  " + "\n  ".join(problems))
            return 1
        GOLDEN_FILE.write_text(json.dumps(got, indent=1) + "\n")
        print(f"recorded {sum(len(v) for r in got.values() for v in r.values())} values of {len(got)} runs in {GOLDEN_FILE}")
        return 0
    pinned = json.loads(GOLDEN_FILE.read_text())
    problems += [f"{name}: {m}" for name in sorted(pinned) for m in mismatches(got.get(name, {}), pinned[name])]
    print("\n".join(problems) or f"the golden runs reproduce {GOLDEN_FILE.name}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
