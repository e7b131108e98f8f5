"""The lean sampler (``rollout.engine=lean``): the same layout, tokens and distribution as HF
``generate``, and log-probs equal to the trainer's recomputation."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from helpers.tiny import AddTask, small_config
from opd_exp.config.schema import RolloutEngine
from opd_exp.training.rollout import ModuleRollout, generate, sampling_logits
from opd_exp.training.sampler import StaticDecoder, lean_generate
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import response_logits, student_logits, token_logprobs

PROMPTS = ["1+2=", "34+5=", "7=", "12+"]
SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8), (0.8, 6, 0.9)]


def _same_batch(a, b):
    for name in ("input_ids", "attention_mask", "position_ids", "response_mask", "prompt_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.prompt_len == b.prompt_len and a.source == b.source


@pytest.mark.parametrize("static", [True, False])
def test_greedy_equals_generate_greedy_exactly(tiny_pair, static):
    """The teacher has 8 padded embedding rows: neither path may pick them. ``static``: our
    decode step over a preallocated cache, or the model's own forward over its cache."""
    model, tok, V = tiny_pair.teacher, tiny_pair.tokenizer, tiny_pair.vocab_size
    assert StaticDecoder.covers(model)
    kw = dict(n_samples=2, max_new_tokens=12, do_sample=False, vocab_size=V)
    ours, ref = lean_generate(model, tok, PROMPTS, static=static, **kw), generate(model, tok, PROMPTS, **kw)
    _same_batch(ours, ref)
    assert ours.sampling_logprobs is None


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_row_seeded_draws_equal_generate_with_row_seeds(tiny_pair, temperature, top_k, top_p, static):
    """Same per-row generators and Gumbel noise as ``RowKeyedSampler``: the same tokens."""
    model, tok, V = tiny_pair.teacher, tiny_pair.tokenizer, tiny_pair.vocab_size
    seeds = [11 * i + 3 for i in range(len(PROMPTS) * 3)]
    kw = dict(n_samples=3, max_new_tokens=10, sampling=SamplingSpec(temperature, top_k, top_p), vocab_size=V, row_seeds=seeds)
    ours, ref = lean_generate(model, tok, PROMPTS, static=static, **kw), generate(model, tok, PROMPTS, **kw)
    _same_batch(ours, ref)
    assert int(ours.response_ids.max()) < V  # padded rows never sampled


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_engine_logprobs_equal_the_trainers_recomputation(tiny_pair, temperature, top_k, top_p):
    model, tok, V = tiny_pair.student.double(), tiny_pair.tokenizer, tiny_pair.vocab_size
    torch.manual_seed(0)
    batch = lean_generate(
        model, tok, PROMPTS, n_samples=4, max_new_tokens=8, sampling=SamplingSpec(temperature, top_k, top_p), vocab_size=V
    )
    with torch.no_grad():
        ours = token_logprobs(student_logits(model, batch, V, SamplingSpec(temperature, top_k, top_p)), batch.response_ids)
    m = batch.response_mask
    assert m.sum() > 20
    torch.testing.assert_close(batch.sampling_logprobs[m].double(), ours[m].double(), atol=1e-6, rtol=0)
    assert (ours[m] > -1e8).all()  # no filtered token was drawn


