"""Rollout and scoring: sampling log-probs, positional masks, alignment, vocabulary limits."""

from __future__ import annotations

import pytest
import torch

from opd_exp.training.rollout import (
    FILTERED_LOGIT,
    Batch,
    encode_prompts,
    generate,
    response_mask_from_ids,
    sampling_logits,
)
from opd_exp.training.sampling import SamplingSpec
from opd_exp.training.scoring import response_logits, student_logits, token_logprobs


def test_mask_is_positional_eos_scored_nothing_after():
    eos, pad = 1, 0
    ids = torch.tensor(
        [
            [5, 0, 6, 1, 1, 1],  # a sampled pad id before EOS is a real token; pads after EOS (== eos) are not
            [5, 6, 7, 8, 9, 10],  # no EOS: the whole response counts
            [1, 5, 6, 0, 0, 0],  # EOS first: only it counts
        ]
    )
    mask = response_mask_from_ids(ids, [eos])
    assert mask.tolist() == [
        [True, True, True, True, False, False],
        [True] * 6,
        [True, False, False, False, False, False],
    ]
    assert pad == 0


def test_prompts_left_padded_and_truncated_from_the_left(tiny_pair):
    tok = tiny_pair.tokenizer
    ids, mask = encode_prompts(tok, ["1+2=", "33+44="], max_prompt_tokens=5)
    assert ids.shape == (2, 5)
    assert mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert tok.decode(ids[1]) == "3+44="  # kept the end of the prompt


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8), (0.8, 6, 0.9)])
def test_sampling_logprobs_are_those_of_the_sampled_distribution(tiny_pair, temperature, top_k, top_p):
    """Our transform of the trainer's forward equals generate's processed scores, so the
    REINFORCE/PPO log-probs are those of the distribution the tokens were drawn from."""
    torch.manual_seed(0)
    model, tok, V = tiny_pair.student, tiny_pair.tokenizer, tiny_pair.vocab_size
    batch, scores = generate(
        model,
        tok,
        ["1+2=", "34+5=", "7="],
        n_samples=2,
        max_new_tokens=6,
        sampling=SamplingSpec(temperature, top_k, top_p),
        vocab_size=V,
        return_scores=True,
    )
    with torch.no_grad():
        ours = student_logits(model, batch, V, SamplingSpec(temperature, top_k, top_p))
    ref = scores[..., :V].float()
    m = batch.response_mask
    # the same tokens survive the filters ...
    assert torch.equal((ours > FILTERED_LOGIT / 2)[m], (ref > FILTERED_LOGIT / 2)[m])
    # ... and the sampled tokens' log-probs agree (sampling log-probs = training log-probs)
    y = batch.response_ids
    lp_ours = token_logprobs(ours, y)[m]
    lp_ref = torch.log_softmax(ref, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)[m]
    assert torch.isfinite(lp_ref).all()
    torch.testing.assert_close(lp_ours, lp_ref, atol=2e-4, rtol=1e-4)


def test_scoring_aligns_positions_across_left_padding(tiny_pair):
    """logits at i predict i+1: the padded batch gives each row the log-probs of its own
    unpadded forward."""
    torch.manual_seed(1)
    model, tok, V = tiny_pair.student, tiny_pair.tokenizer, tiny_pair.vocab_size
    batch = generate(model, tok, ["1+2=", "34+56=", "7="], max_new_tokens=5, vocab_size=V)
    with torch.no_grad():
        lp = token_logprobs(response_logits(model, batch, V).float(), batch.response_ids)
        for i in range(batch.num_sequences):
            keep = batch.attention_mask[i].bool()
            row = batch.input_ids[i][keep].unsqueeze(0)
            logits = model(input_ids=row).logits[0, :, :V].float()
            P = int(keep[: batch.prompt_len].sum())
            ref = torch.log_softmax(logits[P - 1 : -1], -1).gather(-1, row[0, P:].unsqueeze(-1)).squeeze(-1)
            m = batch.response_mask[i]
            torch.testing.assert_close(lp[i][m], ref[m], atol=1e-5, rtol=1e-5)


def test_padded_vocabulary_rows_are_never_sampled(tiny_pair):
    torch.manual_seed(2)
    teacher, V = tiny_pair.teacher, tiny_pair.vocab_size
    assert teacher.get_output_embeddings().weight.shape[0] > V
    with torch.no_grad():  # make the padded rows irresistible
        teacher.get_output_embeddings().weight[V:] = 10.0
    batch = generate(teacher, tiny_pair.tokenizer, ["1+2="] * 8, max_new_tokens=4, vocab_size=V)
    assert int(batch.response_ids.max()) < V


def test_sampling_logits_filters():
    z = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert (sampling_logits(z, top_k=2) > FILTERED_LOGIT / 2).tolist() == [[True, True, False, False]]
    p = torch.softmax(z, -1)[0]
    # top_p just above the top token's mass keeps two tokens
    kept = sampling_logits(z, top_p=float(p[0]) + 1e-3) > FILTERED_LOGIT / 2
    assert kept.tolist() == [[True, True, False, False]]
    torch.testing.assert_close(sampling_logits(z, temperature=2.0), z / 2)


def test_sampling_spec_carries_the_rollout_settings():
    from types import SimpleNamespace

    spec = SamplingSpec.from_rollout(SimpleNamespace(temperature=0.7, top_k=2, top_p=0.9, max_new_tokens=5))
    assert spec == SamplingSpec(0.7, 2, 0.9) and spec.filtered
    assert not SamplingSpec().filtered and SamplingSpec(top_p=0.5).filtered
    z = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert torch.equal(spec.logits(z), sampling_logits(z, 0.7, 2, 0.9))
    assert torch.equal(SamplingSpec().logits(z), z)


def test_every_engine_lays_out_its_batch_the_same_way():
    """``Batch.from_responses``: prompt then response, positions skipping left padding, the mask
    up to the first EOS and (rows that stopped early) no further than each row's length, the
    engine's log-probs kept on the mask only, rows prompt-major."""
    ids, mask = torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]])
    response = torch.tensor([[3, 1, 0], [4, 4, 4]])
    lp = torch.tensor([[-0.5, -0.25, -9.0], [-1.0, -2.0, -3.0]])
    b = Batch.from_responses(ids, mask, response, [1], n_samples=2, source="teacher", sampling_logprobs=lp)
    assert b.input_ids.tolist() == [[0, 5, 3, 1, 0], [6, 7, 4, 4, 4]] and b.prompt_len == 2
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert b.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert b.prompt_index.tolist() == [0, 0] and b.source == "teacher"
    assert b.sampling_logprobs.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    assert b.reward_advantages is None and b.route is None
    short = Batch.from_responses(ids, mask, response, [1], lengths=torch.tensor([3, 0]))
    assert short.response_mask.tolist() == [[True, True, False], [False, False, False]]
    assert short.prompt_index.tolist() == [0, 1] and short.sampling_logprobs is None
