"""A served teacher (teacher=served): the sparse seam, the client against a stand-in server
(faults included), and, marked ``vllm``, against a real vLLM server on the SmolLM2 pair."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import socket
from pathlib import Path

import pytest
import torch

from helpers.fake_vllm import FakeVllm
from helpers.tiny import AddTask, small_config
from opd_exp.config.schema import TeacherConfig, TeacherName
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.monitors import Monitors
from opd_exp.training.objective import Objective
from opd_exp.training.scoring import TeacherScores, dense_from_topk, teacher_topk, token_logprobs
from opd_exp.training.teacher_served import ServedTeacher, TeacherUnavailable, probe_batch
from opd_exp.training.trainer import Trainer


def served(cfg, url: str, **fields):
    """``cfg`` with teacher=served at ``url`` (validated again, as the CLI would)."""
    te = TeacherConfig(name=TeacherName.served, url=url, **{"retries": 0, "backoff_s": 0.0, "timeout_s": 30.0, **fields})
    return dataclasses.replace(cfg, teacher=te)


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def fake(tiny_pair):
    server = FakeVllm(tiny_pair.teacher, tiny_pair.tokenizer, tiny_pair.vocab_size)
    yield server
    server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the seam: sparse scores against dense, exactly -------------------------------------------


def _sparse(logits: torch.Tensor, ids: torch.Tensor, k: int) -> TeacherScores:
    lp, top = teacher_topk(logits, k)
    return TeacherScores(topk_ids=top, topk_logprobs=lp, sampled_logprobs=token_logprobs(logits, ids))


@pytest.mark.parametrize("divergence", ["rkl", "jsd", "fkl", "tvd"])
@pytest.mark.parametrize("credit", ["token", "sequence"])
def test_sparse_topk_equals_dense_topk(divergence, credit, float64_default):
    """The same top-k payload read from dense logits or sent sparse: the same loss, gradient and
    estimates (float64, exact)."""
    torch.manual_seed(0)
    N, R, V, k = 3, 5, 11, 4
    zs = torch.randn(N, R, V, requires_grad=True)
    zt = torch.randn(N, R, V)
    y = torch.randint(0, V, (N, R))
    mask = torch.ones(N, R, dtype=torch.bool)
    mask[1, 3:] = False
    loss = "reinforce" if credit == "sequence" else "direct"
    cfg = small_config(divergence={"name": divergence}, estimator={"name": "topk", "k": k}, loss={"name": loss, "credit": credit})
    dense = Objective(cfg)(zs, zt, y, mask, on_policy=True, normalizer=7)
    (g_dense,) = torch.autograd.grad(dense.loss, zs)
    sparse = Objective(cfg, teacher_k=k, vocab_size=V)(zs, _sparse(zt, y, k), y, mask, on_policy=True, normalizer=7)
    dense.sums.update(Monitors(cfg)(zs, zt, dense).sums)
    sparse.sums.update(Monitors(cfg, sparse=True)(zs, _sparse(zt, y, k), sparse).sums)
    (g_sparse,) = torch.autograd.grad(sparse.loss, zs)
    assert float(sparse.loss.detach()) == float(dense.loss.detach())
    assert torch.equal(g_sparse, g_dense)
    for key in ("jsd/mean", "kl/reverse", "kl/forward", "advantages/mean", "teacher/logprob_mean", "student/entropy"):
        assert sparse.sums[key] == pytest.approx(dense.sums[key], rel=1e-12, abs=1e-12), key
    # what needs the teacher's whole distribution is not there under its name
    assert not any(key.startswith(("exact/", "overlap/", "teacher/entropy")) for key in sparse.sums)


@pytest.mark.parametrize("divergence", ["rkl", "jsd", "fkl"])
def test_full_vocabulary_payload_rebuilds_the_dense_teacher_exactly(divergence, float64_default):
    """k = V: the top-k log-probs ARE the teacher's log-probs; rebuilt dense, the exact full
    estimator gives the in-process loss and gradient (float64: equal to 1e-12)."""
    torch.manual_seed(1)
    N, R, V = 2, 4, 9
    zs = torch.randn(N, R, V, requires_grad=True)
    zt = 3 * torch.randn(N, R, V)
    y = torch.randint(0, V, (N, R))
    mask = torch.ones(N, R, dtype=torch.bool)
    lp, ids = teacher_topk(zt, V)
    rebuilt = dense_from_topk(ids, lp, V)
    cfg = small_config(divergence={"name": divergence}, estimator={"name": "full"})
    a = Objective(cfg)(zs, zt, y, mask, on_policy=True, normalizer=8)
    b = Objective(cfg)(zs, TeacherScores(logits=rebuilt), y, mask, on_policy=True, normalizer=8)
    (ga,) = torch.autograd.grad(a.loss, zs)
    (gb,) = torch.autograd.grad(b.loss, zs)
    assert float(b.loss) == pytest.approx(float(a.loss), rel=1e-12, abs=1e-12)
    assert torch.allclose(ga, gb, rtol=1e-12, atol=1e-12)
    for key in a.sums:
        assert b.sums[key] == pytest.approx(a.sums[key], rel=1e-10, abs=1e-10), key
    with pytest.raises(ValueError, match="does not cover"):
        dense_from_topk(ids[..., :-1], lp[..., :-1], V)


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ({"estimator": {"name": "full"}}, "estimator.name='full' is not allowed with teacher=served and teacher.k=4 < the vocabulary's 18"),
        ({"estimator": {"name": "topk", "k": 8}}, "estimator.k=8 is not allowed with teacher=served and teacher.k=4"),
        ({"estimator": {"name": "topk", "k": 4}, "rollout": {"top_k": 5}}, "rollout.top_k=5 is not allowed with teacher=served"),
        ({"estimator": {"name": "topk", "k": 4}, "rollout": {"on_policy_fraction": 0.5}}, "rollout.on_policy_fraction=0.5 is not allowed"),
    ],
)
def test_sparse_teacher_refuses_what_needs_the_whole_distribution(groups, match):
    with pytest.raises(ConfigError, match=match):
        Objective(small_config(divergence={"name": "rkl"}, **groups), teacher_k=4, vocab_size=18)


def test_served_config_refusals():
    base = small_config(estimator={"name": "topk", "k": 4})
    with pytest.raises(ConfigError, match=r"teacher.url=None is not allowed"):
        dataclasses.replace(base, teacher=TeacherConfig(name=TeacherName.served))
    with pytest.raises(ConfigError, match=r"divergence.temperature=2.0 is not allowed; allowed: 1.0 with teacher=served"):
        served(dataclasses.replace(base, divergence=dataclasses.replace(base.divergence, temperature=2.0)), "http://127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"estimator.k=4 is not allowed; allowed: at most teacher.k=2"):
        served(base, "http://127.0.0.1:1", k=2)
    with pytest.raises(ConfigError, match=r"teacher.url='localhost:8000' is not allowed"):
        TeacherConfig(name=TeacherName.served, url="localhost:8000")


# -- the client against a stand-in server ---------------------------------------------------


def test_served_scores_equal_the_in_process_teacher(tiny_pair, fake):
    """Through HTTP and back: the sparse payload of the stand-in (the same teacher) equals
    teacher_topk of the in-process logits; the batch's rows are sent without padding, several
    per request."""
    from opd_exp.training.scoring import InProcessTeacher

    V = tiny_pair.vocab_size
    te = TeacherConfig(name=TeacherName.served, url=fake.url, k=5, rows_per_request=2)
    client = ServedTeacher(te, 5, V, tokenizer=tiny_pair.tokenizer).connect(max_sequence_tokens=20)
    local = InProcessTeacher(tiny_pair.teacher, V, temperature=1.0, device="cpu")
    ids = [list(range(2, 2 + n)) for n in (6, 9, 4)]
    # left-padded prompts of lengths 3, 5, 2 and responses of lengths 3, 4, 2 (padded to 4)
    P, R = 5, 4
    input_ids = torch.zeros(3, P + R, dtype=torch.long)
    attn = torch.zeros(3, P + R, dtype=torch.long)
    rmask = torch.zeros(3, R, dtype=torch.bool)
    for i, (p, r) in enumerate(((3, 3), (5, 4), (2, 2))):
        input_ids[i, P - p : P + r] = torch.tensor(ids[i][: p + r])
        attn[i, P - p : P + r] = 1
        rmask[i, :r] = True
    from opd_exp.training.rollout import Batch, positions_from_mask

    batch = Batch(input_ids, attn, positions_from_mask(attn), P, rmask, torch.arange(3))
    got = client.submit(batch).result()
    want = _sparse(local.score(batch).logits, batch.response_ids, 5)
    assert sorted(fake.prompts_seen) == [1, 2]  # rows_per_request=2 (the two requests are in flight at once: any order)
    m = rmask
    assert torch.equal(got.topk_ids[m], want.topk_ids[m])
    assert torch.allclose(got.topk_logprobs[m], want.topk_logprobs[m], atol=1e-6, rtol=0)
    assert torch.allclose(got.sampled_logprobs[m], want.sampled_logprobs[m], atol=1e-6, rtol=0)
    assert client.identity() == {
        "teacher.server.model": "teacher",
        "teacher.server.root": "/models/tiny-teacher",
        "teacher.server.max_model_len": 64,
        "teacher.server.k": 5,
        "teacher.server.tokenizer_hash": client.identity()["teacher.server.tokenizer_hash"],
    }
    assert len(client.identity()["teacher.server.tokenizer_hash"]) == 16
    gaps = client.self_test(local, ids=list(range(2, 12)))
    assert gaps["repeat"] == 0.0 and gaps["shared_prefix"] <= 1e-6 and gaps["in_process"] <= 1e-6
    client.close()


def test_a_served_run_matches_the_in_process_run(tiny_pair, fake, tmp_path):
    """estimator=topk with k < V: the served run's per-step losses equal the in-process run's
    (the stand-in computes the same log-probs; the payload round-trips through JSON as float64)."""
    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "topk", "k": 6}, trainer={"max_steps": 3, "micro_batch_size": 2})
    Trainer(cfg, tmp_path / "local", pair=tiny_pair, task=AddTask()).run()
    import copy

    pair2 = copy.copy(tiny_pair)
    pair2.student = type(tiny_pair.student).from_pretrained(tiny_pair.student.name_or_path)
    Trainer(served(cfg, fake.url), tmp_path / "served", pair=pair2, task=AddTask()).run()
    a, b = losses(tmp_path / "local"), losses(tmp_path / "served")
    assert len(a) == len(b) == 3
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    rows = metric_rows(tmp_path / "served")
    assert not any(k.startswith(("exact/", "overlap/", "teacher/entropy", "eval/kl", "eval/jsd", "eval/rkl")) for r in rows for k in r)
    assert "eval/accuracy" in rows[-1] and "jsd/mean" in rows[1]
    assert fake.prompts_seen.count(2) >= 6  # micro-batches of 2 rows, one request each
    state = json.loads(next((tmp_path / "served").glob("checkpoints/step_*/state.json")).read_text())
    assert state["config"]["teacher.server.root"] == "/models/tiny-teacher"
    assert "teacher.url" not in state["config"]


def test_full_vocabulary_k_gives_every_metric(tiny_pair, fake, tmp_path):
    """teacher.k >= V: the payload is rebuilt dense, estimator=full runs and every metric is logged,
    equal to the in-process run's."""
    V = tiny_pair.vocab_size
    cfg = small_config(divergence={"name": "jsd"}, estimator={"name": "full"}, trainer={"max_steps": 2})
    Trainer(cfg, tmp_path / "local", pair=tiny_pair, task=AddTask()).run()
    import copy

    pair2 = copy.copy(tiny_pair)
    pair2.student = type(tiny_pair.student).from_pretrained(tiny_pair.student.name_or_path)
    Trainer(served(cfg, fake.url, k=V), tmp_path / "served", pair=pair2, task=AddTask()).run()
    a, b = metric_rows(tmp_path / "local"), metric_rows(tmp_path / "served")
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if isinstance(value, float) and not key.startswith("perf/") and math.isfinite(value):
                assert rb[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_wrong_model_and_tokenizer_are_refused_before_training(tiny_pair, fake, tmp_path):
    cfg = small_config(estimator={"name": "topk", "k": 4})
    with pytest.raises(ConfigError, match=r"the server serves 'teacher', not 'other'; allowed: teacher.model set to the served name"):
        Trainer(served(cfg, fake.url, model="other"), tmp_path / "a", pair=tiny_pair, task=AddTask())
    fake.tokenize_shift = 1
    with pytest.raises(ConfigError, match=r"another tokenizer; allowed: a server for this pair's teacher"):
        Trainer(served(cfg, fake.url), tmp_path / "b", pair=tiny_pair, task=AddTask())
    fake.tokenize_shift = 0
    fake.max_model_len = 10
    with pytest.raises(ConfigError, match=r"max_model_len=10 is shorter than a rollout's 12 tokens \+ 1"):
        Trainer(served(cfg, fake.url), tmp_path / "c", pair=tiny_pair, task=AddTask())
    assert fake.completions == 0  # refused before any scoring


def test_another_teacher_behind_the_url_fails_the_self_test(tiny_pair, tmp_path):
    """Same name, tokenizer and lengths, other weights: the in-process comparison refuses it."""
    import copy

    other = copy.deepcopy(tiny_pair.teacher)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    server = FakeVllm(other, tiny_pair.tokenizer, tiny_pair.vocab_size)
    try:
        cfg = small_config(estimator={"name": "topk", "k": 4})
        with pytest.raises(ConfigError, match=r"differ from the pair's in-process teacher by .* nats \(> teacher.self_test_atol=0.001\)"):
            Trainer(served(cfg, server.url), tmp_path, pair=tiny_pair, task=AddTask())
    finally:
        server.stop()


# -- a served teacher: prefix caching off, and refused where its scores depend on the batch -------


def test_opd_serve_teacher_starts_vllm_with_prefix_caching_off():
    from opd_exp.cli.serve_teacher import ServeOptions, vllm_command

    for device in ("cpu", "cuda"):
        cmd = vllm_command(ServeOptions(folder="/models/t", port=8001, device=device))
        assert cmd.count("--no-enable-prefix-caching") == 1 and "--enable-prefix-caching" not in cmd


def test_a_server_whose_scores_move_with_a_shared_prefix_fails_the_self_test(tiny_pair, tmp_path):
    """Before: the self-test scored one sequence twice, alone; a server whose prompt_logprobs change
    when a prompt sharing the prefix comes first in the batch (prefix caching) passed."""
    server = FakeVllm(tiny_pair.teacher, tiny_pair.tokenizer, tiny_pair.vocab_size)
    try:
        cfg = dataclasses.replace(
            small_config(estimator={"name": "topk", "k": 4}),
            teacher=TeacherConfig(name=TeacherName.served, url=server.url, retries=0, backoff_s=0.0),
        )
        Trainer(cfg, tmp_path / "ok", pair=tiny_pair, task=AddTask())  # an honest server passes
        assert server.completions == 3 and server.prompts_seen == [1, 1, 2]  # alone twice, then beside its sibling
        server.shared_prefix_shift = 0.05
        with pytest.raises(ConfigError) as err:
            Trainer(cfg, tmp_path / "cached", pair=tiny_pair, task=AddTask())
        line = str(err.value)
        assert line.startswith(f"teacher.url={server.url} (model 'teacher'): a sequence scored in one request after a prompt sharing")
        assert "differs from it scored alone by 0.05 nats (> teacher.self_test_atol=0.001)" in line
        assert line.endswith(
            "allowed: a server started with --no-enable-prefix-caching (opd-serve-teacher does), or a larger teacher.self_test_atol"
        )
    finally:
        server.stop()


def test_server_down_or_wrong_port_is_one_line(tiny_pair, tmp_path):
    cfg = small_config(estimator={"name": "topk", "k": 4})
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError) as ex:
        Trainer(served(cfg, url), tmp_path, pair=tiny_pair, task=AddTask())
    line = str(ex.value)
    assert "\n" not in line
    assert line.startswith(f"teacher.url={url} (model 'teacher'): cannot reach the server (")
    assert line.endswith(
        "allowed: the URL of a running vLLM OpenAI-compatible server (opd-serve-teacher model_pair=<pair> port=<port> starts one and prints it)"
    )


