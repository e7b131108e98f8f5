"""rollout.engine=vllm (opd_exp/training/rollout_vllm.py) without vLLM: the start-up failure, and the
engine logic against a fake with vLLM's interface (``LLM.generate`` with per-request
``SamplingParams``, ``Logprob`` entries, ``collective_rpc("reload_weights", ...)``,
``reset_prefix_cache``) that samples from a copy of the tiny student. The fake reports
processed or raw log-probs like vLLM's ``logprobs_mode``; nothing here runs vLLM itself (the
real engine: tests/test_vllm_real.py)."""

from __future__ import annotations

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from helpers.tiny import AddTask, small_config
from opd_exp.config import schema as S
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.monitors import logprob_gap
from opd_exp.training.rollout import sampling_logits
from opd_exp.training.rollout_vllm import NEUTRAL_SAMPLING, PROCESSED, VllmRollout, require_vllm
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import student_logits, token_logprobs


def logprob_gap_sum(engine_lp, trainer_lp, mask):
    return logprob_gap(engine_lp, trainer_lp, mask)[0]


HAS_VLLM = importlib.util.find_spec("vllm") is not None


class FakeSamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeLLM:
    """Samples each request token by token from softmax(sampling_logits) with a generator
    seeded by the request's seed; reports raw (vLLM's default) or processed log-probs."""

    def __init__(self, hf_model, logprobs_mode: str | None = None, **kwargs):
        self.model = hf_model.eval()
        self.mode = logprobs_mode or "raw_logprobs"
        self.kwargs, self.loads, self.resets = kwargs, [], 0
        self.has_reload = True  # False: a vLLM whose workers predate reload_weights

    @torch.no_grad()
    def generate(self, requests, params, use_tqdm=False):
        outs = []
        for req, sp in zip(requests, params):
            g = torch.Generator().manual_seed(sp.seed)
            ids, toks, lps = list(req["prompt_token_ids"]), [], []
            for _ in range(sp.max_tokens):
                z = self.model(input_ids=torch.tensor([ids + toks])).logits[0, -1].float()
                zp = sampling_logits(z[None], sp.temperature, max(sp.top_k, 0), sp.top_p)[0]
                tok = int(torch.multinomial(zp.softmax(-1), 1, generator=g))
                lp = (zp if self.mode == PROCESSED else z).log_softmax(-1)[tok]
                toks.append(tok)
                lps.append({tok: SimpleNamespace(logprob=float(lp), rank=1)})
                if tok in sp.stop_token_ids:
                    break
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks, logprobs=lps)]))
        return outs

    def load_weights(self, weights):
        weights = list(weights)
        self.loads.append([n for n, _ in weights])
        self.model.load_state_dict(dict(weights), strict=False)

    def collective_rpc(self, method, args=(), kwargs=None):
        """The worker's ``reload_weights`` by name (vLLM >= 0.12), or a function run on a worker."""
        if isinstance(method, str):
            if method != "reload_weights" or not self.has_reload:
                raise AttributeError(f"'Worker' object has no attribute {method!r}")
            kw = dict(kwargs or {})
            assert kw.pop("is_checkpoint_format") is True
            return [self.load_weights(kw.pop("weights_iterator"))]
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(load_weights=self.load_weights)))
        return [method(worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.resets += 1


def _engine(pair, mode, temperature=0.7, top_k=5, processed=None):
    from opd_exp.training.rollout import eos_token_ids

    llm = FakeLLM(copy.deepcopy(pair.student), logprobs_mode=mode)
    return VllmRollout(
        llm,
        pair.tokenizer,
        vocab_size=pair.vocab_size,
        eos_ids=eos_token_ids(pair.tokenizer),
        max_new_tokens=6,
        max_prompt_tokens=8,
        sampling=SamplingSpec(temperature, top_k),
        processed=(mode == PROCESSED) if processed is None else processed,
        sampling_params=FakeSamplingParams,
    )


def _trainer_logprobs(pair, batch, temperature=0.7, top_k=5):
    z = student_logits(pair.student, batch, pair.vocab_size, SamplingSpec(temperature, top_k))
    return token_logprobs(z, batch.response_ids)


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_require_vllm_is_one_line():
    with pytest.raises(ConfigError) as ex:
        require_vllm()
    msg = str(ex.value)
    assert "\n" not in msg and "rollout.engine='vllm' needs the vllm package" in msg and "rollout.engine=hf" in msg


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_engine_vllm_fails_before_any_model_loads(tmp_path, add_task):
    from opd_exp.training.trainer import Trainer

    class Boom:
        def __getattr__(self, name):
            raise AssertionError("a model was touched before the vllm check")

    cfg = small_config(rollout=dict(engine=S.RolloutEngine.vllm))
    with pytest.raises(ConfigError, match="needs the vllm package"):
        Trainer(cfg, tmp_path / "run", pair=Boom(), task=add_task)


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_cli_engine_vllm_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    from helpers.reliability import BASE, one_error_line, run_in_process

    code, _, err = run_in_process(
        BASE + ["rollout.engine=vllm", "model_pair=local", "model_pair.student=/nonexistent/s", "model_pair.teacher=/nonexistent/t"],
        tmp_path / "run",
        monkeypatch,
        capsys,
    )
    assert code == 2
    assert "needs the vllm package" in one_error_line(err)  # not the missing folders: no model was looked at


def test_batch_layout_matches_the_hf_rollout(tiny_pair):
    eng = _engine(tiny_pair, PROCESSED)
    prompts = ["1+2=", "33+4=", "5+6="]
    batch = eng.generate(prompts, [11, 12, 13])
    from opd_exp.training.rollout import encode_prompts

    ids, mask = encode_prompts(tiny_pair.tokenizer, prompts, 8)
    P = ids.shape[1]
    assert batch.prompt_len == P and torch.equal(batch.input_ids[:, :P], ids) and torch.equal(batch.attention_mask[:, :P], mask)
    eos = tiny_pair.tokenizer.eos_token_id
    for row, m in zip(batch.response_ids, batch.response_mask):
        n = int(m.sum())
        assert bool(m[:n].all()) and not bool(m[n:].any())  # positional: a prefix
        assert eos not in row[: n - 1].tolist()  # the first EOS, if any, is the last counted token
    # the same seeds give the same responses; others differ
    again = eng.generate(prompts, [11, 12, 13])
    assert torch.equal(again.input_ids, batch.input_ids)


def test_processed_logprobs_are_those_of_the_sampled_distribution(tiny_pair):
    """With logprobs_mode=processed_logprobs the engine's log-probs equal the trainer's under
    its own sampling transform (T=0.7, top-k=5) on the sampled tokens; raw ones do not."""
    prompts = ["1+2=", "33+4=", "5+6=", "7+7="]
    eng = _engine(tiny_pair, PROCESSED)
    batch = eng.generate(prompts, [1, 2, 3, 4])
    mine = _trainer_logprobs(tiny_pair, batch)
    n = batch.num_response_tokens
    assert n > 0
    assert logprob_gap_sum(batch.sampling_logprobs, mine, batch.response_mask) / n < 1e-5
    raw = _engine(tiny_pair, "raw_logprobs", processed=True)  # as if one trusted vLLM's default
    rb = raw.generate(prompts, [1, 2, 3, 4])
    gap = logprob_gap_sum(rb.sampling_logprobs, _trainer_logprobs(tiny_pair, rb), rb.response_mask) / rb.num_response_tokens
    assert gap > 0.05, gap


def test_an_engine_without_logprobs_mode_records_none(tiny_pair):
    batch = _engine(tiny_pair, None).generate(["1+2="], [5])
    assert batch.sampling_logprobs is None  # raw numbers are never compared with ours


def test_make_llm_asks_for_processed_logprobs(monkeypatch):
    import sys

    seen = {}

    class NewLLM:
        def __init__(self, **kw):
            seen.update(kw)

    class OldLLM:
        def __init__(self, model, **kw):
            if "logprobs_mode" in kw:
                raise TypeError("__init__() got an unexpected keyword argument 'logprobs_mode'")

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=NewLLM))
    _, processed = VllmRollout.make_llm(model="m")
    assert processed and seen["logprobs_mode"] == "processed_logprobs"
    # the checkpoint's generation_config.json is not vLLM's default sampling settings
    assert seen["generation_config"] == "vllm"
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=OldLLM))
    _, processed = VllmRollout.make_llm(model="m")
    assert not processed

    class MidLLM:  # logprobs_mode but no generation_config argument
        def __init__(self, model, **kw):
            if "generation_config" in kw:
                raise TypeError("__init__() got an unexpected keyword argument 'generation_config'")
            seen.clear()
            seen.update(kw)

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=MidLLM))
    _, processed = VllmRollout.make_llm(model="m")
    assert processed and seen == {"logprobs_mode": "processed_logprobs"}


