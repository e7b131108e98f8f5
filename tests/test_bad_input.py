"""The bad-input matrix, end to end through the CLI (`opd_exp.cli.train.main`, sys.argv patched):
every case ends in exactly one `opd-train: error: ...` line and a non-zero exit, or in the
documented recovery (exit 0, a warning line, a counted metric); never a traceback, never a
damaged run folder. docs/reliability.md has the same table."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import opd_exp.training.rollout as rollout_mod
import opd_exp.training.sampler as sampler_mod
import opd_exp.training.scoring as scoring_mod
from helpers.reliability import BASE, one_error_line, pair_args, read_metrics, run_in_process
from opd_exp.config.world import TASKS
from opd_exp.divergences import DIVERGENCES
from opd_exp.runtime import checkpoint

MINI = Path(__file__).resolve().parents[1] / "opd_exp" / "data" / "gsm8k_mini.jsonl"
QUICK = ["trainer.max_steps=2"]


@dataclass
class Ctx:
    pair: Path
    models: dict
    tmp: Path
    monkeypatch: pytest.MonkeyPatch
    checks: list[Callable[[Path, str], None]] = field(default_factory=list)

    def gsm8k(self, text: bytes | str, name: str = "data.jsonl") -> list[str]:
        path = self.tmp / name
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return (
            pair_args(self.pair)
            + BASE
            + QUICK
            + ["task=gsm8k", f"task.path={path}", "task.n_eval=2", "eval.size=2", "rollout.max_prompt_tokens=48"]
        )


CASES: dict[str, tuple[Callable[[Ctx], list[str]], int, str]] = {}


def case(name: str, code: int, needle: str):
    def register(fn):
        CASES[name] = (fn, code, needle)
        return fn

    return register


def cfg(name, overrides, needle):
    case(name, 2, needle)(lambda ctx: pair_args(ctx.pair) + BASE + QUICK + overrides)


# -- configs: fail at start-up, before any model loads ---------------------------------
cfg("config/beta_1.5", ["divergence=jsd", "divergence.beta=1.5"], "divergence.beta=1.5 is not allowed; allowed: 0 <= beta <= 1")
cfg("config/beta_nan", ["divergence=jsd", "divergence.beta=nan"], "divergence.beta=nan is not allowed")
cfg("config/temperature_0", ["rollout.temperature=0"], "rollout.temperature=0.0 is not allowed; allowed: > 0")
cfg("config/max_new_tokens_0", ["rollout.max_new_tokens=0"], "rollout.max_new_tokens=0 is not allowed; allowed: integer >= 1")
cfg("config/n_samples_0", ["rollout.n_samples=0"], "rollout.n_samples=0 is not allowed")
cfg("config/lr_negative", ["trainer.lr=-1e-3"], "trainer.lr=-0.001 is not allowed; allowed: >= 0")
cfg("config/on_policy_fraction_2", ["rollout.on_policy_fraction=2"], "rollout.on_policy_fraction=2.0 is not allowed")
cfg("config/max_bad_steps_0", ["trainer.max_bad_steps=0"], "trainer.max_bad_steps=0 is not allowed; allowed: integer >= 1")
cfg("config/device_unknown", ["scale.device=tpu"], "scale.device='tpu' is not allowed; allowed: auto, cpu, cuda, cuda:N, mps")
cfg("config/unknown_key_plus", ["+foo=1"], "foo: unknown key; allowed:")
cfg("config/unknown_key_in_group", ["trainer.nope=1"], "trainer.nope")
cfg("config/unknown_group_option", ["divergence=nope"], "divergence=nope: no such option; allowed: " + ", ".join(sorted(DIVERGENCES)))
cfg("config/wrong_type", ["trainer.lr=abc"], "trainer.lr")
cfg(
    "config/direct_with_sampled",
    ["loss=direct", "estimator=sampled"],
    "loss.name='direct' is not allowed; allowed: ppo or reinforce with estimator=sampled",
)
cfg("config/ppo_with_full", ["loss=ppo", "estimator=full"], "estimator.name='full' is not allowed; allowed: sampled with loss=ppo")
cfg(
    "config/live_teacher_without_context",
    ["teacher=live", "teacher.privileged=none"],
    "teacher.privileged='none' is not allowed; allowed: solution or answer with teacher=live",
)
cfg("config/ema_decay_1", ["teacher=ema", "teacher.decay=1.0"], "teacher.decay=1.0 is not allowed; allowed: 0 <= decay < 1")
cfg("config/teacher_unknown", ["teacher.name=swa"], "teacher.name")
cfg(
    "config/old_and_new_key_disagree",
    ["trainer.eval_every=5", "eval.every=7"],
    "opd-train: error: trainer.eval_every=5 and eval.every=7: the same setting given twice (trainer.eval_every is the old name of "
    "eval.every), and only one would be kept; allowed: eval.every=<value> alone",
)
cfg("config/unknown_task", ["task.name=mmlu"], "task.name='mmlu' is not allowed; allowed: " + " | ".join(TASKS))


# -- data ---------------------------------------------------------------------------------
case("data/empty_dataset", 2, "holds no problems (empty file)")(lambda ctx: ctx.gsm8k(""))
case("data/non_utf8_line", 2, "data.jsonl line 3 is not UTF-8 text (byte 0xff)")(
    lambda ctx: ctx.gsm8k(b"".join(MINI.read_bytes().splitlines(keepends=True)[:2]) + b'{"question": "caf\xff?", "answer": "#### 1"}\n')
)
case("data/invalid_json_line", 2, "data.jsonl line 2 is not valid JSON; allowed: one JSON object per line")(
    lambda ctx: ctx.gsm8k(MINI.read_text().splitlines()[0] + '\n{"question": \n')
)
case("data/answer_not_a_number", 2, "has a final answer that is not a number ('abc'); allowed: '#### <number>'")(
    lambda ctx: ctx.gsm8k('{"question": "q?", "answer": "so #### abc"}\n')
)
case("data/answer_without_marker", 2, "data.jsonl line 1 is not a GSM8K row")(lambda ctx: ctx.gsm8k('{"question": "q?", "answer": "42"}\n'))
case("data/row_not_an_object", 2, "data.jsonl line 1 is a JSON list, not an object")(lambda ctx: ctx.gsm8k("[1, 2]\n"))
case("data/missing_file", 2, "does not exist")(
    lambda ctx: ctx.gsm8k("")[:-4] + ["task.path=/no/such/gsm8k.jsonl", "task.n_eval=2", "eval.size=2", "rollout.max_prompt_tokens=48"]
)


@case("data/blank_lines_are_skipped", 0, "")
def _blank_lines(ctx):
    lines = MINI.read_text().splitlines()
    ctx.checks.append(lambda run, err: read_metrics(run)[-1]["step"] == 2)
    return ctx.gsm8k("\n\n".join(lines[:8]) + "\n   \n")


@case("data/prompt_longer_than_max_prompt_tokens", 0, "are longer than rollout.max_prompt_tokens=3 and are cut from the left")
def _long_prompts(ctx):
    def counted(run, err):
        rows = read_metrics(run)
        assert all(r["rollout/truncated_prompts"] == 2 for r in rows[1:])  # batch_size 2: both cut
        assert err.count("are longer than rollout.max_prompt_tokens=3") == 1  # warned once, not every step

    ctx.checks.append(counted)
    return pair_args(ctx.pair) + BASE + QUICK + ["rollout.max_prompt_tokens=3"]


# -- models: pre-flight, before weights load ------------------------------------------------
case("model/missing_path", 2, "model_pair.student: local folder '/no/such/student' does not exist")(
    lambda ctx: pair_args(ctx.pair, student="/no/such/student") + BASE + QUICK
)
case("model/folder_without_config", 2, "has no config.json; allowed: a folder written by save_pretrained")(
    lambda ctx: pair_args(ctx.pair, teacher=ctx.models["empty"]) + BASE + QUICK
)
case("model/tokenizer_mismatch", 2, "maps text to different ids than the student's")(
    lambda ctx: pair_args(ctx.pair, teacher=ctx.models["other_tokenizer"]) + BASE + QUICK
)
case("model/irreconcilable_vocab", 2, "has 64 embedding rows but the tokenizer has 259 tokens")(
    lambda ctx: pair_args(ctx.pair, teacher=ctx.models["small_vocab"]) + BASE + QUICK
)
case("model/trust_remote_code_required", 2, "model_pair.trust_remote_code: got False, but model_pair.teacher=")(
    lambda ctx: pair_args(ctx.pair, teacher=ctx.models["remote_code"]) + BASE + QUICK
)
case("model/pickled_weights_only", 2, "cannot load safetensors weights from")(
    lambda ctx: pair_args(ctx.pair, teacher=ctx.models["bin_only"]) + BASE + QUICK
)
case("model/damaged_safetensors", 2, "the safetensors weights in")(
    lambda ctx: pair_args(ctx.pair, teacher=ctx.models["damaged"]) + BASE + QUICK
)


# -- runtime: recoveries (exit 0) and the non-finite stop (exit 3) ---------------------------
def _patch_rollout(ctx, edit):
    """Edit every training rollout's batch, whichever in-process engine samples it."""
    for mod, name in ((rollout_mod, "generate"), (sampler_mod, "lean_generate")):

        def patched(*a, real=getattr(mod, name), **kw):
            b = real(*a, **kw)
            if kw.get("do_sample", True):  # training rollouts (eval is greedy)
                edit(b)
            return b

        ctx.monkeypatch.setattr(mod, name, patched)


