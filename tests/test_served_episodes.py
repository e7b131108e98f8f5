"""A served teacher scores episodes: every position of an episode after the prompt (the student's
turns and the environment's answers) is scored through the server, and a run's per-step losses and
metrics equal the in-process teacher's on the same episodes, with the environment's tokens masked
(the student trains on its own tokens only) and trained (``rollout.env_tokens=trained``: the served
scores at the environment's positions enter the loss). Against the stand-in server (every run of
the suite) and, marked ``vllm``, a real ``opd-serve-teacher`` process (vLLM's CPU build) on a tiny
episode world whose teacher vLLM can load (head_dim 64)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import socket
import string
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_episode_engines import Echo, EchoTask

from helpers.tiny import build_model, small_config
from opd_exp.config.world import TaskConfig
from opd_exp.tasks import register_environment, register_task
from opd_exp.training.trainer import Trainer

K = 6  # the served top-k (< the vocabulary: the sparse payload)
KEYS = ("jsd/mean", "kl/reverse", "kl/forward", "advantages/mean", "student/logprob_mean", "teacher/logprob_mean")


@pytest.fixture
def echo_task():
    register_task("tiny_echo", lambda cfg: EchoTask(), replace=True)
    register_environment("tiny_echo", lambda cfg: Echo(limit=2), replace=True)
    return EchoTask()


def _cfg(env_tokens: str, **teacher):
    ro = {"max_new_tokens": 4, "max_prompt_tokens": 8, "max_turns": 3, "engine": "lean", "env_tokens": env_tokens}
    cfg = small_config(
        divergence={"name": "rkl"},
        estimator={"name": "topk", "k": K},
        trainer={"max_steps": 3, "micro_batch_size": 2},
        rollout=ro,
        **({"teacher": {"retries": 0, "backoff_s": 0.0, "timeout_s": 60.0, **teacher}} if teacher else {}),
    )
    return dataclasses.replace(cfg, task=TaskConfig(name="tiny_echo"))


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _fresh(pair):
    """The pair with a fresh copy of the student (each run trains its own)."""
    out = copy.copy(pair)
    out.student = copy.deepcopy(pair.student)
    return out


def _same_runs(pair, task, tmp_path: Path, url: str, env_tokens: str) -> list[dict]:
    """The in-process and the served run on the same episodes: their per-step losses equal to 1e-6
    relative (the other numbers to 1e-5); the episodes had environment tokens, and with ``trained``
    they were trained."""
    Trainer(_cfg(env_tokens), tmp_path / f"{env_tokens}_local", pair=_fresh(pair), task=task).run()
    Trainer(_cfg(env_tokens, name="served", url=url), tmp_path / f"{env_tokens}_served", pair=_fresh(pair), task=task).run()
    local, served = _steps(tmp_path / f"{env_tokens}_local"), _steps(tmp_path / f"{env_tokens}_served")
    assert len(local) == len(served) == 3
    for a, b in zip(local, served):
        assert b["episode/env_tokens_mean"] == a["episode/env_tokens_mean"]  # the same episodes
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-9)
        # the per-token estimates read log T(y) as served (float32 rounding apart: ~5e-7 nats)
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert sum(r["episode/env_tokens_mean"] for r in local) > 0
    trained_env = [r["response/length_mean"] - r["episode/student_tokens_mean"] for r in local]
    assert (min(trained_env) > 0) == (env_tokens == "trained") and max(trained_env) == pytest.approx(
        max(trained_env) * (env_tokens == "trained")
    )
    return local


class WideEcho(Echo):
    """Echo whose turns end at any printable character: a random student over a byte-level vocabulary
    (259 tokens) stops within a few tokens, so every step's episodes hold environment tokens."""

    stop = tuple(string.printable[:94])


def _episode_batch(pair, env=None):
    """Greedy episodes of the tiny student against the echo tool (answers between its turns)."""
    from opd_exp.training.episodes import EpisodeRollout
    from opd_exp.training.rollout import ModuleRollout

    ro = _cfg("masked").rollout
    engine = EpisodeRollout(ModuleRollout(pair.student, pair.tokenizer, ro, pair.vocab_size), env or Echo(limit=2), ro)
    batch = engine.generate(["1+", "23+", "7", "4+7"], greedy=True)
    assert (batch.response_mask & ~batch.loss_mask).any()  # environment tokens among the scored positions
    return batch


def _scores_equal(client, pair, batch) -> None:
    """The served payload at every position of the episodes (environment tokens included) equals the
    in-process teacher's top-k and sampled-token log-probs."""
    from opd_exp.training.scoring import InProcessTeacher, teacher_topk

    local = InProcessTeacher(pair.teacher, pair.vocab_size, temperature=1.0, device="cpu").score(batch).logits
    got = client.score(batch)
    lp, ids = teacher_topk(local, K)
    m = batch.response_mask
    assert torch.equal(got.topk_ids[m], ids[m])
    torch.testing.assert_close(got.topk_logprobs[m], lp[m], rtol=0, atol=1e-6)
    want_t = local.log_softmax(-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got.sampled_logprobs[m], want_t[m].to(got.sampled_logprobs.dtype), rtol=0, atol=1e-6)


# -- the stand-in server -------------------------------------------------------------------------