def test_every_request_spells_out_neutral_sampling_settings(tiny_pair):
    """No penalty, min_p, bias or banned words can come from the engine's defaults: each
    request names the neutral value; greedy is temperature 0."""
    eng = _engine(tiny_pair, PROCESSED)
    for greedy in (False, True):
        sp = eng._params(3, greedy=greedy)
        for key, value in NEUTRAL_SAMPLING.items():
            assert getattr(sp, key) == value, key
        assert sp.temperature == (0.0 if greedy else 0.7)


def test_sync_weights_pushes_the_student_once_per_version(tiny_pair):
    eng = _engine(tiny_pair, PROCESSED)
    with torch.no_grad():
        for p in tiny_pair.student.parameters():
            p.add_(0.01)
    assert eng.sync_weights(tiny_pair.student, version=1)
    assert not eng.sync_weights(tiny_pair.student, version=1)  # unchanged: no second push
    assert len(eng.llm.loads) == 1 and eng.llm.resets == 1
    assert set(eng.llm.loads[0]) == set(tiny_pair.student.state_dict())
    for (n, a), b in zip(tiny_pair.student.state_dict().items(), eng.llm.model.state_dict().values()):
        assert torch.equal(a, b), n


def test_sync_weights_falls_back_to_load_weights_on_an_older_vllm(tiny_pair):
    eng = _engine(tiny_pair, PROCESSED)
    eng.llm.has_reload = False
    with torch.no_grad():
        for p in tiny_pair.student.parameters():
            p.add_(0.01)
    assert eng.sync_weights(tiny_pair.student, version=1)
    assert len(eng.llm.loads) == 1 and eng.llm.resets == 1
    for (n, a), b in zip(tiny_pair.student.state_dict().items(), eng.llm.model.state_dict().values()):
        assert torch.equal(a, b), n


