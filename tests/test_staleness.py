"""Asynchronous OPD (rollout.staleness): the corrections' expected gradients by enumeration on a
tabular model, and the refusals. Every sequence of a 3-token vocabulary and length 2 is drawn from a
behaviour policy B (an older student); the corrected loss's expected gradient under y ~ B must equal
the on-policy loss's expected gradient under y ~ S at the current student (float64)."""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers.tiny import small_config
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.objective import Objective

V, L = 3, 2
PREFIXES = [()] + [(a,) for a in range(V)]


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    theta = {p: (1.5 * torch.randn(V, generator=g, dtype=torch.float64)).requires_grad_(True) for p in PREFIXES}
    behaviour = {p: theta[p].detach() + 0.8 * torch.randn(V, generator=g, dtype=torch.float64) for p in PREFIXES}
    teacher = {p: 1.5 * torch.randn(V, generator=g, dtype=torch.float64) for p in PREFIXES}
    return theta, behaviour, teacher


def _logits(table, y):
    return torch.stack([table[tuple(y[:t])] for t in range(L)])[None]  # [1, L, V]


def _logprob(table, y) -> torch.Tensor:
    z = _logits(table, y)[0].detach().log_softmax(-1)
    return z[torch.arange(L), torch.tensor(y)]  # [L]


def _expected_gradient(cfg, theta, teacher, sampler, behaviour=None):
    """sum_y P_sampler(y) grad loss(y) (one row per sequence, normaliser 2: the fixed length)."""
    obj = Objective(cfg, vocab_size=V)
    params = [theta[p] for p in PREFIXES]
    total = [torch.zeros(V, dtype=torch.float64) for _ in params]
    for y in itertools.product(range(V), repeat=L):
        p = float(_logprob(sampler, y).sum().exp())
        b = None if behaviour is None else _logprob(behaviour, y)[None]
        out = obj(_logits(theta, y), _logits(teacher, y).detach(), torch.tensor([y]), torch.ones(1, L, dtype=torch.bool),
                  on_policy=True, normalizer=L, behaviour_logprobs=b)  # fmt: skip
        grads = torch.autograd.grad(out.loss, params, allow_unused=True)
        for i, gi in enumerate(grads):
            if gi is not None:
                total[i] += p * gi
    return torch.cat(total)


CASES = [
    ("sampled", "reinforce", "token", "rkl"),
    ("sampled", "reinforce", "token", "fkl"),
    ("sampled", "reinforce", "token", "jsd"),
    ("sampled", "reinforce", "sequence", "rkl"),
    ("sampled", "reinforce", "sequence", "jsd"),
    ("full", "direct", "token", "jsd"),
    ("full", "direct", "token", "rkl"),
    ("topk", "reinforce", "token", "fkl"),
]


def _cfg(est, loss, credit, div, **rollout):
    return small_config(
        estimator={"name": est, "k": 2, "baseline": "none"},
        loss={"name": loss, "credit": credit},
        divergence={"name": div},
        rollout=rollout,
    )


@pytest.mark.parametrize("est,loss,credit,div", CASES)
def test_untruncated_recompute_gives_the_on_policy_gradient_at_the_current_student(est, loss, credit, div):
    theta, behaviour, teacher = _tables(3)
    on_policy = _expected_gradient(_cfg(est, loss, credit, div), theta, teacher, sampler=theta)
    stale = _cfg(est, loss, credit, div, staleness=1, correction="recompute", is_cap=None)
    got = _expected_gradient(stale, theta, teacher, sampler=behaviour, behaviour=behaviour)
    torch.testing.assert_close(got, on_policy, rtol=1e-10, atol=1e-12)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_uncorrected_truncated_and_stored_cost_gradients_are_off_and_the_check_sees_it():
    """The same enumeration fails for what is biased: no correction (the behaviour policy's
    gradient), truncated weights (cap 1.2; measured), rkl's cost at the behaviour log-probs (is)."""
    theta, behaviour, teacher = _tables(3)
    args = ("sampled", "reinforce", "token", "rkl")
    want = _expected_gradient(_cfg(*args), theta, teacher, sampler=theta)
    errors = {}
    for correction, cap in (("none", None), ("recompute", 1.2), ("is", None)):
        cfg = _cfg(*args, staleness=1, correction=correction, is_cap=cap)
        errors[correction, cap] = _rel(_expected_gradient(cfg, theta, teacher, sampler=behaviour, behaviour=behaviour), want)
    assert all(e > 1e-3 for e in errors.values()), errors
    # a cap no weight reaches changes nothing
    cfg = _cfg(*args, staleness=1, correction="recompute", is_cap=1e6)
    assert _rel(_expected_gradient(cfg, theta, teacher, sampler=behaviour, behaviour=behaviour), want) < 1e-10