def test_max_logprobs_cap_is_translated(tiny_pair, fake, tmp_path):
    fake.max_logprobs = 3
    cfg = small_config(estimator={"name": "topk", "k": 4})
    with pytest.raises(
        ConfigError,
        match=r"the server refuses prompt_logprobs=4 \(HTTP 400 from /v1/completions: Requested prompt logprobs of 4, which is greater than max allowed: 3\); allowed: teacher.k at most the server's --max-logprobs, or a server started with --max-logprobs >= 4",
    ):
        Trainer(served(cfg, fake.url), tmp_path, pair=tiny_pair, task=AddTask())


def test_malformed_and_slow_replies(tiny_pair, fake):
    V = tiny_pair.vocab_size
    te = TeacherConfig(name=TeacherName.served, url=fake.url, k=4, retries=0, timeout_s=0.5)
    client = ServedTeacher(te, 4, V, tokenizer=tiny_pair.tokenizer).connect()
    batch = probe_batch([2, 3, 4, 5, 6])
    fake.mode = "malformed"
    with pytest.raises(TeacherUnavailable, match=r"malformed prompt_logprobs reply: str prompt positions for a 5-token sequence"):
        client.score(batch)
    fake.mode, fake.slow_s = "slow", 2.0
    with pytest.raises(TeacherUnavailable) as ex:
        client.score(batch)
    assert str(ex.value) == (
        f"teacher.url={fake.url} (model 'teacher'): no reply to /v1/completions within teacher.timeout_s=0.5 s; "
        "allowed: a larger teacher.timeout_s, more teacher.retries, or a server with less load"
    )
    client.close()