def test_make_llm_builds_the_engine_in_process_and_keeps_set_num_threads(monkeypatch):
    """The engine core is built in this process (the sync hands tensors by reference); vLLM's CPU
    worker replaces torch.set_num_threads process-wide, and make_llm gives it back."""
    import os
    import sys

    seen = {}
    original = torch.set_num_threads

    class LLM:
        def __init__(self, **kw):
            seen["mp"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
            torch.set_num_threads = lambda n: None  # what vLLM's CPUWorker.init_device does

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM))
    try:
        VllmRollout.make_llm(model="m")
    finally:
        changed, torch.set_num_threads = torch.set_num_threads is not original, original
    assert seen["mp"] == "0" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and not changed


def test_trainer_with_the_fake_engine_syncs_every_step(tiny_pair, add_task, tmp_path, monkeypatch):
    """rollout.engine=vllm through the Trainer: the engine gets the weights of every update, and
    the logged engine/trainer gap is float-level (the engine samples the current student)."""
    import opd_exp.training.rollout_vllm as RV
    from opd_exp.training.trainer import Trainer

    monkeypatch.setattr(RV, "require_vllm", lambda: None)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    engine_model = copy.deepcopy(tiny_pair.student)
    monkeypatch.setattr(VllmRollout, "make_llm", staticmethod(lambda **kw: (FakeLLM(engine_model, logprobs_mode=PROCESSED, **kw), True)))
    monkeypatch.setattr(VllmRollout, "sampling_params_class", staticmethod(lambda: FakeSamplingParams))
    tiny_pair.student.name_or_path = "tiny-student"
    cfg = small_config(
        divergence=dict(name="rkl"),
        rollout=dict(engine=S.RolloutEngine.vllm, temperature=0.8, top_k=6),
        estimator=dict(name="sampled"),
        loss=dict(name="reinforce"),
        trainer=dict(max_steps=3, batch_size=2),
    )
    t = Trainer(cfg, tmp_path / "run", pair=tiny_pair, task=add_task)
    out = [t.train_step() for _ in range(3)]
    assert t.engines.student.version == 2 and len(t.engines.student.llm.loads) == 3  # before steps 1, 2, 3
    kw = t.engines.student.llm.kwargs
    assert kw["model"] == "tiny-student" and kw["dtype"] == "float32"  # the student's dtype, not vLLM's "auto" (half)
    assert kw["skip_tokenizer_init"] and kw["enforce_eager"]  # token ids in and out; on CPU no compile
    for m in out:
        assert m["rollout/logprob_gap"] < 1e-4 and m["rollout/logprob_gap_max"] < 1e-3
    # negative control: an engine left on stale weights shows up in the gap
    monkeypatch.setattr(VllmRollout, "sync_weights", lambda self, student, version: False)
    stale = [t.train_step() for _ in range(2)]
    assert stale[-1]["rollout/logprob_gap"] > 1e-3, stale[-1]["rollout/logprob_gap"]


