"""Episode rollouts (training/episodes.py) on the tiny pair: the lean and HF engines lay out the same
episodes for the same seeds, the masks say who wrote each token, the engine's log-probs are the
trainer's on the student's tokens, a runaway episode ends at its budget with a count, and a training
run on a task with an environment logs the episode and tool metrics. The calculator's parser never
crashes on what a model writes."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny import AddTask, small_config
from opd_exp.config.world import TaskConfig
from opd_exp.tasks.calc_tool import ERROR, CalcEnvironment, ParseError, answer_call, calculate
from opd_exp.tasks.environment import Environment, EpisodeView, Reply, register_environment
from opd_exp.training.episodes import EpisodeLog, EpisodeRollout
from opd_exp.training.rollout import ModuleRollout, generate
from opd_exp.training.sampler import lean_generate
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import student_logits, token_logprobs

PROMPTS = ["1+2=", "34+5=", "7=", "12+"]


class Echo(Environment):
    """A deterministic tool over the tiny tokenizer's characters: a turn ending at ``7``, ``;`` or ``+``
    (what the random tiny models write most; greedy, they repeat the prompt's last character) is answered ``=<n>+`` (n: the turns so far) until
    ``limit`` answers; EOS ends the episode."""

    stop = ("7", ";", "+")

    def __init__(self, limit: int = 3, always: bool = False):
        self.limit, self.always = limit, always

    def step(self, view: EpisodeView) -> Reply:
        if self.always:  # endless tool calls: answers whatever the turn did
            return Reply(f"={view.turn}+")
        if view.eos or view.turn > self.limit:
            return Reply.end(reward=1.0)
        return Reply(f"={view.turn}+")


def _engine(pair, decoder, env, *, max_turns=4, max_new=6, budget=None, log=None, model=None):
    ro = small_config(
        rollout={"max_new_tokens": max_new, "max_prompt_tokens": 8, "max_turns": max_turns, "max_episode_tokens": budget}
    ).rollout
    inner = ModuleRollout(model or pair.student, pair.tokenizer, ro, pair.vocab_size, decoder=decoder)
    return EpisodeRollout(inner, env, ro, log=log)


def _who(batch, tok):
    """Each row's episode as (text, writer) runs: 's' for the student, 'e' for the environment."""
    out = []
    for ids, rm, lm in zip(batch.response_ids.tolist(), batch.response_mask.tolist(), batch.loss_mask.tolist()):
        out.append([(tok.decode([i]), "s" if trained else "e") for i, r, trained in zip(ids, rm, lm) if r])
    return out


@pytest.mark.parametrize("greedy", [False, True])
def test_lean_and_hf_episode_engines_lay_out_the_same_episodes(tiny_pair, greedy):
    env = Echo(limit=3)
    seeds = [101 * i + 7 for i in range(len(PROMPTS) * 2)]
    lean = _engine(tiny_pair, lean_generate, env).generate(PROMPTS, seeds, n_samples=2, greedy=greedy)
    hf = _engine(tiny_pair, generate, env).generate(PROMPTS, seeds, n_samples=2, greedy=greedy)
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "loss_mask", "prompt_index"):
        assert torch.equal(getattr(lean, name), getattr(hf, name)), name
    if not greedy:
        torch.testing.assert_close(lean.sampling_logprobs, hf.sampling_logprobs, rtol=0, atol=1e-5)
    # the episodes went past one turn, and the environment's tokens are in the layout, untrained
    env_tokens = (lean.response_mask & ~lean.loss_mask).sum()
    assert env_tokens > 0 and lean.loss_mask.sum() > 0
    assert not (lean.loss_mask & ~lean.response_mask).any()
    for row in _who(lean, tiny_pair.tokenizer):
        text = "".join(c for c, _ in row)
        # every environment run is an answer "=<n>+" right after a student turn that ended at a stop
        runs, prev = [], None
        for c, w in row:
            if w != prev:
                runs.append(["", w])
                prev = w
            runs[-1][0] += c
        for i, (piece, w) in enumerate(runs):
            if w == "e":
                assert runs[i - 1][0][-1] in "7;+" and piece == f"={(i + 1) // 2}+", text