@pytest.fixture
def fake(tiny_pair):
    from helpers.fake_vllm import FakeVllm

    server = FakeVllm(tiny_pair.teacher, tiny_pair.tokenizer, tiny_pair.vocab_size)
    yield server
    server.stop()


def test_served_scores_of_an_episode_equal_the_in_process_teachers(tiny_pair, fake, echo_task):
    from opd_exp.config.schema import TeacherConfig, TeacherName
    from opd_exp.training.teacher_served import ServedTeacher

    te = TeacherConfig(name=TeacherName.served, url=fake.url, k=K)
    client = ServedTeacher(te, K, tiny_pair.vocab_size, tokenizer=tiny_pair.tokenizer).connect(max_sequence_tokens=20)
    try:
        _scores_equal(client, tiny_pair, _episode_batch(tiny_pair))
    finally:
        client.close()


@pytest.mark.parametrize("env_tokens", ["masked", "trained"])
def test_a_served_episode_run_equals_the_in_process_run(tiny_pair, fake, tmp_path, echo_task, env_tokens):
    _same_runs(tiny_pair, echo_task, tmp_path, fake.url, env_tokens)


def test_the_servers_length_holds_an_episodes_budget(tiny_pair, fake, echo_task, local_pair_dir):
    """A row of an episode holds the prompt and the episode's budget (rollout.max_episode_tokens), not
    one turn: the client refuses a server too short for it before training, and opd-serve-teacher's
    default --max-model-len holds it."""
    from helpers.reliability import pair_args
    from opd_exp.cli.serve_teacher import options_from_args
    from opd_exp.runtime.errors import ConfigError
    from opd_exp.training.teacher_served import build_served_teacher

    cfg = _cfg("masked", name="served", url=fake.url, k=K)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_episode_tokens=60))  # 8 + 60 tokens > the stand-in's 64
    with pytest.raises(ConfigError, match=r"the server's max_model_len=64 is shorter than a rollout's 68 tokens \+ 1 "):
        build_served_teacher(cfg, tiny_pair.vocab_size, tiny_pair.tokenizer, None)
    build_served_teacher(_cfg("masked", name="served", url=fake.url, k=K), tiny_pair.vocab_size, tiny_pair.tokenizer, None).close()
    episodes = ["rollout.max_prompt_tokens=300", "rollout.max_new_tokens=24", "rollout.max_turns=4", "rollout.max_episode_tokens=400"]
    options = options_from_args([*pair_args(local_pair_dir), *episodes, "port=8001"])
    assert options.max_model_len == 300 + 400 + 1
    assert options_from_args([*pair_args(local_pair_dir), *episodes[:2], "port=8001"]).max_model_len == 512  # one turn: at least 512


# -- a real opd-serve-teacher (vLLM's CPU build) ---------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
@pytest.mark.slow
def test_opd_serve_teacher_scores_episodes_as_the_in_process_teacher(tmp_path, echo_task):
    """``opd-serve-teacher model_pair=local`` (a vLLM process, CPU, fp32) serving a head_dim-64 teacher
    with the embedded byte-level tokenizer (one vLLM tokenizes as transformers does): its scores of
    greedy episodes equal the in-process teacher's at every position (environment tokens included),
    and runs with the environment's tokens masked and trained give the in-process losses to 1e-6
    relative."""
    from transformers import AutoModelForCausalLM

    from opd_exp.cli.serve_teacher import TeacherServer, options_from_args
    from opd_exp.config.schema import TeacherConfig, TeacherName
    from opd_exp.pairs.embedded.tokenizer import load_tokenizer, save_tokenizer
    from opd_exp.training.teacher_served import ServedTeacher

    register_environment("tiny_echo", lambda cfg: WideEcho(limit=2), replace=True)
    for role in ("student", "teacher"):
        save_tokenizer(tmp_path / "world" / role)
    tok = load_tokenizer(tmp_path / "world" / "student")
    V = len(tok)
    build_model(tmp_path / "world" / "student", V, hidden=32, layers=1, seed=1)
    build_model(tmp_path / "world" / "teacher", V, hidden=128, layers=1, seed=2)  # 2 heads: head_dim 64
    pair = SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(tmp_path / "world" / "student"),
        teacher=AutoModelForCausalLM.from_pretrained(tmp_path / "world" / "teacher"),
        tokenizer=tok,
        vocab_size=V,
    )
    argv = [
        "model_pair=local",
        f"model_pair.student={tmp_path / 'world' / 'student'}",
        f"model_pair.teacher={tmp_path / 'world' / 'teacher'}",
    ]
    options = options_from_args([*argv, f"teacher.k={K}", f"port={_free_port()}", "max_model_len=128", "kv_cache_gib=1"])
    with TeacherServer(options).start(ready_s=float(os.environ.get("OPD_VLLM_READY_S", "600"))) as server:
        te = TeacherConfig(name=TeacherName.served, url=server.o.url, k=K)
        client = ServedTeacher(te, K, V, tokenizer=tok).connect(max_sequence_tokens=20)
        try:
            _scores_equal(client, pair, _episode_batch(pair, WideEcho(limit=2)))
        finally:
            client.close()
        for env_tokens in ("masked", "trained"):
            rows = _same_runs(pair, echo_task, tmp_path, server.o.url, env_tokens)
            print(env_tokens, "losses", [r["loss"] for r in rows])
    assert server.proc.poll() is not None