def test_only_the_known_vllm_warnings_are_dropped(caplog):
    """The rotary table's reload line and the tokenizer-less chat warm-up are dropped; any
    other warning from the same loggers (a layer that really failed to load) comes through."""
    import logging

    from opd_exp.training.rollout_vllm import _quiet

    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    with caplog.at_level(logging.WARNING), _quiet(reload_log.name, "vllm.renderers.base"):
        reload_log.warning("%s: Failed to load weights", "RotaryEmbedding")
        reload_log.warning("%s: Failed to load weights", "QKVParallelLinear")
        logging.getLogger("vllm.renderers.base").warning("Chat template warmup failed", exc_info=False)
    reload_log.warning("%s: Failed to load weights", "RotaryEmbedding")  # outside: not filtered
    assert [r.getMessage() for r in caplog.records] == [
        "QKVParallelLinear: Failed to load weights",
        "RotaryEmbedding: Failed to load weights",
    ]


# -- episodes (a task with an environment) on the vLLM engine -----------------------------------------
def test_sample_turns_gives_each_row_its_cap_and_the_single_token_stops(tiny_pair):
    """One request per episode on its tokens so far; each row's own cap; a one-token stop string ends
    the request in vLLM (kept, as EOS is), a longer one cannot (the episode cuts it)."""
    eng = _engine(tiny_pair, PROCESSED)
    seen = []
    real = eng.llm.generate
    eng.llm.generate = lambda requests, params, use_tqdm=False: seen.append((requests, params)) or real(requests, params)
    tok = tiny_pair.tokenizer
    contexts = [tok("1+2=", add_special_tokens=False)["input_ids"], tok("34+5=3;=1+", add_special_tokens=False)["input_ids"]]
    stop_ids = [tok(s, add_special_tokens=False)["input_ids"] for s in (";", "12")]
    out = eng.sample_turns(contexts, [5, 2], [7, 8], greedy=False, stop_ids=stop_ids)
    (requests, params) = seen[-1]
    assert [r["prompt_token_ids"] for r in requests] == contexts
    assert [p.max_tokens for p in params] == [5, 2] and [p.seed for p in params] == [7, 8]
    assert all(p.stop_token_ids == [*eng.eos_ids, stop_ids[0][0]] for p in params)  # ";" only: "12" is two tokens
    assert [len(t) <= c for t, c in zip(out.tokens, [5, 2])] == [True, True]
    assert [len(lp) for lp in out.logprobs] == [len(t) for t in out.tokens] and all(v < 0 for lp in out.logprobs for v in lp)
    for row in out.tokens:  # a row ends at the first EOS or ";" if it has one
        ends = [k for k, t in enumerate(row) if t in params[0].stop_token_ids]
        assert not ends or ends[0] == len(row) - 1
    eng.processed = False  # raw log-probs are never compared with ours
    assert eng.sample_turns(contexts, [3, 3], None, greedy=False, stop_ids=stop_ids).logprobs is None