def _finite_rows(run, err):
    for r in read_metrics(run)[1:]:
        for k, v in r.items():
            assert v is not None and v == v, (k, v)  # null would be a NaN/inf


@case("runtime/eos_as_first_token", 0, "")
def _eos_first(ctx):
    def edit(b):
        b.response_ids[:, 0] = 1  # <eos>: every response ends at once
        b.response_mask[:] = False
        b.response_mask[:, 0] = True

    _patch_rollout(ctx, edit)
    ctx.checks += [_finite_rows, lambda run, err: [r["response/length_mean"] for r in read_metrics(run)[1:]] == [1.0, 1.0]]
    return pair_args(ctx.pair) + BASE + QUICK


@case("runtime/every_response_empty", 0, "")
def _all_empty(ctx):
    def edit(b):  # only padding, never an EOS: decodes to "" everywhere
        b.response_ids[:] = 0
        b.response_mask[:] = True

    _patch_rollout(ctx, edit)
    ctx.checks.append(_finite_rows)
    return pair_args(ctx.pair) + BASE + QUICK


@case("runtime/no_response_tokens", 0, "has no response tokens: no update (counted in guard/empty_steps)")
def _no_tokens(ctx):
    _patch_rollout(ctx, lambda b: b.response_mask.zero_())
    ctx.checks += [_finite_rows, lambda run, err: read_metrics(run)[-1]["guard/empty_steps"] == 2]
    return pair_args(ctx.pair) + BASE + QUICK