def test_engine_logprobs_are_the_trainers_on_the_students_tokens_and_zero_elsewhere(tiny_pair):
    model = tiny_pair.student.double()
    torch.manual_seed(0)
    batch = _engine(tiny_pair, lean_generate, Echo(limit=3), model=model).generate(PROMPTS, None, n_samples=3)
    with torch.no_grad():
        ours = token_logprobs(student_logits(model, batch, tiny_pair.vocab_size, SamplingSpec()), batch.response_ids)
    m = batch.loss_mask
    assert (batch.response_mask & ~m).any()
    torch.testing.assert_close(batch.sampling_logprobs[m], ours[m], rtol=0, atol=1e-9)
    assert torch.equal(batch.sampling_logprobs[~m], torch.zeros_like(batch.sampling_logprobs[~m]))


def test_a_runaway_episode_ends_at_its_budget_and_is_counted(tiny_pair):
    """Endless tool calls (the environment answers every turn, even after EOS): every episode stops
    at rollout.max_episode_tokens, never past it, and episode/budget_stops counts them."""
    env = Echo(always=True)
    log = EpisodeLog(env)
    engine = _engine(tiny_pair, lean_generate, env, max_turns=64, max_new=5, budget=30, log=log)
    batch = engine.generate(PROMPTS, [3, 4, 5, 6])
    lengths = batch.response_mask.sum(-1)
    assert int(lengths.max()) <= 30
    ends = [e.end for e in engine.last_episodes]
    assert set(ends) <= {"budget", "turns"} and ends.count("budget") >= 1
    stats = log.metrics()
    assert stats["episode/budget_stops"] == ends.count("budget")
    assert stats["episode/turn_limit_stops"] == ends.count("turns")
    # the turn limit ends the rest: 2 turns, then the environment's next answer is not appended
    few = _engine(tiny_pair, lean_generate, env, max_turns=2, max_new=3, budget=100, log=log)
    few.generate(PROMPTS, [3, 4, 5, 6])
    assert all(len(e.turns) <= 2 for e in few.last_episodes)
    assert log.metrics()["episode/turn_limit_stops"] == sum(e.end == "turns" for e in few.last_episodes) > 0


def test_one_turn_without_stops_is_the_plain_engine(tiny_pair):
    """An environment that ends every episode at once and stops nothing: the plain rollout's tokens."""

    class Silent(Environment):
        def step(self, view):
            return Reply.end()

    seeds = [5, 6, 7, 8]
    ours = _engine(tiny_pair, lean_generate, Silent(), max_turns=1).generate(PROMPTS, seeds)
    ro = small_config(rollout={"max_new_tokens": 6, "max_prompt_tokens": 8}).rollout
    plain = ModuleRollout(tiny_pair.student, tiny_pair.tokenizer, ro, tiny_pair.vocab_size, decoder=lean_generate).generate(PROMPTS, seeds)
    R = ours.response_ids.shape[1]
    assert torch.equal(ours.response_mask, plain.response_mask[:, :R]) and not plain.response_mask[:, R:].any()
    assert torch.equal(ours.input_ids[:, : ours.prompt_len], plain.input_ids[:, : plain.prompt_len])
    kept = ours.response_mask
    assert torch.equal(ours.response_ids[kept], plain.response_ids[:, :R][kept])
    assert torch.equal(ours.loss_mask, ours.response_mask)