def test_episodes_run_on_the_vllm_engine_through_the_trainer(tiny_pair, tmp_path, monkeypatch):
    """A task with an environment on rollout.engine=vllm: the environment's tokens are in the layout
    with loss_mask 0 and no engine log-prob; the student's tokens carry the engine's log-probs, equal
    to the trainer's (the gap is float-level every step); the episode metrics are logged."""
    import dataclasses

    import opd_exp.training.rollout_vllm as RV
    from opd_exp.config.world import TaskConfig
    from opd_exp.tasks import register_task
    from opd_exp.tasks.environment import Environment, Reply, register_environment
    from opd_exp.training.episodes import EpisodeRollout
    from opd_exp.training.trainer import Trainer

    class Echo(Environment):
        stop = ("7", ";", "+")

        def step(self, view):
            return Reply.end() if view.eos else Reply(f"={view.turn}+")

    class EchoTask(AddTask):
        name = "tiny_echo_vllm_fake"

    register_task(EchoTask.name, lambda cfg: EchoTask(), replace=True)
    register_environment(EchoTask.name, lambda cfg: Echo(), replace=True)
    monkeypatch.setattr(RV, "require_vllm", lambda: None)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    engine_model = copy.deepcopy(tiny_pair.student)
    monkeypatch.setattr(VllmRollout, "make_llm", staticmethod(lambda **kw: (FakeLLM(engine_model, logprobs_mode=PROCESSED, **kw), True)))
    monkeypatch.setattr(VllmRollout, "sampling_params_class", staticmethod(lambda: FakeSamplingParams))
    tiny_pair.student.name_or_path = "tiny-student"
    cfg = small_config(
        divergence=dict(name="rkl"),
        rollout=dict(engine=S.RolloutEngine.vllm, max_new_tokens=4, max_turns=3, max_episode_tokens=10),
        estimator=dict(name="sampled"),
        loss=dict(name="reinforce"),
        trainer=dict(max_steps=3, batch_size=4),
    )
    t = Trainer(dataclasses.replace(cfg, task=TaskConfig(name=EchoTask.name)), tmp_path / "run", pair=tiny_pair, task=EchoTask())
    assert isinstance(t.engines.student, EpisodeRollout) and isinstance(t.engines.student.inner, VllmRollout)
    assert t.engines.student.inner.llm.kwargs["max_model_len"] == 8 + 10  # the prompt and the episode's budget
    batches, sample = [], t.sample
    t.sample = lambda step: batches.append(sample(step)) or batches[-1]
    out = [t.train_step() for _ in range(3)]
    env_tokens = sum(int((b.response_mask & ~b.loss_mask).sum()) for b in batches)
    assert env_tokens > 0 and max(m["episode/turns_mean"] for m in out) > 1
    for b, m in zip(batches, out):
        assert torch.all(b.sampling_logprobs[b.response_mask & ~b.loss_mask] == 0)
        assert torch.all(b.sampling_logprobs[b.loss_mask] < 0)
        assert m["rollout/logprob_gap"] < 1e-4 and m["response/length_mean"] == pytest.approx(m["episode/student_tokens_mean"])
        assert int(b.response_mask.sum(1).max()) <= 10
    assert t.engines.student.inner.version == 2 and len(t.engines.student.inner.llm.loads) == 3