def test_retries_with_backoff_then_one_line(tiny_pair, fake):
    V = tiny_pair.vocab_size
    te = TeacherConfig(name=TeacherName.served, url=fake.url, k=4, retries=2, backoff_s=0.01)
    client = ServedTeacher(te, 4, V).connect()
    fake.mode = "error500"
    with pytest.raises(TeacherUnavailable, match=r"HTTP 500 from /v1/completions: EngineCore died \(after 3 attempts\)"):
        client.score(probe_batch([2, 3, 4]))
    assert fake.completions == 3
    client.close()


def test_server_killed_mid_run_stops_with_a_checkpoint_and_resumes(tiny_pair, fake, tmp_path):
    """The server goes away during step 3 (micro-batches of 2 rows: 2 requests a step): retries,
    then a clean stop with step 2's checkpoint and one line; no step trained on partial scores.
    Started again, the run resumes and ends where an uninterrupted run ends."""
    import copy

    cfg = small_config(divergence={"name": "rkl"}, estimator={"name": "topk", "k": 6}, trainer={"max_steps": 4, "micro_batch_size": 2})
    full_pair = copy.copy(tiny_pair)
    full_pair.student = type(tiny_pair.student).from_pretrained(tiny_pair.student.name_or_path)
    Trainer(served(cfg, fake.url), tmp_path / "whole", pair=full_pair, task=AddTask()).run()
    whole = losses(tmp_path / "whole")

    fake.completions, fake.stop_after = 0, 3 + 2 * 2 + 1  # self-test (3) + 2 steps (4 requests) + 1 of step 3
    run = tmp_path / "cut"
    with pytest.raises(ConfigError) as ex:
        Trainer(served(cfg, fake.url, retries=1, backoff_s=0.01), run, pair=tiny_pair, task=AddTask()).run()
    line = str(ex.value)
    assert "\n" not in line
    # the server dies between requests (refused) or during one (reset): either is the same stop
    assert re.match(rf"teacher\.url={re.escape(fake.url)} \(model 'teacher'\): (cannot reach the server|the connection broke) \(", line), (
        line
    )
    assert (
        f"(after 2 attempts); allowed: a running server (teacher.retries=1, teacher.backoff_s=0.01); the run stopped before step 3 (nothing trained on partial scores), checkpoint at step 2 saved to {run}/checkpoints/step_000002; to resume: start the teacher server again and run the same command"
        in line
    )
    assert losses(run) == pytest.approx(whole[:2], rel=0, abs=0)

    back = FakeVllm(fake.model, tiny_pair.tokenizer, tiny_pair.vocab_size)  # another port: the URL is not identity
    try:
        pair3 = copy.copy(tiny_pair)
        pair3.student = type(tiny_pair.student).from_pretrained(tiny_pair.student.name_or_path)
        Trainer(served(cfg, back.url), run, pair=pair3, task=AddTask()).run()
        assert losses(run) == pytest.approx(whole, rel=1e-6, abs=1e-7)
        # another teacher (another root) is refused on resume
        other = FakeVllm(fake.model, tiny_pair.tokenizer, tiny_pair.vocab_size, root="/models/another")
        try:
            cfg5 = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=5))
            with pytest.raises(ConfigError, match=r"teacher.server.root: '/models/tiny-teacher' -> '/models/another'"):
                Trainer(served(cfg5, other.url), run, pair=tiny_pair, task=AddTask()).run()
        finally:
            other.stop()
    finally:
        back.stop()