@pytest.mark.parametrize(
    "call,want",
    [("17*23", "391"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-5*-5", "25"), (" 12 - 30 ", "-18"), ("007*2", "14")],
)
def test_the_calculator_evaluates_plus_minus_times_and_parentheses(call, want):
    assert answer_call(call) == f"<result>{want}</result>"


@pytest.mark.parametrize(
    "call", ["", "2+", "2**3", "__import__('os')", "1/2", "(1+2", "1+2)", "9" * 65, "(" * 20 + "1" + ")" * 20, "99999999*99999999", "1e3"]
)
def test_a_malformed_call_gets_the_error_text_never_a_crash(call):
    assert answer_call(call) == ERROR
    with pytest.raises(ParseError):
        calculate(call)


def test_the_calculator_environment_answers_calls_and_ends_at_eos():
    env = CalcEnvironment()
    view = lambda text, eos=False, last=None: EpisodeView("17*23=?\n", text, 1, eos, last if last is not None else text)
    assert env.step(view("<calc>17*23</calc>")).text == "<result>391</result>"
    assert env.step(view("x</calc>")).text == ERROR  # a stop without an opening tag
    assert env.step(view("<calc>17*23</calc><result>391</result>#### 391", eos=True)).done
    from opd_exp.tasks.environment import Episode

    eps = [
        Episode("p", ["<calc>17*23</calc>", "#### 391"], ["<result>391</result>"], "eos"),
        Episode("p", ["<calc>1+</calc>", "#### 5"], [ERROR], "eos"),
        Episode("p", ["<calc>2*3</calc>", "#### 7"], ["<result>6</result>"], "eos"),
        Episode("p", ["#### 12"], [], "eos"),
        Episode("p", ["<result>99</result>#### 99"], [], "eos"),  # the student writes the tool's text itself
        Episode("p", ["<calc>2*3</calc>", "<result>6</result>#### 6"], ["<result>6</result>"], "eos"),  # and after a call
    ]
    got = env.metrics(eps)
    want = {"tools/calls_mean": 4 / 6, "tools/valid_rate": 3 / 4, "tools/result_used_rate": 2 / 3, "tools/self_result_rate": 2 / 6}
    assert got == pytest.approx(want, rel=1e-12) and set(got) == set(want)


class Counting(Echo):
    """Echo with metrics: its answers per episode, and the share of episodes longer than one turn."""

    def metrics(self, episodes):
        n = len(episodes)
        return {
            "tools/calls_mean": sum(len(e.replies) for e in episodes) / n,
            "tools/valid_rate": sum(len(e.turns) > 1 for e in episodes) / n,
        }


def test_eval_logs_the_environments_metrics_over_every_greedy_episode(tiny_pair):
    """eval/tools/*: the environment's metrics over the eval set's greedy episodes, all batches together
    (equal to its metrics on the same episodes sampled in one call)."""
    from opd_exp.tasks.base import Problem
    from opd_exp.training.evaluate import Evaluator

    env, task = Counting(limit=3), AddTask()
    # prompts ending at a stop (greedy, the tiny models repeat the last character) and at none
    task._eval = [Problem(p, "3", "3") for p in ("1+", "23+", "7", "4+7", "9+", "5=", "6+", "8=", "77", "2+")]
    engine = _engine(tiny_pair, lean_generate, env)
    ev = Evaluator(
        task, tiny_pair.tokenizer, task.eval_problems(), batch_size=4, divergences={}, teacher=None,
        student_logits=lambda b: student_logits(tiny_pair.student, b, tiny_pair.vocab_size, SamplingSpec()),
    )  # fmt: skip
    out = ev(engine, "cpu")
    engine.generate([p.prompt for p in task.eval_problems()], greedy=True)
    want = env.metrics(engine.last_episodes)
    assert len(engine.last_episodes) == 10 and want["tools/calls_mean"] > 0 and 0 < want["tools/valid_rate"] < 1
    assert {k: out[f"eval/{k}"] for k in want} == pytest.approx(want, rel=1e-12)
    # a one-turn engine has no episodes: nothing under eval/tools/
    assert not [k for k in ev(engine.inner, "cpu") if k.startswith("eval/tools/")]


def test_the_embedded_tokenizer_spells_the_tool_tags_one_token_per_character():
    from opd_exp.pairs.embedded.tokenizer import BYTE_OFFSET, build_tokenizer

    tok = build_tokenizer()
    for tag in ("<calc>", "</calc>", "<result>", "</result>"):
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert ids == [BYTE_OFFSET + ord(c) for c in tag] and tok.decode(ids) == tag


# -- through the trainer ------------------------------------------------------------------------------
class EchoTask(AddTask):
    name = "tiny_echo"


@pytest.fixture
def echo_task():
    from opd_exp.tasks import register_task

    register_task("tiny_echo", lambda cfg: EchoTask(), replace=True)
    register_environment("tiny_echo", lambda cfg: Echo(limit=2), replace=True)
    return EchoTask()


def test_a_run_on_a_task_with_an_environment_logs_episode_metrics(tiny_pair, tmp_path, echo_task):
    import dataclasses
    import json

    from opd_exp.metric_names import declared
    from opd_exp.training.trainer import Trainer

    cfg = small_config(
        trainer={"max_steps": 2},
        eval={"every": 1},
        rollout={"max_new_tokens": 4, "max_prompt_tokens": 8, "max_turns": 3, "engine": "lean"},
    )
    cfg = dataclasses.replace(cfg, task=TaskConfig(name="tiny_echo"))
    tr = Trainer(cfg, tmp_path, pair=tiny_pair, task=echo_task)
    tr.run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "episode/turns_mean" in r]
    assert len(steps) == 2 and all(not [k for k in r if k != "step" and not declared(k)] for r in rows)
    assert max(r["episode/turns_mean"] for r in steps) > 1 and max(r["episode/env_tokens_mean"] for r in steps) > 0
    # the step's trained tokens are the student's only (response/length_mean counts trained tokens per row)
    assert all(r["response/length_mean"] == pytest.approx(r["episode/student_tokens_mean"]) for r in steps)


@pytest.mark.parametrize("env_tokens", ["masked", "trained"])
def test_env_tokens_trained_trains_the_environments_tokens_too(tiny_pair, tmp_path, echo_task, env_tokens):
    """rollout.env_tokens=trained (the ablation): every step trains on the student's tokens and the
    environment's (response/length_mean counts trained tokens per row); masked: the student's only."""
    import dataclasses
    import json

    from opd_exp.training.trainer import Trainer

    ro = {"max_new_tokens": 4, "max_prompt_tokens": 8, "max_turns": 3, "engine": "lean", "env_tokens": env_tokens}
    cfg = dataclasses.replace(small_config(trainer={"max_steps": 2}, rollout=ro), task=TaskConfig(name="tiny_echo"))
    Trainer(cfg, tmp_path, pair=tiny_pair, task=echo_task).run()
    steps = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(steps) == 2 and sum(r["episode/env_tokens_mean"] for r in steps) > 0
    for r in steps:
        env = r["episode/env_tokens_mean"] if env_tokens == "trained" else 0.0
        assert r["response/length_mean"] == pytest.approx(r["episode/student_tokens_mean"] + env, rel=1e-9)


def test_env_tokens_trained_needs_an_environment(tiny_pair, tmp_path):
    from opd_exp.runtime.errors import ConfigError
    from opd_exp.training.trainer import Trainer

    cfg = small_config(rollout={"env_tokens": "trained"})
    with pytest.raises(ConfigError) as ex:
        Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    assert str(ex.value) == (
        "rollout.env_tokens='trained' is not allowed; allowed: masked with task=arithmetic (no environment: no environment tokens)"
    )


def _echo_run(tiny_dir, run_dir, stop_after=None):
    import dataclasses
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd_exp.training.trainer import Trainer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    pair = SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(tiny_dir / "student"),
        teacher=AutoModelForCausalLM.from_pretrained(tiny_dir / "teacher"),
        tokenizer=tok,
        vocab_size=len(tok),
    )
    cfg = small_config(
        trainer={"max_steps": 4},
        checkpoint={"every": 2},
        estimator={"name": "sampled", "baseline": "none"},
        loss={"name": "reinforce", "credit": "sequence"},
        divergence={"name": "rkl"},
        rollout={"max_new_tokens": 4, "max_prompt_tokens": 8, "max_turns": 3},
    )
    Trainer(dataclasses.replace(cfg, task=TaskConfig(name="tiny_echo")), run_dir, pair=pair, task=EchoTask()).run(stop_after=stop_after)
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_resumed_episode_run_equals_the_straight_one(tiny_dir, tmp_path, echo_task):
    straight = _echo_run(tiny_dir, tmp_path / "a")
    _echo_run(tiny_dir, tmp_path / "b", stop_after=3)  # checkpoint at step 2, step 3 done again after the resume
    resumed = _echo_run(tiny_dir, tmp_path / "b")
    key = lambda rows: {r["step"]: {k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows}
    assert key(straight) == key(resumed) and max(r.get("episode/env_tokens_mean", 0) for r in straight) > 0