def test_weights_are_prefix_products_and_their_metrics():
    from opd_exp.training.staleness import CORRECTIONS

    s_now = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64)
    s_b = torch.tensor([[-1.5, -1.0, -0.5, 0.0]], dtype=torch.float64)
    m = torch.tensor([[True, True, True, False]])
    w, sums, maxes = CORRECTIONS["recompute"](cap=1.5, sequence=False).weights(s_now, s_b, m)
    want = torch.tensor([[min(1.5, 0.5**0 * torch.e**0.5), torch.e ** (0.5 - 1.0), torch.e ** (0.5 - 1.0), 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w[m], want[m])
    assert sums["async/is_clip_frac"] == 1.0 and maxes["async/is_weight_max"] == pytest.approx(torch.e**0.5)
    assert sums["async/is_weight_mean"] == pytest.approx(float(want[m].sum()))
    w_seq, _, _ = CORRECTIONS["recompute"](cap=None, sequence=True).weights(s_now, s_b, m)
    torch.testing.assert_close(w_seq[m], torch.full((3,), torch.e**-0.5, dtype=torch.float64))
    w_none, _, _ = CORRECTIONS["none"](cap=None, sequence=False).weights(s_now, s_b, m)
    assert torch.equal(w_none, torch.ones_like(w_none))


@pytest.mark.parametrize(
    "groups,message",
    [
        ({"rollout": {"staleness": 2}}, "rollout.correction=None is not allowed; allowed: recompute, is or none with rollout.staleness=2"),
        (
            {"rollout": {"staleness": 1, "correction": "is"}, "estimator": {"name": "full"}, "loss": {"name": "direct"}},
            "rollout.correction='is' is not allowed; allowed: recompute or none with rollout.staleness=1 and estimator=full",
        ),
        (
            {"rollout": {"staleness": 1, "correction": "recompute"}, "estimator": {"name": "sampled"}, "loss": {"name": "ppo"}},
            "loss.name='ppo' is not allowed; allowed: reinforce or direct with rollout.staleness=1",
        ),
        (
            {"rollout": {"staleness": 1, "correction": "recompute", "on_policy_fraction": 0.5}},
            "rollout.on_policy_fraction=0.5 is not allowed; allowed: 1.0 with rollout.staleness=1",
        ),
        ({"rollout": {"staleness": -1}}, "rollout.staleness=-1 is not allowed; allowed: an integer 0..64"),
        ({"rollout": {"is_cap": 0.5}}, "rollout.is_cap=0.5 is not allowed; allowed: >= 1"),
        (
            {"rollout": {"staleness": 1, "correction": "recompute"}, "scale": {"fused_lm_head": "on"}},
            "scale.fused_lm_head='on' is not allowed; allowed: auto or off with rollout.staleness > 0",
        ),
    ],
)
def test_refusals_are_one_line(groups, message):
    with pytest.raises(ConfigError) as ex:
        small_config(**groups)
    assert str(ex.value).startswith(message) and "\n" not in str(ex.value)


def test_staleness_zero_takes_a_correction_and_changes_nothing():
    cfg = small_config(rollout={"staleness": 0, "correction": "recompute"})
    assert Objective(cfg).correction is None


# -- the producer, through the trainer ------------------------------------------------------------
def _run(tiny_pair_factory, run_dir, steps: int, stop_after=None, **rollout):
    from helpers.tiny import AddTask
    from opd_exp.training.trainer import Trainer

    groups = dict(
        divergence={"name": "rkl"},
        estimator={"name": "sampled", "baseline": "none"},
        loss={"name": "reinforce"},
        trainer={"max_steps": steps, "lr": 0.05},
        checkpoint={"every": 2},
        rollout={"max_new_tokens": 4, "max_prompt_tokens": 8, **rollout},
    )
    tr = Trainer(small_config(**groups), run_dir, pair=tiny_pair_factory(), task=AddTask())
    tr.run(stop_after=stop_after)
    return tr


def _rows(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def fresh_pair(tiny_dir):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    def make():
        tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
        return SimpleNamespace(
            student=AutoModelForCausalLM.from_pretrained(tiny_dir / "student"),
            teacher=AutoModelForCausalLM.from_pretrained(tiny_dir / "teacher"),
            tokenizer=tok,
            vocab_size=len(tok),
        )

    return make


def _same(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in ra:
            if not key.startswith(("perf/", "async/learner_wait", "async/producer_wait")):
                assert ra[key] == rb[key], (ra["step"], key)


@pytest.mark.slow  # each run starts a producer process
@pytest.mark.parametrize("k", [1, 2])
def test_a_stale_run_trains_on_rollouts_k_updates_old_and_is_the_same_run_twice(fresh_pair, tmp_path, k):
    _run(fresh_pair, tmp_path / "a", 4, staleness=k, correction="recompute")
    _run(fresh_pair, tmp_path / "b", 4, staleness=k, correction="recompute")
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    _same(a, b)  # what the producer samples is a function of (seed, step, weights), never of timing
    train = [r for r in a if "async/staleness" in r]
    assert [r["async/staleness"] for r in train] == [min(s, k) for s in range(4)]
    assert all(r["async/is_weight_mean"] > 0 and r["async/is_weight_max"] > 0 for r in train)
    assert train[0]["async/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # step 1: sampled by the weights it trains
    # later rollouts come from older weights: the trainer's log-probs part from the engine's
    assert max(r["rollout/logprob_gap"] for r in train[k:]) > 1e-3 > train[0]["rollout/logprob_gap"]


@pytest.mark.slow
def test_a_resumed_stale_run_equals_the_straight_one(fresh_pair, tmp_path):
    """The checkpoint holds the rollouts in flight (sampled by weights it no longer has)."""
    from opd_exp.runtime import checkpoint

    _run(fresh_pair, tmp_path / "a", 6, staleness=2, correction="recompute")
    assert _run(fresh_pair, tmp_path / "b", 6, stop_after=3, staleness=2, correction="recompute") is not None
    assert (tmp_path / "b" / "checkpoints" / "step_000002" / checkpoint.PRODUCER_FILE).is_file()
    _run(fresh_pair, tmp_path / "b", 6, staleness=2, correction="recompute")
    _same(_rows(tmp_path / "a"), _rows(tmp_path / "b"))


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (Linux /proc)."""
    from pathlib import Path

    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_a_producer_ends_when_its_learner_is_killed_outright(local_pair_dir, tmp_path):
    """SIGKILL gives the learner no chance to send "stop": no process it started (the forkserver, the
    producer) may outlive it."""
    import os
    import signal
    import time
    from pathlib import Path

    from helpers.reliability import BASE, pair_args, popen

    if not Path("/proc/self/stat").is_file():
        pytest.skip("needs /proc")
    args = [*pair_args(local_pair_dir), *BASE, "trainer.max_steps=100000", "logger=none", "rollout.staleness=1",
            "rollout.correction=recompute", "estimator=sampled", "loss=reinforce"]  # fmt: skip
    proc = popen(args, tmp_path / "run")
    try:
        deadline, producers = time.monotonic() + 600, []  # liveness bounds, not timings: generous under load
        while not producers and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            # the producer is a child of the forkserver, itself a child of the learner: every descendant
            helpers = _children(proc.pid)
            producers = [g for c in helpers for g in _children(c)]
            producers = producers and [*helpers, *producers]
        assert producers, (proc.poll(), proc.stderr.read()[-2000:] if proc.poll() is not None else "")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 180  # the producer looks for its parent every 5 s
        while any(Path(f"/proc/{p}").exists() for p in producers) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(Path(f"/proc/{p}").exists() for p in producers), "the producer outlived its learner"
    finally:
        if proc.poll() is None:
            proc.kill()