def test_overlap_sends_every_micro_batch_before_the_first_is_used(tiny_pair, fake, tmp_path, monkeypatch):
    """With teacher.overlap the step's requests are all sent when accumulate starts, so the server
    scores micro-batch i+1 while the trainer works on i; without it one at a time, when needed.
    The losses are equal either way."""
    import copy

    from opd_exp.training import objective as objective_module

    order: list[str] = []
    send, call = ServedTeacher._send, objective_module.Objective.__call__
    monkeypatch.setattr(ServedTeacher, "_send", lambda self, batch: (order.append("sent"), send(self, batch))[1])
    monkeypatch.setattr(objective_module.Objective, "__call__", lambda self, *a, **k: (order.append("used"), call(self, *a, **k))[1])
    cfg = small_config(
        divergence={"name": "rkl"}, estimator={"name": "topk", "k": 6}, trainer={"max_steps": 1, "eval_size": 1, "micro_batch_size": 1}
    )
    for overlap in (True, False):
        pair = copy.copy(tiny_pair)
        pair.student = type(tiny_pair.student).from_pretrained(tiny_pair.student.name_or_path)
        order.clear()
        Trainer(served(cfg, fake.url, overlap=overlap), tmp_path / str(overlap), pair=pair, task=AddTask()).run()
        step = ["sent"] * 4 + ["used"] * 4 if overlap else ["sent", "used"] * 4
        assert order == ["sent", "sent", *step], overlap  # the self-test's two, then the step's four micro-batches
    assert losses(tmp_path / "True") == losses(tmp_path / "False")


