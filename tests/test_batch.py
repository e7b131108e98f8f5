"""The Batch seam: every per-row field travels through the one slicer and the one device move (a
field added to ``Batch`` cannot be dropped by a micro-batch, PPO's mini-batches or a device
move), ``loss_mask`` stays apart from ``response_mask``, and ``source`` is an enum."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from opd_exp.training.batch import Batch, Source


def _batch(n: int = 5, P: int = 3, R: int = 4) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (n, P + R), generator=g)
    rm = torch.rand(n, R, generator=g) > 0.2
    view = Batch(
        torch.randint(3, 50, (n, P + 2 + R), generator=g),
        torch.ones(n, P + 2 + R),
        torch.arange(P + 2 + R).repeat(n, 1),
        P + 2,
        rm,
        torch.arange(n),
    )
    return Batch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(P + R).repeat(n, 1),
        prompt_len=P,
        response_mask=rm,
        prompt_index=torch.arange(n) // 2,
        sampling_logprobs=torch.randn(n, R, generator=g),
        reward_advantages=torch.randn(n, R, generator=g),
        route=torch.arange(n) % 2,
        loss_mask=rm & (torch.arange(R) != 1),  # column 1 written by an environment: scored, never trained
        teacher_view=view,
        behaviour_logprobs=torch.randn(n, R, generator=g),
    )


def _tensor_fields(b: Batch) -> dict:
    return {f.name: getattr(b, f.name) for f in dataclasses.fields(b) if isinstance(getattr(b, f.name), (torch.Tensor, Batch))}


def test_every_field_travels_through_select_micro_batches_and_to():
    b = _batch()
    fields = _tensor_fields(b)
    assert set(fields) == {f.name for f in dataclasses.fields(Batch)} - {"prompt_len", "source"}  # every field is set here
    rows = torch.tensor([4, 1])
    part = b.select(rows)
    for name, value in fields.items():
        got = getattr(part, name)
        want = value.select(rows) if isinstance(value, Batch) else value[rows]
        if isinstance(value, Batch):
            assert torch.equal(got.input_ids, want.input_ids) and got.prompt_len == value.prompt_len, name
        else:
            assert torch.equal(got, want), name
    pieces = list(b.micro_batches(2))
    assert [p.num_sequences for p in pieces] == [2, 2, 1]
    for name, value in fields.items():
        if not isinstance(value, Batch):
            assert torch.equal(torch.cat([getattr(p, name) for p in pieces]), value), name
    moved = b.to("cpu")
    assert all(torch.equal(getattr(moved, n), v) for n, v in fields.items() if not isinstance(v, Batch))


def test_loss_mask_is_apart_from_the_response_mask():
    b = _batch()
    assert b.num_response_tokens == int(b.response_mask.sum()) > b.num_trained_tokens == int(b.loss_mask.sum())
    one_turn = dataclasses.replace(b, loss_mask=None)
    assert one_turn.trained_mask is one_turn.response_mask  # one-turn rollouts: every response token is the student's
    with pytest.raises(ValueError, match="loss_mask"):
        dataclasses.replace(b, loss_mask=torch.ones(2, 2, dtype=torch.bool))


def test_source_is_an_enum():
    b = dataclasses.replace(_batch(), source="teacher")
    assert b.source is Source.teacher and not b.on_policy
    with pytest.raises(ValueError):
        dataclasses.replace(b, source="teacher_ema")