def test_a_student_whose_head_size_vllms_cpu_attention_cannot_run_is_one_line(tiny_pair, monkeypatch):
    """The tiny student (head_dim 16) against the head sizes vLLM 0.32's CPU attention lists: refused
    before vLLM starts; one of them (a stand-in list holding 16) passes."""
    import sys

    from opd_exp.training.rollout_vllm import check_cpu_attention

    backend = SimpleNamespace(get_supported_head_sizes=lambda: [32, 64, 128])
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn", SimpleNamespace(CPUAttentionBackend=backend))
    with pytest.raises(ConfigError) as ex:
        check_cpu_attention(tiny_pair.student)
    assert str(ex.value).count("\n") == 0 and "head_dim=16" in str(ex.value) and "[32, 64, 128]" in str(ex.value)
    backend.get_supported_head_sizes = lambda: [16, 32]
    check_cpu_attention(tiny_pair.student)


# -- rollout.staleness > 0 on the vLLM engine: vLLM is the producer ----------------------------------
@pytest.mark.parametrize("k", [1, 2])
def test_a_stale_run_on_the_vllm_engine_samples_each_rollout_with_the_weights_k_updates_old(tiny_pair, add_task, tmp_path, monkeypatch, k):
    """The engine, driven by a thread of the learner's process (no producer process), samples the rollout
    of step m with the weights after max(0, m - k) updates: its log-probs (kept as the behaviour
    policy's) equal those of that snapshot of the student and not the current one; the importance
    weights the objective reads are S_now / B of those numbers (``async/is_weight_max``)."""
    import threading

    import opd_exp.training.rollout_vllm as RV
    from opd_exp.training.trainer import Trainer

    monkeypatch.setattr(RV, "require_vllm", lambda: None)
    engine_model = copy.deepcopy(tiny_pair.student)
    monkeypatch.setattr(VllmRollout, "make_llm", staticmethod(lambda **kw: (FakeLLM(engine_model, logprobs_mode=PROCESSED, **kw), True)))
    monkeypatch.setattr(VllmRollout, "sampling_params_class", staticmethod(lambda: FakeSamplingParams))
    tiny_pair.student.name_or_path = "tiny-student"
    cfg = small_config(
        divergence=dict(name="rkl"),
        rollout=dict(engine=S.RolloutEngine.vllm, staleness=k, correction="recompute", is_cap=None),
        estimator=dict(name="sampled"),
        loss=dict(name="reinforce"),
        trainer=dict(max_steps=4, batch_size=2, lr=0.05),
    )
    t = Trainer(cfg, tmp_path / "run", pair=tiny_pair, task=add_task)
    snapshots, batches, sample = [], [], t.sample

    def recorded(step):  # the student after `step` updates, then the rollout it trains on
        snapshots.append(copy.deepcopy(t.student))
        batches.append(sample(step))
        return batches[-1]

    t.sample = recorded
    out = [t.train_step() for _ in range(4)]
    assert isinstance(t.rollouts.proc, threading.Thread) and t.rollouts.engine is t.engines.student  # no producer process
    t.rollouts.close()
    assert [m["async/staleness"] for m in out] == [min(s, k) for s in range(4)]
    with torch.no_grad():
        for m, (b, metrics) in enumerate(zip(batches, out)):
            mask = b.response_mask
            assert torch.equal(b.behaviour_logprobs, b.sampling_logprobs)
            behaviour = _trainer_logprobs(
                SimpleNamespace(student=snapshots[max(0, m - k)], vocab_size=tiny_pair.vocab_size), b, temperature=1.0, top_k=0
            )
            now = _trainer_logprobs(SimpleNamespace(student=snapshots[m], vocab_size=tiny_pair.vocab_size), b, temperature=1.0, top_k=0)
            assert (b.behaviour_logprobs - behaviour).abs()[mask].max() < 1e-5, m
            log_w = torch.cumsum(torch.where(mask, now.double() - b.behaviour_logprobs.double(), 0.0), -1)
            assert metrics["async/is_weight_max"] == pytest.approx(float(log_w[mask].max().exp()), rel=1e-4), m
            if m >= k:  # sampled by an older student: the weights are not 1
                assert (now - behaviour).abs()[mask].max() > 1e-3 and abs(metrics["async/is_weight_max"] - 1.0) > 1e-3, m
    assert not any(th.name == "opd-rollout-producer" for th in threading.enumerate())  # closed: the thread ended