@case("runtime/transient_nan_loss", 0, "step 2 skipped (no update): loss=nan")
def _nan_loss(ctx):
    from opd_exp.training.objective import Objective

    real, calls = Objective.__call__, []

    def poisoned(self, *a, **kw):
        out = real(self, *a, **kw)
        calls.append(1)
        if len(calls) == 2:
            out.loss = out.loss * float("nan")
        return out

    ctx.monkeypatch.setattr(Objective, "__call__", poisoned)
    ctx.checks.append(lambda run, err: [r["guard/skipped_steps"] for r in read_metrics(run)[1:]] == [0, 1, 1])
    return pair_args(ctx.pair) + BASE + ["trainer.max_steps=3"]


@case("runtime/nan_teacher_stops_the_run", 3, "2 non-finite steps in a row (steps 3-4; last: teacher log-probs are not finite at step 4")
def _nan_teacher(ctx):
    real = scoring_mod.teacher_logits
    calls = []

    def nan_from_step_3(model, batch, *a, **kw):
        z = real(model, batch, *a, **kw)
        if torch.is_grad_enabled():  # training (eval runs under no_grad)
            calls.append(1)
            if len(calls) >= 3:
                z = torch.full_like(z, float("nan"))
        return z

    ctx.monkeypatch.setattr(scoring_mod, "teacher_logits", nan_from_step_3)

    def intact(run, err):
        assert [s for s, _ in checkpoint.list_checkpoints(run)] == [2]  # the last good one, untouched
        assert "last checkpoint intact: " in err and "step_000002" in err

    ctx.checks.append(intact)
    return pair_args(ctx.pair) + BASE + ["trainer.max_steps=6", "checkpoint.every=2", "trainer.max_bad_steps=2"]