# -- a real vLLM server on the SmolLM2 pair -----------------------------------------------------
# One server for the module (start-up ~60-100 s on 2 cores), stopped at its end. Measured here
# (2 cores, fp32): served log-probs agree with the in-process teacher's to ~1e-5 nats (bound 1e-3).
SMOLLM2_K = 16


@pytest.fixture(scope="module")
def smollm2_server():
    from opd_exp.cli.serve_teacher import TeacherServer, options_from_args

    options = options_from_args(["model_pair=smollm2", f"port={free_port()}", f"teacher.k={SMOLLM2_K}", "kv_cache_gib=1"])
    server = TeacherServer(options).start(ready_s=float(os.environ.get("OPD_VLLM_READY_S", "600")))
    try:
        yield server
    finally:
        server.stop()
    assert server.proc.poll() is not None  # the whole process group is gone


@pytest.fixture(scope="module")
def smollm2_pair():
    from opd_exp.cli.train import build_inputs

    cfg = smollm2_config()
    return build_inputs(cfg)


def smollm2_config(*overrides: str):
    from opd_exp.cli.compose import compose_config

    shrink = [
        "experiment=smollm2_recovery",
        "estimator=topk",
        f"estimator.k={SMOLLM2_K}",
        "trainer.max_steps=3",
        "trainer.batch_size=4",
        "trainer.micro_batch_size=2",
        "eval.size=2",
        "eval.batch_size=2",
        "trainer.progress=false",
        "scale.fused_lm_head=off",
        "scale.num_threads=1",
    ]
    return compose_config(*shrink, *overrides)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_scores_equal_the_in_process_teacher(smollm2_server, smollm2_pair):
    """A real vLLM server (CPU, fp32) against the pair's teacher in this process, on a chat-formatted
    sequence: the same top-16 ids, and log-probs within 1e-3 nats (measured ~1e-5)."""
    from opd_exp.training.scoring import InProcessTeacher
    from opd_exp.training.teacher_served import _sparse_from_dense

    pair = smollm2_pair["pair"]
    tok, V = pair.tokenizer, int(pair.vocab_size)
    te = TeacherConfig(name=TeacherName.served, url=smollm2_server.o.url, k=SMOLLM2_K)
    client = ServedTeacher(te, SMOLLM2_K, V, tokenizer=tok).connect(max_sequence_tokens=71)
    try:
        assert client.identity()["teacher.server.max_model_len"] == 512
        assert client.identity()["teacher.server.root"] == smollm2_server.o.folder
        text = tok.apply_chat_template([{"role": "user", "content": "What is 7+8?"}], tokenize=False, add_generation_prompt=True)
        ids = tok(text + "7+8 = 15. The answer is 15.", add_special_tokens=False)["input_ids"]
        batch = probe_batch(ids)
        got = client.score(batch)
        assert client.score(batch).sampled_logprobs.equal(got.sampled_logprobs)  # the same request twice: equal
        local = InProcessTeacher(pair.teacher, V, temperature=1.0, device="cpu")
        want = _sparse_from_dense(local.score(batch).logits, batch.response_ids, SMOLLM2_K)
        gap_sampled = float((got.sampled_logprobs - want.sampled_logprobs).abs().max())
        gap_topk = float((got.topk_logprobs - want.topk_logprobs).abs().max())
        print(f"served vs in-process: sampled {gap_sampled:.2e}, top-{SMOLLM2_K} {gap_topk:.2e} nats")
        assert gap_sampled < 1e-3 and gap_topk < 1e-3
        # ids agree except where two log-probs tie within the tolerance
        top_gap = (want.topk_logprobs[..., :-1] - want.topk_logprobs[..., 1:]).abs()
        differ = got.topk_ids != want.topk_ids
        assert not differ[..., :-1].logical_and(top_gap > 1e-3).any()
    finally:
        client.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_served_run_matches_the_in_process_run(smollm2_server, smollm2_pair, tmp_path):
    """teacher=served estimator=topk (k=16) against a real server: per-step losses equal the
    in-process run's within 1e-3 relative (the log-probs' fp32 rounding; measured ~1e-5)."""
    import copy

    runs = {}
    for name, extra in (("local", []), ("served", ["teacher=served", f"teacher.url={smollm2_server.o.url}"])):
        pair = copy.copy(smollm2_pair["pair"])
        pair.student = copy.deepcopy(smollm2_pair["pair"].student)
        Trainer(smollm2_config(*extra), tmp_path / name, pair=pair, task=smollm2_pair["task"]).run()
        runs[name] = losses(tmp_path / name)
    print("losses", runs)
    assert len(runs["served"]) == 3
    assert runs["served"] == pytest.approx(runs["local"], rel=1e-3, abs=1e-5)


