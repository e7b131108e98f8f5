"""W&B tracking: tags, group, scrubbing and start-up failures (fast), and offline runs of
opd-train read back from the run folder with `wandb leet inspect` (slow): the same metric
values as metrics.jsonl, the config, resume into the same run id, a multirun whose failing job
is marked failed while the next job still runs, a preempted run's exit code 75, and no API key
anywhere in the run folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.reliability import make_local_pair
from opd_exp.sinks import tracking

FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 hex chars, like a W&B key


# -- fast --------------------------------------------------------------------------


def test_scrub_redacts_keys_and_env_secrets():
    cfg = {"logger": {"api_key": "sekrit-value", "project": "p"}, "note": f"key={FAKE_KEY} here", "tags": [FAKE_KEY], "hf_token": None}
    out = tracking.scrub(cfg, secrets=tracking.secret_values({"WANDB_API_KEY": FAKE_KEY, "HOME": "/root/home"}))
    assert out == {
        "logger": {"api_key": "<redacted>", "project": "p"},
        "note": "key=<redacted> here",
        "tags": ["<redacted>"],
        "hf_token": None,
    }
    assert tracking.scrub(["logger.api_key=abc", "divergence=jsd"], secrets=[]) == ["logger.api_key=<redacted>", "divergence=jsd"]


def test_tags_are_the_variant_overrides_and_the_divergence():
    overrides = [
        "sweep=divergence",
        "+variant=jsd_0.5",
        "seed=1",
        "eval.every=25",
        "trainer.max_steps=100",
        "hydra.launcher.n_jobs=2",
        "logger.mode=online",
        "model_pair.student=/a/" + "x" * 100,
    ]
    job = tracking.JobInfo(
        overrides=overrides, multirun=True, sweep_dir="multirun/divergence/embedded", swept=frozenset({"variant", "seed"})
    )
    variant = tracking.variant_overrides(overrides, job)
    assert variant == ["variant=jsd_0.5"]  # swept, and not the seed
    tags = tracking.run_tags(["mine"], variant, {"name": "jsd", "beta": 0.5, "alpha": 0.1})
    assert tags == ["mine", "variant=jsd_0.5", "divergence=jsd", "divergence.beta=0.5"]
    # a single run: what changes the training, not its bookkeeping
    single = ["divergence=jsd", "eval.every=25", "loss.kl_coef=2", "seed=1", "scale.device=cpu", "logger.mode=online"]
    assert tracking.variant_overrides(single, tracking.JobInfo(overrides=single)) == ["divergence=jsd", "loss.kl_coef=2"]
    # an override that is also derived appears once
    assert tracking.run_tags([], ["divergence=rkl"], {"name": "rkl", "beta": 0.5}) == ["divergence=rkl"]


def test_swept_keys_come_from_comma_lists_and_sweep_functions():
    got = tracking.swept_keys(["divergence=rkl,jsd", "seed=range(3)", "trainer.max_steps=100", "+x=[1,2]", "logger.tags=[a,b]"])
    assert got == {"divergence", "seed"}


def test_group_tells_sweeps_with_other_settings_apart():
    def job(*extra, swept=("variant", "seed")):
        overrides = ["sweep=divergence", "variant=rkl", "seed=0", *extra]
        return tracking.JobInfo(overrides=overrides, multirun=True, sweep_dir="multirun/divergence/embedded", swept=frozenset(swept))

    short, long_, other_job = job("trainer.max_steps=100"), job("trainer.max_steps=2500"), job("trainer.max_steps=100")
    other_job.overrides[1] = "variant=jsd_0.5"  # another variant of the same sweep: the same group
    g100, g2500 = tracking.run_group("divergence", short, "embedded"), tracking.run_group("divergence", long_, "embedded")
    assert g100.startswith("divergence/embedded/") and g2500.startswith("divergence/embedded/") and g100 != g2500
    assert tracking.run_group("divergence", other_job, "embedded") == g100
    assert len(g100.rsplit("/", 1)[1]) == 8
    # no logger.group: the multirun folder is the sweep
    adhoc = tracking.JobInfo(
        overrides=["divergence=rkl"], multirun=True, sweep_dir="multirun/2025-01-01/12-00-00", swept=frozenset({"divergence"})
    )
    assert tracking.run_group(None, adhoc, "embedded").startswith("multirun/2025-01-01/12-00-00/embedded/")
    # logger.group typed on the command line is taken as it is; a single run has only that
    explicit = job("logger.group=mine")
    assert tracking.run_group("mine", explicit, "embedded") == "mine"
    assert tracking.run_group("divergence", tracking.JobInfo()) == "divergence"
    assert tracking.run_group(None, tracking.JobInfo()) is None
    # names: unique across the two sweeps, stable for one
    n100 = tracking.run_name(None, Path("multirun/divergence/embedded/0_rkl_seed0"), short)
    n2500 = tracking.run_name(None, Path("multirun/divergence/embedded/0_rkl_seed0"), long_)
    assert n100.startswith("0_rkl_seed0-") and n100 != n2500 and n100.endswith(g100.rsplit("/", 1)[1])
    assert tracking.run_name(None, Path("multirun/2025-01-01/12-00-00/3"), adhoc).startswith("divergence=rkl-")  # what it sweeps
    assert tracking.run_name("given", Path("x"), short) == "given"


def test_logged_config_leaves_out_parameters_the_divergence_does_not_take():
    cfg = {"divergence": {"name": "rkl", "beta": 0.5, "alpha": 0.1, "temperature": 1.0, "clip": None}, "seed": 0}
    assert tracking.logged_config(cfg, "divergence=rkl") == {
        "divergence": {"name": "rkl", "temperature": 1.0},
        "seed": 0,
        "variant": "divergence=rkl",
    }
    jsd = tracking.logged_config({"divergence": {"name": "jsd", "beta": 0.9, "alpha": 0.1, "temperature": 1.0}}, "v")
    assert jsd["divergence"] == {"name": "jsd", "beta": 0.9, "temperature": 1.0}


def _init_args(tmp_path, **kw):
    args = dict(
        project="opd-exp-test",
        entity=None,
        group=None,
        job_type="train",
        tags=[],
        mode="online",
        on_error="fail",
        name=None,
        config={"seed": 0},
        run_id="abcdef123456",
    )
    args.update(kw)
    return args


def test_start_failure_stops_with_one_line_or_falls_back(tmp_path, monkeypatch):
    import wandb

    modes = []

    def fake_init(**kw):
        modes.append(kw["mode"])
        if kw["mode"] == "online":
            raise wandb.errors.CommError(f"invalid API key {FAKE_KEY}\nsecond line")
        return "offline-run"

    monkeypatch.setattr(wandb, "init", fake_init)
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    with pytest.raises(tracking.TrackingError) as ex:
        tracking.start_run(tmp_path, **_init_args(tmp_path))
    msg = str(ex.value)
    assert "\n" not in msg and FAKE_KEY not in msg and "logger.mode=online" in msg and "logger.on_error=offline" in msg
    warned = []
    run = tracking.start_run(tmp_path, **_init_args(tmp_path, on_error="offline"), warn=warned.append)
    assert run == "offline-run" and modes == ["online", "online", "offline"]
    assert len(warned) == 1 and "offline" in warned[0] and FAKE_KEY not in warned[0]


def test_schema_checks_on_error():
    from opd_exp.config.schema import LoggerConfig
    from opd_exp.runtime.errors import ConfigError

    assert LoggerConfig().mode == "offline" and LoggerConfig().on_error == "fail"
    with pytest.raises(ConfigError, match="logger.on_error='retry' is not allowed; allowed: fail, offline"):
        LoggerConfig(on_error="retry")


# -- slow: real offline runs --------------------------------------------------------


@pytest.fixture(scope="module")
def local_pair(tmp_path_factory) -> Path:
    return make_local_pair(tmp_path_factory.mktemp("wandb_pair"))


def tiny_args(pair: Path, steps: int = 2) -> list[str]:
    return [
        "model_pair=local",
        f"model_pair.student={pair / 'student'}",
        f"model_pair.teacher={pair / 'teacher'}",
        "task.n_train=64",
        "task.n_eval=4",
        f"trainer.max_steps={steps}",
        "trainer.batch_size=2",
        "eval.size=4",
        "eval.batch_size=4",
        "scale.device=cpu",
        "trainer.progress=false",
        "rollout.max_new_tokens=6",
        "logger.project=opd-exp-test",
    ]


def run_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return dict(env, WANDB_API_KEY=FAKE_KEY, WANDB_SILENT="true")


def inspect(run_dir: Path) -> list[dict]:
    """Each offline W&B run in the run folder, oldest first, as `wandb leet inspect --summary --json`."""
    wandb_cli = shutil.which("wandb") or "wandb"
    out = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        done = subprocess.run([wandb_cli, "leet", "inspect", "--summary", "--json", str(d)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        out.append(json.loads(done.stdout))
    return out


def history(run_dir: Path) -> list[dict]:
    wandb_cli = shutil.which("wandb") or "wandb"
    rows = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        done = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(d)], capture_output=True, text=True, timeout=60)
        rows += [json.loads(ln) for ln in done.stdout.splitlines() if '"type":"history"' in ln]
    return rows


def assert_no_key(folder: Path):
    for f in folder.rglob("*"):
        if f.is_file():
            assert FAKE_KEY.encode() not in f.read_bytes(), f"API key written to {f}"


def _saved_params(folder):
    """The parameter count of a saved model: every tensor of its safetensors file (tied weights are saved once)."""
    import math

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open is no mapping)


@pytest.mark.slow
def test_offline_run_holds_the_metrics_config_and_resumes(local_pair, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "opd_exp.cli.train",
        *tiny_args(local_pair),
        "divergence=jsd",
        "divergence.beta=0.9",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run,) = inspect(run_dir)
    assert run["state"] == "finished" and run["exit_code"] == 0
    assert run["config"]["divergence"] == {"name": "jsd", "beta": 0.9, "temperature": 1.0}  # no alpha, no clip
    assert run["config"]["variant"] == "divergence=jsd,divergence.beta=0.9"
    assert run["config"]["pair"] == {
        role: {"path": str(local_pair / role), "params": _saved_params(local_pair / role)} for role in ("teacher", "student")
    }
    assert set(run["tags"]) == {"divergence=jsd", "divergence.beta=0.9", "model_pair=local"}  # not trainer.*, task.*, model_pair.*
    summary, last_train = run["summary"], rows[-1]
    for key in ("jsd/mean", "kl/reverse", "kl/forward", "loss"):
        assert summary[key] == pytest.approx(last_train[key], rel=1e-6), key
    assert summary["eval/kl_reverse"]["last"] == pytest.approx(rows[-1]["eval/kl_reverse"])
    assert summary["eval/kl_reverse"]["min"] == pytest.approx(min(r["eval/kl_reverse"] for r in rows if "eval/kl_reverse" in r))
    assert summary["eval/accuracy"]["max"] == pytest.approx(max(r["eval/accuracy"] for r in rows if "eval/accuracy" in r))
    assert summary["final/eval/kl_reverse"] == pytest.approx(rows[-1]["eval/kl_reverse"])
    # every logged row, train and eval, on the training-step axis, with the jsonl's values
    logged = {}
    for rec in history(run_dir):
        items = rec["history"]["item"]
        logged[int(items["step"])] = items
    assert sorted(logged) == [r["step"] for r in rows]
    for r in rows:
        for key in ("jsd/mean", "kl/reverse", "eval/kl_reverse"):
            if key in r:
                assert logged[r["step"]][key] == pytest.approx(r[key], rel=1e-6)
    # resume: the same folder, more steps -> the same W&B run id
    run_id = (run_dir / "wandb_id.txt").read_text()
    cmd[cmd.index("trainer.max_steps=2")] = "trainer.max_steps=3"
    refused = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "(trainer.max_steps: 2 -> 3)" in refused.stderr  # other settings: only on purpose
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1  # refused before W&B started
    cmd.append("checkpoint.extend=true")
    again = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    runs = inspect(run_dir)
    assert len(runs) == 2 and {r["run_id"] for r in runs} == {run_id} and runs[1]["summary"]["step"] == 3
    assert_no_key(run_dir)
    assert FAKE_KEY not in done.stdout + done.stderr + again.stdout + again.stderr


CRASH = """
import opd_exp.training.trainer as trainer
_step = trainer.Trainer.train_step
def train_step(self):
    if self.cfg.estimator.name.value == "topk":
        raise RuntimeError("test crash in train_step")
    return _step(self)
