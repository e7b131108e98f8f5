"""What W&B gets for a run: only the chosen options' keys (no other pair's recipe, no other
task's knobs), a model_pair tag, and no W&B run at all for a start that fails its device check."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.compose import compose_config as _compose
from helpers.reliability import run_cli
from opd_exp.runtime.fingerprint import flatten
from opd_exp.runtime.secrets import plain_config
from opd_exp.sinks import tracking


def _logged(*overrides: str) -> dict:
    return flatten(tracking.logged_config(plain_config(_compose(*overrides)), "default"))


def test_the_logged_config_holds_only_the_chosen_options_keys():
    smol = _logged("model_pair=smollm2", "task=chat_arithmetic")
    assert not [k for k in smol if k.startswith("model_pair.embedded.")]
    assert smol["model_pair.smollm2.keep_every"] == 3
    assert sorted(k for k in smol if k.startswith("task.")) == [
        "task.eval_seed",
        "task.max_digits",
        "task.max_operands",
        "task.min_operands",
        "task.n_eval",
        "task.n_train",
        "task.name",
        "task.ops",
        "task.seed",
    ]
    assert [k for k in smol if k.startswith("teacher.")] == ["teacher.name"]  # in process: no server knobs
    assert not [k for k in smol if k.startswith("trainer.lora_")]
    assert not [k for k in smol if k.startswith("loss.") and ("ppo" in k or "clip_eps" in k)]  # loss=direct
    embedded = _logged()
    assert "model_pair.smollm2.keep_every" not in embedded and embedded["model_pair.embedded.teacher.sft_steps"] == 4000
    qwen = _logged("experiment=opd_gsm8k_jsd")
    assert not [k for k in qwen if k.startswith(("model_pair.embedded.", "model_pair.smollm2."))]
    assert {k for k in qwen if k.startswith("task.")} >= {"task.path", "task.instruction"}
    assert "task.min_operands" not in qwen and "task.min_answers" not in qwen
    assert qwen["loss.clip_eps"] == 0.2  # ppo's
    # what is switched on is logged
    lora = _logged("scale.lora_rank=8", "teacher=served", "teacher.url=http://h:1")
    assert lora["scale.lora_rank"] == 8 and lora["teacher.url"] == "http://h:1"


def test_tags_name_the_model_pair():
    tags = tracking.run_tags([], ["divergence=rkl"], {"name": "rkl"}, "smollm2")
    assert tags == ["divergence=rkl", "model_pair=smollm2"]


def test_a_start_that_fails_its_device_check_opens_no_w_and_b_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    code, _out, err = run_cli(["logger=wandb", "scale.device=cuda:99", f"hydra.run.dir={run}"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines()[0].startswith("opd-train: error: scale.device='cuda:99': ")
    assert not (run / "wandb").exists() and not (run / "wandb_id.txt").exists()


def test_an_offline_run_records_the_chosen_keys_and_the_pair_tag(tmp_path, monkeypatch):
    """The W&B files themselves, read back with `wandb leet inspect --json`."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(tracking, "hydra_job", tracking.JobInfo)  # outside a Hydra job (an earlier test's may linger)
    cfg = _compose("model_pair=smollm2", "task=chat_arithmetic", "logger=wandb")
    sink = tracking.WandbSink.from_config(cfg, tmp_path)
    sink.close()
    (run_dir,) = sorted((tmp_path / "wandb").glob("offline-run-*"))
    done = subprocess.run(
        [shutil.which("wandb") or str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--summary", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert "model_pair=smollm2-135m-instruct_pruned" in got["tags"]  # outside Hydra: the pair's name
    assert "embedded" not in got["config"]["model_pair"] and got["config"]["model_pair"]["smollm2"] == {"keep_every": 3}
    assert "min_answers" not in got["config"]["task"] and "url" not in got["config"]["teacher"]
    assert Path(tmp_path / "wandb_id.txt").read_text() == got["run_id"]