def test_a_server_lost_during_a_periodic_eval_stops_with_the_finished_step_saved(tiny_pair, fake, tmp_path):
    """teacher.k >= V scores eval through the server too: lost there, after step 2 finished, the
    run saves step 2 (its data position after the step) and stops in one line, never a traceback;
    started again it ends with the losses of an uninterrupted run."""
    import copy

    V = tiny_pair.vocab_size
    cfg = small_config(estimator={"name": "full"}, trainer={"max_steps": 4, "eval_every": 2})

    def fresh():
        pair = copy.copy(tiny_pair)
        pair.student = type(tiny_pair.student).from_pretrained(tiny_pair.student.name_or_path)
        return pair

    Trainer(served(cfg, fake.url, k=V), tmp_path / "whole", pair=fresh(), task=AddTask()).run()
    t = Trainer(served(cfg, fake.url, k=V), tmp_path / "cut", pair=fresh(), task=AddTask())
    real_evaluate = t.evaluate

    def evaluate():
        if t.step == 2:
            fake.mode = "error500"
        return real_evaluate()

    t.evaluate = evaluate
    with pytest.raises(ConfigError) as ex:
        t.run()
    line = str(ex.value)
    assert "\n" not in line and "HTTP 500" in line
    assert f"the run stopped before step 3 (nothing trained on partial scores), checkpoint at step 2 saved to {tmp_path / 'cut'}" in line
    fake.mode = "ok"
    Trainer(served(cfg, fake.url, k=V), tmp_path / "cut", pair=fresh(), task=AddTask()).run()
    by_step = [{r["step"]: r["loss"] for r in metric_rows(tmp_path / run) if "loss" in r} for run in ("whole", "cut")]
    assert set(by_step[1]) == set(by_step[0])  # step 2's row was kept (without its lost eval)
    assert {s: by_step[1][s] for s in by_step[0]} == pytest.approx(by_step[0], rel=1e-6, abs=1e-7)