def _exact_joint(model, tok, prompt, V, transform):
    """Exact P(y0, y1) of the two first response tokens under ``transform`` of the logits."""
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        p0 = transform(model(input_ids=ids).logits[0, -1, :V]).softmax(-1).double()
        nxt = torch.cat([ids.repeat(V, 1), torch.arange(V)[:, None]], dim=1)
        p1 = transform(model(input_ids=nxt).logits[:, -1, :V]).softmax(-1).double()
    joint = p0[:, None] * p1  # [V, V]
    return joint / joint.sum()  # fp32 softmax: renormalise in fp64


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square of observed counts against exact probabilities, cells with expected
    count < 5 pooled into one."""
    n = counts.sum()
    exp = probs.flatten() * n
    obs = counts.flatten().double()
    big = exp >= 5
    assert obs[probs.flatten() == 0].sum() == 0, "a token with probability 0 was drawn"
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = e > 0
    o, e = o[keep], e[keep]
    return float(stats.chi2.sf(float(((o - e) ** 2 / e).sum()), df=len(o) - 1))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lean", "lean-seeded", "hf"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 5, 0.9)])
def test_both_engines_sample_the_exact_distribution(tiny_pair, engine, temperature, top_k, top_p):
    """Joint frequencies of the first two tokens over 6000 draws against the exact
    probabilities (chi-square, pooled small cells), and total variation below a bound."""
    model, tok, V = tiny_pair.teacher, tiny_pair.tokenizer, tiny_pair.vocab_size
    prompt, n = "3+4=", 6000
    torch.manual_seed(123)
    kw = dict(n_samples=n, max_new_tokens=2, sampling=SamplingSpec(temperature, top_k, top_p), vocab_size=V)
    if engine == "hf":
        batch = generate(model, tok, [prompt], **kw)
    else:
        seeds = list(range(n)) if engine == "lean-seeded" else None
        batch = lean_generate(model, tok, [prompt], row_seeds=seeds, **kw)
    y = batch.response_ids
    eos = tok.eos_token_id
    # after an EOS the second token is padding: count it as "EOS then anything" in one cell
    y1 = torch.where(y[:, 0] == eos, torch.zeros_like(y[:, 0]), y[:, 1])
    counts = torch.zeros(V, V)
    counts.index_put_((y[:, 0], y1), torch.ones(n), accumulate=True)
    probs = _exact_joint(model, tok, prompt, V, lambda z: sampling_logits(z, temperature, top_k, top_p))
    probs[eos] = 0
    probs[eos, 0] = _exact_joint(model, tok, prompt, V, lambda z: sampling_logits(z, temperature, top_k, top_p))[eos].sum()
    assert _chi2_pvalue(counts, probs) > 1e-4
    tv = 0.5 * float((counts.double() / n - probs).abs().sum())
    # expected TV of n exact draws is about 0.5 * sum sqrt(2 p (1-p) / (pi n)); allow 1.5x
    expected = 0.5 * float((2 * probs * (1 - probs) / (torch.pi * n)).sqrt().sum())
    assert tv < 1.5 * expected, (tv, expected)


def test_trainer_runs_with_the_lean_engine_and_reports_the_gap(tiny_pair, tmp_path):
    from opd_exp.training.trainer import Trainer

    cfg = small_config(rollout=dict(max_new_tokens=4, max_prompt_tokens=8, engine=RolloutEngine.lean), trainer=dict(max_steps=2))
    tr = Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask())
    assert isinstance(tr.engines.student, ModuleRollout) and tr.engines.student.decoder is lean_generate
    metrics = tr.train_step()
    assert 0.0 <= metrics["rollout/logprob_gap"] < 1e-5
    assert metrics["response/length_mean"] > 0


def test_lean_engine_with_fsdp_is_refused_before_any_model_loads():
    from opd_exp.config.schema import Parallel, validate
    from opd_exp.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout.engine='lean' is not allowed; allowed: hf or vllm with scale.parallel=fsdp"):
        validate(small_config(rollout=dict(engine=RolloutEngine.lean), trainer=dict(parallel=Parallel.fsdp)))


def test_static_decoder_is_not_used_where_it_does_not_cover(tiny_pair):
    model = tiny_pair.student
    model.config.use_sliding_window = True
    assert not StaticDecoder.covers(model)
    model.config.use_sliding_window = False
    model.config.model_type = "gemma2"
    assert not StaticDecoder.covers(model)


def test_response_logits_see_what_the_sampler_saw(tiny_pair):
    """Greedy lean tokens are the argmax of the trainer's own forward at every response position."""
    model, tok, V = tiny_pair.student, tiny_pair.tokenizer, tiny_pair.vocab_size
    batch = lean_generate(model, tok, PROMPTS, max_new_tokens=6, do_sample=False, vocab_size=V)
    with torch.no_grad():
        z = response_logits(model, batch, V)
    m = batch.response_mask
    assert torch.equal(z.argmax(-1)[m], batch.response_ids[m])


def _tiny_llama(tok, vocab_size: int, *, hidden: int, heads: int, kv_heads: int, **extra):
    """A random two-layer Llama decoder in eval mode (after ``torch.manual_seed``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden + 16,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("heads,kv_heads,bias", [(4, 2, False), (4, 4, True), (6, 1, False)], ids=["gqa", "mha_bias", "mqa"])
def test_static_decoder_on_llama_equals_the_models_own_forward(tiny_pair, heads, kv_heads, bias):
    """A Llama decoder (grouped, plain and single key/value heads; attention bias): our fused
    decode step gives the model's own cached forward's logits at every step (fp64), hence the
    same greedy tokens and the same row-seeded draws."""
    tok = tiny_pair.tokenizer
    torch.manual_seed(0)
    model = _tiny_llama(tok, tiny_pair.vocab_size + 5, hidden=24, heads=heads, kv_heads=kv_heads, attention_bias=bias).double()
    assert StaticDecoder.covers(model)
    V = tiny_pair.vocab_size
    seeds = [5 * i + 1 for i in range(len(PROMPTS) * 2)]
    kw = dict(n_samples=2, max_new_tokens=9, vocab_size=V, row_seeds=seeds, sampling=SamplingSpec(temperature=1.3))
    ours, ref = lean_generate(model, tok, PROMPTS, static=True, **kw), lean_generate(model, tok, PROMPTS, static=False, **kw)
    _same_batch(ours, ref)
    m = ours.response_mask
    assert (ours.sampling_logprobs - ref.sampling_logprobs)[m].abs().max() < 1e-10
    greedy = dict(n_samples=1, max_new_tokens=9, vocab_size=V, do_sample=False)
    _same_batch(lean_generate(model, tok, PROMPTS, static=True, **greedy), generate(model, tok, PROMPTS, **greedy))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "autocast"])
def test_half_precision_decodes_with_the_models_own_forward(tiny_pair, attn, precision):
    """In half precision fused matmuls and the written-out attention round differently from the
    model's own forward, so the static decode step is not used there: the samples and their
    log-probs are exactly those of the model's own cached forward."""
    import contextlib

    tok, V = tiny_pair.tokenizer, tiny_pair.vocab_size
    torch.manual_seed(1)
    model = _tiny_llama(tok, V, hidden=32, heads=4, kv_heads=2, attn_implementation=attn)
    if precision != "autocast":
        model = model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    seeds = [3 * i + 2 for i in range(len(PROMPTS) * 2)]
    kw = dict(n_samples=2, max_new_tokens=12, vocab_size=V, row_seeds=seeds, sampling=SamplingSpec(temperature=1.3))
    with ctx:
        ours, ref = lean_generate(model, tok, PROMPTS, **kw), lean_generate(model, tok, PROMPTS, static=False, **kw)
    _same_batch(ours, ref)
    m = ours.response_mask
    assert (ours.sampling_logprobs - ref.sampling_logprobs)[m].abs().max() == 0.0