trainer.Trainer.train_step = train_step
from opd_exp.cli.train import main
main()
"""


@pytest.mark.slow
def test_multirun_gives_one_run_per_job_and_marks_the_failed_one(local_pair, tmp_path):
    """sweep=estimator, 3 jobs; the topk job crashes at its first step (a test-only patch)."""
    script = tmp_path / "crash_train.py"
    script.write_text(CRASH)
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(script),
        "-m",
        "sweep=estimator",
        "estimator=sampled,topk,full",
        "seed=0",
        *tiny_args(local_pair),
        f"hydra.sweep.dir={sweep}",
    ]
    env = {k: v for k, v in run_env().items() if k != "WANDB_SILENT"}  # quiet by itself in a multirun
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode != 0 and "test crash in train_step" in done.stderr  # Hydra reports the failed job
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [j.name for j in jobs] == ["0_sampled_seed0", "1_topk_seed0", "2_full_seed0"]
    runs = [inspect(j) for j in jobs]
    assert all(len(r) == 1 for r in runs)
    runs = [r[0] for r in runs]
    assert len({r["run_id"] for r in runs}) == 3
    assert [r["state"] for r in runs] == ["finished", "failed", "finished"]
    assert [r["exit_code"] for r in runs] == [0, 1, 0]
    assert (jobs[2] / "summary.json").is_file()  # the job after the failure ran to the end
    for r, est in zip(runs, ("sampled", "topk", "full")):
        assert sorted(r["tags"]) == sorted(
            [f"estimator={est}", "divergence=jsd", "divergence.beta=0.5", "model_pair=local"]
        )  # swept + divergence; no seed
        assert r["config"]["estimator"]["name"] == est and r["config"]["variant"] == f"estimator={est}"
        assert "alpha" not in r["config"]["divergence"]
    assert "wandb: " not in done.stdout + done.stderr  # a multirun's jobs keep W&B's banners quiet
    for j in jobs:
        assert_no_key(j)
    group = [
        json.loads(ln)
        for ln in subprocess.run(
            [shutil.which("wandb") or "wandb", "leet", "inspect", "--json", str(next((jobs[0] / "wandb").glob("offline-run-*")))],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.splitlines()
        if '"type":"run"' in ln
    ]
    run_group = group[0]["run"]["run_group"]
    assert run_group.startswith("estimator/local/") and group[0]["run"]["job_type"] == "train"
    assert group[0]["run"]["display_name"] == f"0_sampled_seed0-{run_group.rsplit('/', 1)[1]}"


PREEMPT = """
import os, signal
import opd_exp.training.trainer as trainer
_step = trainer.Trainer.train_step
def train_step(self):
    out = _step(self)
    if self.step == 2:
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption: acted on at the step boundary
    return out