@pytest.mark.slow  # three runs of six steps
def test_a_resumed_stale_run_on_the_vllm_engine_equals_the_straight_one(tiny_dir, tmp_path, monkeypatch):
    """k = 2: the checkpoint at step 2 holds the two rollouts vLLM sampled ahead (by weights it no longer
    has); the resumed run trains on them, then vLLM samples on from the checkpoint's weights: every
    logged number equals the straight run's."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import opd_exp.training.rollout_vllm as RV
    from opd_exp.runtime import checkpoint
    from opd_exp.training.trainer import Trainer

    monkeypatch.setattr(RV, "require_vllm", lambda: None)
    monkeypatch.setattr(VllmRollout, "sampling_params_class", staticmethod(lambda: FakeSamplingParams))

    def run(run_dir, stop_after=None):
        tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
        pair = SimpleNamespace(
            student=AutoModelForCausalLM.from_pretrained(tiny_dir / "student"),
            teacher=AutoModelForCausalLM.from_pretrained(tiny_dir / "teacher"),
            tokenizer=tok,
            vocab_size=len(tok),
        )
        engine_model = AutoModelForCausalLM.from_pretrained(tiny_dir / "student")  # what vLLM loads from the folder
        monkeypatch.setattr(
            VllmRollout, "make_llm", staticmethod(lambda **kw: (FakeLLM(engine_model, logprobs_mode=PROCESSED, **kw), True))
        )
        cfg = small_config(
            divergence={"name": "rkl"},
            estimator={"name": "sampled", "baseline": "none"},
            loss={"name": "reinforce"},
            trainer={"max_steps": 6, "lr": 0.05},
            checkpoint={"every": 2},
            rollout={"engine": "vllm", "staleness": 2, "correction": "recompute", "max_new_tokens": 4, "max_prompt_tokens": 8},
        )
        Trainer(cfg, run_dir, pair=pair, task=AddTask()).run(stop_after=stop_after)
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    straight = run(tmp_path / "a")
    run(tmp_path / "b", stop_after=3)
    assert (tmp_path / "b" / "checkpoints" / "step_000002" / checkpoint.PRODUCER_FILE).is_file()
    resumed = run(tmp_path / "b")
    key = lambda rows: {
        r["step"]: {k: v for k, v in r.items() if not k.startswith(("perf/", "async/learner_wait", "async/producer_wait"))} for r in rows
    }
    assert key(straight) == key(resumed)
    assert [r["async/staleness"] for r in straight if "async/staleness" in r] == [0, 1, 2, 2, 2, 2]


def test_an_engine_without_sample_turns_cannot_run_episodes_in_one_line():
    """The refusal is by capability: a plugin engine that only implements ``generate`` is one line
    naming what is allowed; the vLLM engine (it samples turns) is wrapped."""
    from opd_exp.tasks.environment import Environment
    from opd_exp.training.episodes import episode_engine
    from opd_exp.training.rollout import RolloutEngine

    class OneShot(RolloutEngine):
        def generate(self, prompts, seeds=None, *, n_samples=1, greedy=False):
            raise AssertionError("not called")

    with pytest.raises(ConfigError) as ex:
        episode_engine(OneShot(), Environment())
    assert "\n" not in str(ex.value) and "rollout.engine=OneShot" in str(ex.value) and str(ex.value).endswith("lean, hf, auto or vllm")


def test_the_vllm_engine_is_wrapped_for_episodes(tiny_pair):
    from opd_exp.tasks.environment import Environment
    from opd_exp.training.episodes import EpisodeRollout, episode_engine

    ro = small_config(rollout={"max_new_tokens": 4, "max_prompt_tokens": 8, "max_turns": 2}).rollout
    assert isinstance(episode_engine(_engine(tiny_pair, PROCESSED), Environment(), ro), EpisodeRollout)