@case(
    "runtime/a_large_coefficient_is_named_in_the_stop",
    3,
    "every one of the run's 2 steps was non-finite and skipped (last: loss=inf, grad/norm=nan); nothing was trained, no "
    "checkpoint written (last checkpoint: none); the config's divergence.clip=1e+30 scales the loss past float range; "
    "allowed: values that keep the loss finite (at most 1e+06), then a teacher with finite log-probs",
)
def _large_coefficient(ctx):
    from opd_exp.training.objective import Objective

    real = Objective.__call__

    def overflowed(self, *a, **kw):  # what importance weights let through by a clip of 1e30 can do to the loss
        out = real(self, *a, **kw)
        if torch.is_grad_enabled():
            out.loss = out.loss * float("inf")
        return out

    ctx.monkeypatch.setattr(Objective, "__call__", overflowed)
    return pair_args(ctx.pair) + BASE + QUICK + ["divergence=fkl", "estimator=sampled", "loss=reinforce", "divergence.clip=1e30"]


# -- the run folder ---------------------------------------------------------------------------
@case("run_dir/failed_start_keeps_an_existing_run", 2, "model_pair.teacher: local folder '/no/such/teacher' does not exist")
def _failed_start(ctx):
    run = ctx.tmp / "run"
    code, _, err = run_in_process(pair_args(ctx.pair) + BASE + QUICK + ["checkpoint.every=1"], run, ctx.monkeypatch, ctx.capsys)
    assert code == 0, err

    def kept(p):
        return p.is_file() and ".hydra" not in p.parts and p.name != "train.log"

    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if kept(p)}
    log_before = (run / "train.log").read_text()

    def unchanged(run_, err_):
        after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if kept(p)}
        assert after == before  # metrics.jsonl, summary.json and every checkpoint byte-identical
        log = (run / "train.log").read_text()  # the run's console log gains the failed start's one line, nothing else
        assert log.startswith(log_before) and log[len(log_before) :].endswith(f" {one_error_line(err_)}\n")
        assert log[len(log_before) :].count("\n") == 1

    ctx.checks.append(unchanged)
    # checkpoint.extend: past the settings check (a new teacher path), so the start fails on the missing teacher
    return pair_args(ctx.pair, teacher="/no/such/teacher") + BASE + ["trainer.max_steps=4", "checkpoint.extend=true"]


@case("run_dir/under_a_file", 2, "cannot write the run folder or read an input")
def _under_a_file(ctx):
    (ctx.tmp / "afile").write_text("x")
    ctx.run_dir = ctx.tmp / "afile" / "run"
    return pair_args(ctx.pair) + BASE + QUICK


