"""What an adversarial pass broke, each case pinned: typos that ran the wrong experiment, weights
that loaded as random values, damaged checkpoints resumed silently, multiruns ended by one bad
job, a busy folder touched before its lock, secrets in sweep records and W&B files, and the
inputs that ended in a traceback where one line was promised (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.reliability import BASE, comparable, one_error_line, pair_args, popen, read_metrics, run_cli, run_in_process
from helpers.tiny import AddTask, small_config
from opd_exp.runtime import checkpoint, files
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.trainer import Trainer

MINI = Path(__file__).resolve().parents[1] / "opd_exp" / "data" / "gsm8k_mini.jsonl"
ROOT = Path(__file__).resolve().parents[1]


def options(folder: Path) -> str:
    """The options a config folder offers, as the error lists them."""
    return ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))


QUICK = ["trainer.max_steps=2"]
FAKE_WANDB_KEY = "fedcba9876543210fedcba9876543210fedcba98"
FAKE_HF_TOKEN = "hf_AdVeRsArIaLtOkEn1234567890xyz"
FAKE_SK = "sk-proj-AdversarialKey1234567890abcd"


def no_model_loads(monkeypatch):
    """Fail the test if a model is loaded (errors must come before)."""
    import opd_exp.pairs as pairs

    def refuse(*a, **kw):
        raise AssertionError("a model was loaded before the error was found")

    monkeypatch.setattr(pairs, "load_pair", refuse)


def quick(pair, *extra, **kw) -> list[str]:
    return pair_args(pair, **kw) + BASE + QUICK + list(extra)


# -- typos in optional groups --------------------------------------------------------------------
@pytest.fixture
def user_conf(tmp_path) -> Path:
    """A user's config folder on hydra.searchpath: one good experiment, one with a YAML syntax
    error, one without `# @package _global_`."""
    root = tmp_path / "user_conf"
    (root / "experiment").mkdir(parents=True)
    (root / "experiment" / "mine.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 1\n")
    (root / "experiment" / "broken.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: [1\n")
    (root / "experiment" / "nopackage.yaml").write_text("trainer:\n  max_steps: 1\n")
    return root


ALLOWED_EXPERIMENTS = ", ".join(sorted({"broken", "mine", "nopackage", *(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))}))


@pytest.mark.parametrize(
    "override, needle",
    [
        ("experiment=opd_gsm8k_jds", f"experiment=opd_gsm8k_jds: no such option; allowed: {ALLOWED_EXPERIMENTS}"),
        ("experiment=mnie", f"experiment=mnie: no such option; allowed: {ALLOWED_EXPERIMENTS}"),
    ],
)
def test_a_misspelt_optional_group_option_fails_listing_the_valid_ones(
    override, needle, local_pair_dir, user_conf, tmp_path, monkeypatch, capsys
):
    no_model_loads(monkeypatch)
    args = quick(local_pair_dir, f"hydra.searchpath=[file://{user_conf}]", override)
    code, _, err = run_in_process(args, tmp_path / "run", monkeypatch, capsys)
    assert code == 2 and needle in one_error_line(err), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_misspelt_sweep_fails_instead_of_running_one_default_job(local_pair_dir, tmp_path, monkeypatch, capsys):
    no_model_loads(monkeypatch)
    args = quick(local_pair_dir, "sweep=divergenc", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    code, _, err = run_cli(["-m", *args], monkeypatch, capsys)
    assert code == 2, err
    assert f"opd-train: error: sweep=divergenc: no such option; allowed: {options(ROOT / 'sweeps' / 'sweep')}" in err
    assert "1 of 1 jobs of the multirun failed" in err
    assert "Error executing job" not in err and "Traceback" not in err


# -- config files and command lines that ended in a traceback or a cryptic line --------------------
@pytest.mark.parametrize(
    "extra, needle",
    [
        (["experiment=broken"], "/user_conf/experiment/broken.yaml:4 is not valid YAML (expected ',' or ']', but got '<stream end>')"),
        (
            ["experiment=nopackage"],
            "experiment=nopackage: the file experiment/nopackage.yaml sets its keys under 'experiment.' (its first line is not "
            "`# @package _global_`); allowed: a first line `# @package _global_`",
        ),
        (
            ["~model_pair"],
            "model_pair: has no value (removed with `~model_pair`?); allowed: model_pair=<option> with one of: "
            + options(ROOT / "conf" / "model_pair"),
        ),
        (["name=café"], "the override holds the non-ASCII character 'é', which Hydra reads only inside quotes; allowed: a quoted value"),
        (["trainer.grad_clip=inf"], "trainer.grad_clip=inf is not allowed; allowed: a finite number >= 0, the largest gradient norm kept"),
        (["seed=20000000000000000000"], "seed=20000000000000000000 is not allowed; allowed: an integer with -2**63 <= seed < 2**63"),
    ],
)
def test_config_mistakes_are_one_line_naming_what_is_allowed(extra, needle, local_pair_dir, user_conf, tmp_path, monkeypatch, capsys):
    no_model_loads(monkeypatch)
    if extra == ["~model_pair"]:
        args = BASE + QUICK + extra  # the pair's keys would refer to the removed group
    else:
        args = quick(local_pair_dir, f"hydra.searchpath=[file://{user_conf}]", *extra)
    code, _, err = run_in_process(args, tmp_path / "run", monkeypatch, capsys)
    assert code == 2, err
    assert needle in one_error_line(err), err
    assert "Error executing job" not in err


def test_multirun_with_cfg_job_is_one_line(local_pair_dir, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(["-m", "--cfg", "job", *quick(local_pair_dir)], monkeypatch, capsys)
    assert code == 2 and "-m and --cfg: Hydra prints the config of one job, not of a multirun; allowed: --cfg without -m" in one_error_line(
        err
    )


def test_a_large_seed_derives_step_seeds_without_overflow(local_pair_dir, tmp_path, monkeypatch, capsys):
    args = quick(local_pair_dir, f"seed={2**63 - 1}", "eval.every=1")
    code, _, err = run_in_process(args, tmp_path / "run", monkeypatch, capsys)
    assert code == 0, err
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]


# -- multiruns: one bad job fails alone ----------------------------------------------------------
def test_one_bad_job_fails_alone_and_the_sweep_exits_non_zero_with_a_summary(local_pair_dir, tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    args = quick(local_pair_dir, "divergence=jsd", "divergence.beta=0.2,1.5,0.8", f"hydra.sweep.dir={sweep}")
    code, out, err = run_cli(["-m", *args], monkeypatch, capsys)
    assert code == 2, err
    assert (sweep / "0" / "metrics.jsonl").is_file() and (sweep / "2" / "metrics.jsonl").is_file()  # job 3 ran
    assert not (sweep / "1" / "metrics.jsonl").exists()
    summary = [ln for ln in err.splitlines() if "jobs of the multirun failed" in ln]
    assert summary == [
        f"opd-train: error: 1 of 3 jobs of the multirun failed: #1 ({sweep / '1'}): divergence.beta=1.5 is not allowed; "
        f"allowed: 0 <= beta <= 1 -- fix those and run the same multirun again (finished jobs are skipped)"
    ]
    assert "Error executing job" not in err and "Traceback" not in err
    assert out.count("opd-train: student eval accuracy") == 2


# -- the run folder's lock comes first -----------------------------------------------------------
def test_a_busy_folder_is_refused_before_wandb_models_or_its_hydra_record_are_touched(local_pair_dir, tmp_path, monkeypatch, capsys):
    import fcntl

    import opd_exp.sinks.tracking as tracking

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("the running job's record\n")
    (run / checkpoint.OWNER).write_text("4242\n")
    no_model_loads(monkeypatch)
    monkeypatch.setattr(tracking.WandbSink, "from_config", classmethod(lambda *a, **kw: pytest.fail("wandb.init before the lock")))
    args = [a for a in quick(local_pair_dir) if a != "logger=none"] + ["logger=wandb", "logger.mode=offline"]
    with open(run / checkpoint.LOCK, "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, _, err = run_in_process(args, run, monkeypatch, capsys)
    assert code == 2 and "is in use by another opd-train process (pid 4242)" in one_error_line(err)
    assert (run / ".hydra" / "config.yaml").read_text() == "the running job's record\n"
    assert sorted(p.name for p in (run / ".hydra").iterdir()) == ["config.yaml"]
    assert not (run / "wandb").exists()


def test_the_wandb_sink_is_closed_when_the_trainer_raises(local_pair_dir, tmp_path, monkeypatch, capsys):
    import opd_exp.sinks.tracking as tracking

    closed = []
    fake = SimpleNamespace(is_wandb=True, log=lambda *a: None, summary=lambda *a: None, close=lambda: closed.append(sys.exc_info()[0]))
    monkeypatch.setattr(tracking.WandbSink, "from_config", classmethod(lambda cls, cfg, run_dir, **kw: fake))

    def boom(self, *a, **kw):
        raise ConfigError("hydra.run.dir: boom; allowed: nothing")

    monkeypatch.setattr(Trainer, "run", boom)
    args = [a for a in quick(local_pair_dir) if a != "logger=none"] + ["logger=wandb", "logger.mode=offline"]
    code, _, err = run_in_process(args, tmp_path / "run", monkeypatch, capsys)
    assert code == 2 and "hydra.run.dir: boom" in one_error_line(err)
    assert closed and closed[0] is ConfigError  # closed while the error propagated: the W&B run is marked failed


# -- secrets -------------------------------------------------------------------------------------
def _files_containing(root: Path, needles: list[str]) -> list[str]:
    hits = []
    for f in root.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            hits += [f"{f.relative_to(root)}: {n[:6]}..." for n in needles if n.encode() in data]
    return hits


def test_the_sweep_record_and_labels_hold_no_credentials(local_pair_dir, tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    args = quick(
        local_pair_dir,
        f"+hydra.job.env_set.HF_TOKEN={FAKE_HF_TOKEN}",
        "+logger.api_key=pasted-key-4242",
        f"name=run-{FAKE_WANDB_KEY}",
        f"logger.tags=[{FAKE_SK}]",
        "seed=0,1",
        f"hydra.sweep.dir={sweep}",
    )
    code, _, err = run_cli(["-m", *args], monkeypatch, capsys)
    assert code == 2 and "2 of 2 jobs of the multirun failed" in err  # logger.api_key: unknown key
    assert (sweep / "multirun.yaml").is_file() and (sweep / "0" / ".hydra" / "overrides.yaml").is_file()
    assert _files_containing(sweep, [FAKE_HF_TOKEN, "pasted-key-4242", FAKE_WANDB_KEY, FAKE_SK]) == []
    assert FAKE_HF_TOKEN not in err and "pasted-key-4242" not in err


def test_labels_are_redacted_by_shape():
    from opd_exp.runtime.secrets import redact_label, scrub

    assert redact_label(f"run-{FAKE_WANDB_KEY}") == "run-<redacted>"
    assert scrub({"name": f"a-{FAKE_HF_TOKEN}", "tags": [FAKE_SK, "divergence=jsd"]}) == {
        "name": "a-<redacted>",
        "tags": ["<redacted>", "divergence=jsd"],
    }
    assert scrub("revision-" + FAKE_WANDB_KEY) == "revision-" + FAKE_WANDB_KEY  # a commit id elsewhere is kept


@pytest.mark.slow
def test_wandb_records_no_credentials_from_the_command_line(local_pair_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    args = [a for a in quick(local_pair_dir) if a != "logger=none"] + [
        "logger=wandb",
        "logger.mode=offline",
        "trainer.max_steps=1",
        f"+hydra.job.env_set.HF_TOKEN={FAKE_HF_TOKEN}",
        f"name=run-{FAKE_WANDB_KEY}",
        f"logger.tags=[{FAKE_SK}]",
    ]
    code, _, err = run_in_process(args, run, monkeypatch, capsys)
    assert code == 0, err
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert _files_containing(run, [FAKE_HF_TOKEN, FAKE_WANDB_KEY, FAKE_SK]) == []


# -- model pairs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def broken_models(local_pair_dir, tmp_path_factory) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    from opd_exp.config.world import EmbeddedModelConfig
    from opd_exp.pairs.embedded.models import build_model, save_model
    from opd_exp.pairs.embedded.tokenizer import SPECIAL_TOKENS, build_tokenizer

    root = tmp_path_factory.mktemp("broken_models")
    teacher = local_pair_dir / "teacher"
    out = {}

    def copy(name, edit_weights=None, edit_config=None):
        d = Path(shutil.copytree(teacher, root / name))
        if edit_weights:
            sd = edit_weights(load_file(str(d / "model.safetensors")))
            save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        if edit_config:
            c = json.loads((d / "config.json").read_text())
            edit_config(c)
            (d / "config.json").write_text(json.dumps(c))
        out[name] = d

    copy("missing", lambda sd: {k: v for k, v in sd.items() if k != "model.norm.weight"})
    copy("renamed", lambda sd: {k.replace("model.", "transformer.", 1): v for k, v in sd.items()})
    copy("shape", lambda sd: {**sd, "model.norm.weight": torch.zeros(sd["model.norm.weight"].shape[0] + 1)})
    copy("no_model_type", edit_config=lambda c: c.pop("model_type"))
    copy("wrong_type", edit_config=lambda c: c.__setitem__("num_hidden_layers", "two"))
    small = EmbeddedModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    other = build_tokenizer(SPECIAL_TOKENS + ["<sep>"])
    out["other_tokenizer"] = save_model(build_model(small, other, seed=3), other, root / "other_tokenizer")
    return out


@pytest.mark.parametrize(
    "case, role, needle",
    [
        ("missing", "teacher", "has 1 missing weight(s) (model.norm.weight); the model would start the missing ones from random values"),
        (
            "renamed",
            "teacher",
            "27 missing weight(s) (lm_head.weight, model.embed_tokens.weight, model.layers.0.input_layernorm.weight, ...) and 26 unexpected weight(s) (transformer.embed_tokens.weight,",
        ),
        ("shape", "teacher", "1 weight(s) in '"),
        (
            "no_model_type",
            "teacher",
            "has no 'model_type' (the architecture, e.g. 'qwen2'); allowed: a config.json written by save_pretrained",
        ),
        ("wrong_type", "teacher", "is refused by transformers (Validation error for field 'num_hidden_layers'"),
    ],
)
def test_a_broken_model_is_one_line_naming_the_model(case, role, needle, local_pair_dir, broken_models, tmp_path, monkeypatch, capsys):
    code, _, err = run_in_process(quick(local_pair_dir, **{role: broken_models[case]}), tmp_path / "run", monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and line.startswith(f"opd-train: error: model_pair.{role}: ") and needle in line, line
    if case == "shape":
        assert "first: model.norm.weight is (33,), the model needs (32,)" in line
    assert "trust_remote_code" not in line and "tokenizer" not in line


def test_the_students_own_tokenizer_is_compared_when_model_pair_tokenizer_is_set(
    local_pair_dir, broken_models, tmp_path, monkeypatch, capsys
):
    args = quick(local_pair_dir, f"model_pair.tokenizer={local_pair_dir / 'teacher'}", student=broken_models["other_tokenizer"])
    code, _, err = run_in_process(args, tmp_path / "run", monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and line.startswith("opd-train: error: model_pair.student: the tokenizer of "), line
    assert "maps text to different ids than model_pair.tokenizer's" in line


# -- data: one line, before any model loads -----------------------------------------------------
def _parquet(path: Path) -> None:
    path.write_bytes(b"PAR1" + os.urandom(64) + b"PAR1")


DATA_CASES = {
    "empty": (lambda p: p.write_text(""), "data.jsonl", "holds no problems (empty file)"),
    "non_utf8": (lambda p: p.write_bytes(b'{"question": "caf\xff?", "answer": "#### 1"}\n'), "data.jsonl", "is not UTF-8 text"),
    "not_json": (lambda p: p.write_text('{"question": \n'), "data.jsonl", "data.jsonl line 1 is not valid JSON"),
    "not_a_number": (lambda p: p.write_text('{"question": "q?", "answer": "#### abc"}\n'), "data.jsonl", "not a number ('abc')"),
    "list_row": (lambda p: p.write_text("[1, 2]\n"), "data.jsonl", "line 1 is a JSON list, not an object"),
    "damaged_parquet": (_parquet, "data.parquet", "is not a readable parquet file ("),
    "json_object": (
        lambda p: p.write_text('{"question": "q?", "answer": "#### 1"}'),
        "data.json",
        "holds a JSON dict, not a list of rows; allowed: a JSON list of objects",
    ),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_data_errors_are_found_before_any_model_loads(case, local_pair_dir, tmp_path, monkeypatch, capsys):
    write, name, needle = DATA_CASES[case]
    path = tmp_path / name
    write(path)
    no_model_loads(monkeypatch)
    args = quick(local_pair_dir, "task=gsm8k", f"task.path={path}", "task.n_eval=1")
    code, _, err = run_in_process(args, tmp_path / "run", monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and line.startswith("opd-train: error: task.path: ") and needle in line, line


def test_a_utf8_bom_is_not_part_of_the_data(tmp_path):
    from opd_exp.config.world import TaskConfig
    from opd_exp.tasks.gsm8k import GSM8KTask

    plain, bom = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain.write_bytes(MINI.read_bytes())
    bom.write_bytes(b"\xef\xbb\xbf" + MINI.read_bytes())
    tasks = [GSM8KTask(TaskConfig(name="gsm8k", path=str(p), n_eval=4)) for p in (plain, bom)]
    assert tasks[1].train_problems() == tasks[0].train_problems() and tasks[1].eval_problems() == tasks[0].eval_problems()


def test_cuda_without_a_gpu_is_refused_before_loading(local_pair_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    no_model_loads(monkeypatch)
    args = [a for a in quick(local_pair_dir) if a != "scale.device=cpu"] + ["scale.device=cuda"]
    code, _, err = run_in_process(args, tmp_path / "run", monkeypatch, capsys)
    assert code == 2
    assert "scale.device='cuda': no CUDA GPU is visible to torch" in one_error_line(err)


# -- memory pre-flight ------------------------------------------------------------------------------
def test_the_step_memory_estimate_counts_kv_cache_and_logits(tiny_pair):
    from opd_exp.training.memory import estimate

    cfg = small_config(trainer={"batch_size": 8, "micro_batch_size": 4}, rollout={"n_samples": 2, "max_new_tokens": 10})
    got = estimate(cfg, tiny_pair.student, tiny_pair.vocab_size)
    c = tiny_pair.student.config
    head_dim = c.hidden_size // c.num_attention_heads
    seq = cfg.rollout.max_prompt_tokens + 10
    assert got.rows == 16 and got.micro_rows == 4
    assert got.kv_cache == 2 * c.num_hidden_layers * 16 * seq * c.num_key_value_heads * head_dim * 4
    assert got.logits == 2 * 4 * 10 * tiny_pair.vocab_size * 4


def test_a_batch_far_beyond_memory_is_one_line_before_the_first_step(local_pair_dir, tmp_path, monkeypatch, capsys):
    import opd_exp.training.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**20)  # 1 MiB free
    args = quick(local_pair_dir, "trainer.batch_size=64", "rollout.n_samples=64")
    code, _, err = run_in_process(args, tmp_path / "run", monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and "trainer.batch_size x rollout.n_samples: 64 x 64 = 4096 sequences need at least" in line, line
    assert "but 0.0 GiB are free; allowed: a smaller trainer.batch_size or rollout.n_samples" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- checkpoints -----------------------------------------------------------------------------------
def _fresh_pair(tiny_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    return SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(tiny_dir / "student"),
        teacher=AutoModelForCausalLM.from_pretrained(tiny_dir / "teacher"),
        tokenizer=tok,
        vocab_size=len(tok),
    )


def test_flipped_bytes_in_the_newest_weights_fall_back_to_the_older_checkpoint(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    cfg = small_config(trainer={"max_steps": 4, "save_every": 1, "keep_checkpoints": 2})
    ref, run = tmp_path / "reference", tmp_path / "run"
    Trainer(cfg, ref, pair=_fresh_pair(tiny_dir), task=AddTask()).run()
    Trainer(cfg, run, pair=_fresh_pair(tiny_dir), task=AddTask()).run(stop_after=3)
    assert [s for s, _ in checkpoint.list_checkpoints(run)] == [2, 3]
    weights = checkpoint.latest(run) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    start = len(data) // 2
    data[start : start + 4096] = bytes(b ^ 0xFF for b in data[start : start + 4096])  # 4 KB flipped, same size
    weights.write_bytes(bytes(data))
    assert checkpoint.latest(run) == weights.parent  # sizes match: only the hash tells
    t = Trainer(cfg, run, pair=_fresh_pair(tiny_dir), task=AddTask())
    lines = []
    t.warn = lines.append
    t.run()
    assert lines[0] == (
        f"opd-train: warning: checkpoint {weights.parent} cannot be loaded (file model.safetensors does not match its checksum); "
        f"set aside as step_000003.bad, trying an older one"
    )
    want, got = load_file(str(checkpoint.latest(ref) / "model.safetensors")), load_file(str(checkpoint.latest(run) / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)  # as if never interrupted
    assert comparable(read_metrics(run)) == comparable(read_metrics(ref))


def test_a_full_disk_is_one_line_and_freeing_space_is_enough_to_resume(local_pair_dir, tmp_path, monkeypatch, capsys):
    real_save = checkpoint.torch.save

    def full_disk(obj, f, *a, **kw):
        if "step_000002" in str(f):
            raise RuntimeError(
                "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: file write failed"
            )
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    run = tmp_path / "run"
    args = pair_args(local_pair_dir) + BASE + ["trainer.max_steps=3", "checkpoint.every=1"]
    code, _, err = run_in_process(args, run, monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and "hydra.run.dir: cannot write checkpoint step_000002 in " in line, line
    assert "newest checkpoint: step_000001; allowed: free disk space" in line
    assert not list((run / "checkpoints").glob(".tmp-*"))
    stale = run / "checkpoints" / ".tmp-step_000002-dead"  # what a failed clean-up would leave
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    monkeypatch.setattr(checkpoint.torch, "save", real_save)  # space freed
    code, _, err = run_in_process(args, run, monkeypatch, capsys)
    assert code == 0, err
    assert not stale.exists() and [s for s, _ in checkpoint.list_checkpoints(run)][-1] == 3


class _Payload:
    def __reduce__(self):
        return (print, ("payload ran",))


def test_the_bad_checkpoint_warning_does_not_repeat_torchs_weights_only_advice(tiny_dir, tmp_path, capsys):
    cfg = small_config(trainer={"max_steps": 2, "save_every": 1, "keep_checkpoints": 2})
    Trainer(cfg, tmp_path, pair=_fresh_pair(tiny_dir), task=AddTask()).run()
    newest = checkpoint.latest(tmp_path)
    with open(newest / "optimizer.pt", "wb") as f:
        pickle.dump({"optimizer": _Payload()}, f)
    files.write_manifest(newest, checkpoint.MANIFEST, {"step": 2})  # hashes match: only loading finds out
    t = Trainer(cfg, tmp_path, pair=_fresh_pair(tiny_dir), task=AddTask())
    lines = []
    t.warn = lines.append
    assert t.resume() and t.step == 1
    assert lines[0].startswith(f"opd-train: warning: checkpoint {newest} cannot be loaded (optimizer.pt holds objects other than tensors")
    assert "weights_only" not in lines[0] and "payload ran" not in capsys.readouterr().out


# -- metrics.jsonl ---------------------------------------------------------------------------------
def test_metrics_jsonl_deleted_mid_run_is_put_back(tiny_dir, tmp_path, monkeypatch):
    cfg = small_config(trainer={"max_steps": 3})
    t = Trainer(cfg, tmp_path, pair=_fresh_pair(tiny_dir), task=AddTask())
    lines = []
    t.warn = lines.append
    real_step = Trainer.train_step

    def step_then_delete(self):
        out = real_step(self)
        if self.step == 2:
            (tmp_path / "metrics.jsonl").unlink()
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_delete)
    t.run()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    assert [ln for ln in lines if "metrics.jsonl was deleted during the run; rewritten from this run's 2 rows" in ln]


def test_a_resume_without_metrics_jsonl_is_refused(tiny_dir, tmp_path):
    cfg = small_config(trainer={"max_steps": 2, "save_every": 1})
    Trainer(cfg, tmp_path, pair=_fresh_pair(tiny_dir), task=AddTask()).run()
    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(ConfigError, match=r"metrics.jsonl is missing but the run resumes from its checkpoint at step 2"):
        Trainer(cfg, tmp_path, pair=_fresh_pair(tiny_dir), task=AddTask()).run()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_read_metrics_counts_a_non_utf8_line_and_goes_on(tmp_path):
    from opd_exp.analysis.runs import read_metrics as read_series

    f = tmp_path / "metrics.jsonl"
    f.write_bytes(b'{"step": 0, "loss": 1.0}\n{"step": 1, "loss": "caf\xff"}\n{"step": 2, "loss": 0.5}\n')
    series, bad = read_series(f)
    assert series["loss"] == [(0, 1.0), (2, 0.5)] and bad == 1


# -- Ctrl-C ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_saves_at_the_step_boundary_and_exits_75(local_pair_dir, tmp_path):
    run = tmp_path / "run"
    args = pair_args(local_pair_dir) + BASE + ["trainer.max_steps=40", "checkpoint.every=0"]
    proc = popen(args, run)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        m = run / "metrics.jsonl"
        if m.is_file() and len(m.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "opd-train: preempted: SIGINT received: checkpoint at step" in err
    assert not list(run.glob("checkpoints/.tmp-*"))
    step = checkpoint.list_checkpoints(run)[-1][0]
    assert [r["step"] for r in read_metrics(run)][-1] == step