trainer.Trainer.train_step = train_step
from opd_exp.cli.train import main
main()
"""


@pytest.mark.slow
def test_a_preempted_run_ends_its_wandb_run_with_exit_code_75(local_pair, tmp_path):
    """The process exits 75 (saved, to be resumed) and its offline W&B run records 75, not a
    finished run's 0; the resumed session's run (same id) then finishes with 0."""
    script = tmp_path / "preempt_train.py"
    script.write_text(PREEMPT)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(script), *tiny_args(local_pair, steps=4), f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 75, done.stderr[-3000:]
    assert "opd-train: preempted: SIGTERM received: checkpoint at step 2" in done.stderr
    (run,) = inspect(run_dir)
    assert run["exit_code"] == 75 and run["summary"]["step"] == 2
    cmd[1] = "-m"
    cmd.insert(2, "opd_exp.cli.train")  # the same command again, without the signal: resumes to the end
    again = subprocess.run(cmd, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    runs = inspect(run_dir)
    assert [r["exit_code"] for r in runs] == [75, 0] and len({r["run_id"] for r in runs}) == 1


@pytest.mark.slow
def test_online_start_failure_for_real(tmp_path, monkeypatch):
    """No server (a closed local port): fail in one line, or log offline as configured."""
    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    wandb.teardown()  # W&B reads WANDB_INIT_TIMEOUT at setup: an earlier test's setup would keep 90 s
    with pytest.raises(tracking.TrackingError) as ex:
        tracking.start_run(tmp_path / "a", **_init_args(tmp_path, run_id="failrun00001"))
    assert "\n" not in str(ex.value) and FAKE_KEY not in str(ex.value)
    warned = []
    run = tracking.start_run(tmp_path / "b", **_init_args(tmp_path, on_error="offline", run_id="fallback0001"), warn=warned.append)
    run.log({"step": 1, "jsd/mean": 0.5})
    run.finish()
    assert len(warned) == 1
    (r,) = inspect(tmp_path / "b")
    assert r["run_id"] == "fallback0001" and r["summary"]["jsd/mean"] == 0.5


def test_the_trained_divergence_is_summarised_like_the_fixed_eval_metrics(tmp_path, monkeypatch):
    class FakeRun:
        id = "fake00000001"

        def __init__(self):
            self.defined, self.summary = {}, {}

        def define_metric(self, key, step_metric=None, summary=None):
            self.defined[key] = summary

    made = {}
    monkeypatch.setattr(
        tracking, "start_run", lambda run_dir, **kw: made.setdefault("run", FakeRun()) if made.update(kw=kw) is None else None
    )
    sink = tracking.WandbSink(tmp_path, config={"divergence": {"name": "tvd", "beta": 0.5, "alpha": 0.1, "temperature": 1.0}}, overrides=[])
    run = made["run"]
    assert run.defined["eval/tvd"] == "min,last" and run.defined["eval/kl_reverse"] == "min,last"
    assert made["kw"]["config"]["divergence"] == {"name": "tvd", "temperature": 1.0} and made["kw"]["config"]["variant"] == "default"
    sink.summary({"eval/tvd": 0.25, "steps": 3})
    assert run.summary == {"final/eval/tvd": 0.25, "steps": 3}