@case("run_dir/in_use_by_another_process", 2, "is in use by another opd-train process (pid 4242)")
def _in_use(ctx):
    import fcntl

    run = ctx.tmp / "run"
    run.mkdir()
    (run / checkpoint.OWNER).write_text("4242\n")  # the owner's record
    holder = open(run / checkpoint.LOCK, "w")  # noqa: SIM115 - held open until the check runs
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    ctx.checks.append(lambda run_, err: holder.close())
    return pair_args(ctx.pair) + BASE + QUICK


@case("run_dir/only_damaged_checkpoints", 2, "hydra.run.dir: no checkpoint in ")
def _damaged(ctx):
    run = ctx.tmp / "run"
    code, _, err = run_in_process(pair_args(ctx.pair) + BASE + QUICK, run, ctx.monkeypatch, ctx.capsys)
    assert code == 0, err
    weights = checkpoint.latest(run) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    metrics = (run / "metrics.jsonl").read_bytes()
    ctx.checks.append(lambda run_, err_: (run / "metrics.jsonl").read_bytes() == metrics or pytest.fail("metrics.jsonl changed"))
    return pair_args(ctx.pair) + BASE + ["trainer.max_steps=4"]


# -- fixtures and the test ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_models(local_pair_dir, tmp_path_factory) -> dict:
    from opd_exp.config.world import EmbeddedModelConfig
    from opd_exp.pairs.embedded.models import build_model, save_model
    from opd_exp.pairs.embedded.tokenizer import SPECIAL_TOKENS, build_tokenizer

    root = tmp_path_factory.mktemp("bad_models")
    small = EmbeddedModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    out = {"empty": root / "empty"}
    out["empty"].mkdir()
    other = build_tokenizer(SPECIAL_TOKENS + ["<sep>"])  # one more special token: every byte id shifts
    out["other_tokenizer"] = save_model(build_model(small, other, seed=3), other, root / "other_tokenizer")
    tok = build_tokenizer()
    m = build_model(small, tok, seed=4)
    m.resize_token_embeddings(64)
    out["small_vocab"] = save_model(m, tok, root / "small_vocab")
    teacher = local_pair_dir / "teacher"
    out["remote_code"] = Path(shutil.copytree(teacher, root / "remote_code"))
    c = json.loads((out["remote_code"] / "config.json").read_text())
    c["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (out["remote_code"] / "config.json").write_text(json.dumps(c))
    from safetensors.torch import load_file

    out["bin_only"] = Path(shutil.copytree(teacher, root / "bin_only"))
    torch.save(load_file(str(out["bin_only"] / "model.safetensors")), out["bin_only"] / "pytorch_model.bin")
    (out["bin_only"] / "model.safetensors").unlink()
    out["damaged"] = Path(shutil.copytree(teacher, root / "damaged"))
    data = (out["damaged"] / "model.safetensors").read_bytes()
    (out["damaged"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    return out


def test_the_matrix_has_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, local_pair_dir, bad_models, tmp_path, monkeypatch, capsys):
    fn, code, needle = CASES[name]
    ctx = Ctx(local_pair_dir, bad_models, tmp_path, monkeypatch)
    ctx.capsys = capsys
    ctx.run_dir = tmp_path / "run"
    args = fn(ctx)
    fresh = not ctx.run_dir.exists()
    got, out, err = run_in_process(args, ctx.run_dir, monkeypatch, capsys)
    assert got == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    if code:
        line = one_error_line(err)
        assert needle in line, line
        assert not out.strip()  # no summary line for a run that did not finish
        if fresh and code == 2 and ctx.run_dir.is_dir():  # a failed start leaves no half-run behind
            assert not (ctx.run_dir / "metrics.jsonl").exists() and not (ctx.run_dir / "checkpoints").exists()
        assert not list(ctx.run_dir.glob("checkpoints/.tmp-*"))
    else:
        assert needle in err, err[-3000:]
        assert "opd-train: error" not in err
        assert out.strip().splitlines()[-1].startswith("opd-train: student eval accuracy")
    for check in ctx.checks:
        assert check(ctx.run_dir, err) is not False, name
