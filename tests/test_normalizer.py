"""``loss.normalizer``: with ``constant`` (rows x rollout.max_new_tokens) the expected gradient of a
step's loss equals the gradient of the per-token target for responses that end at EOS, by
enumeration of every pair of responses of a tabular model (vocabulary a, b, EOS; up to 3 tokens);
with ``tokens`` (the step's trained-token count, random) it does not, and the size of the bias is
what docs/training.md states."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from helpers.tiny import small_config
from opd_exp.config.world import TaskConfig
from opd_exp.training.objective import Objective, loss_normalizer
from opd_exp.training.scoring import TeacherScores

V, T, EOS, ROWS = 3, 3, 2, 2


def _prefixes():
    out = [()]
    for n in range(1, T):
        out += list(itertools.product(range(V - 1), repeat=n))  # a prefix never holds EOS
    return {p: i for i, p in enumerate(out)}


PREFIX = _prefixes()


def _responses():
    """Every response: tokens until EOS or T tokens."""
    out = []

    def grow(seq):
        if len(seq) == T or (seq and seq[-1] == EOS):
            out.append(tuple(seq))
            return
        for y in range(V):
            grow([*seq, y])

    grow([])
    return out


RESPONSES = _responses()


def _row(theta, table_t, seq):
    """(student logits [T, V], teacher logits, ids [T], mask [T]) of one response, padded to T."""
    ids = list(seq) + [0] * (T - len(seq))
    idx = [PREFIX[tuple(seq[:t])] for t in range(len(seq))] + [0] * (T - len(seq))
    return theta[idx], table_t[idx], torch.tensor(ids), torch.arange(T) < len(seq)


def _prob(theta, seq) -> torch.Tensor:
    lp = torch.log_softmax(theta, -1)
    return torch.exp(sum(lp[PREFIX[tuple(seq[:t])], y] for t, y in enumerate(seq)))


def _expected_grad(cfg, theta, table_t):
    obj = Objective(cfg, vocab_size=V)
    total = torch.zeros_like(theta)
    for pair in itertools.product(RESPONSES, repeat=ROWS):
        rows = [_row(theta, table_t, s) for s in pair]
        zs, zt, ids, mask = (torch.stack(x) for x in zip(*rows))
        norm = loss_normalizer(cfg, int(mask.sum()), ROWS)
        out = obj(zs, TeacherScores(logits=zt), ids, mask, on_policy=True, normalizer=norm)
        (g,) = torch.autograd.grad(out.loss, theta)
        w = torch.prod(torch.stack([_prob(theta.detach(), s) for s in pair]))
        total += w * g
    return total


def _target_grad(cfg, theta, table_t):
    """grad of (1 / max_new_tokens) E_S[sum_t D_t] with the prefix distribution frozen (token credit: GKD's objective)."""
    from opd_exp.divergences import get_divergence

    div = get_divergence(cfg.divergence.name.value, **cfg.divergence.params())
    target = torch.zeros((), dtype=theta.dtype)
    for seq in RESPONSES:
        zs, zt, _, mask = _row(theta, table_t, seq)
        d = div.full(zs[None], zt[None])[0]
        target = target + _prob(theta.detach(), seq) * d[mask].sum()
    (g,) = torch.autograd.grad(target / T, theta)
    return g


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(len(PREFIX), V, generator=g, dtype=torch.float64, requires_grad=True)
    table_t = torch.randn(len(PREFIX), V, generator=g, dtype=torch.float64)
    return theta, table_t


CASES = [
    ("sampled", "reinforce", "rkl"),
    ("sampled", "reinforce", "jsd"),
    ("sampled", "ppo", "fkl"),
    ("full", "direct", "rkl"),
    ("full", "direct", "jsd"),
]


@pytest.mark.parametrize(("estimator", "loss", "div"), CASES)
def test_constant_normalizer_is_unbiased_with_eos_and_tokens_is_not(estimator, loss, div):
    theta, table_t = _tables(0)
    groups = dict(
        estimator={"name": estimator, **({"baseline": "none"} if estimator == "sampled" else {})},
        divergence={"name": div, "beta": 0.3},
        rollout={"max_new_tokens": T},
    )
    want = _target_grad(small_config(loss={"name": loss}, **groups), theta, table_t)
    const = _expected_grad(small_config(loss={"name": loss, "normalizer": "constant"}, **groups), theta, table_t)
    tokens = _expected_grad(small_config(loss={"name": loss, "normalizer": "tokens"}, **groups), theta, table_t)
    torch.testing.assert_close(const, want, rtol=1e-10, atol=1e-13)
    rel = float((tokens - want).norm() / want.norm())
    cos = float(torch.nn.functional.cosine_similarity(tokens.flatten(), want.flatten(), dim=0))
    assert rel > 0.05 and cos < 0.9999, (rel, cos)  # the token count's randomness moves the expected gradient


def test_the_normalizer_values():
    cfg = small_config(rollout={"max_new_tokens": 7}, loss={"normalizer": "constant"})
    assert loss_normalizer(cfg, 13, 4) == 28.0
    assert loss_normalizer(small_config(), 13, 4) == 13.0  # tokens, the default


def test_the_constant_of_an_episode_is_its_student_token_budget():
    """A task with an environment: rows x the episode's budget (rollout.max_episode_tokens, at most
    max_turns turns at their cap), not rows x one turn's cap."""
    ro = {"max_new_tokens": 24, "max_turns": 4, "max_episode_tokens": 64}

    def episodes(**r):
        cfg = small_config(rollout={**ro, **r}, loss={"normalizer": "constant"})
        return dataclasses.replace(cfg, task=TaskConfig(name="calc_tool"))

    assert loss_normalizer(episodes(), 13, 4) == 4 * 64.0
    assert loss_normalizer(episodes(max_episode_tokens=None), 13, 4) == 4 * 96.0  # every turn at its cap
    assert loss_normalizer(episodes(max_episode_tokens=500), 13, 4) == 4 * 96.0  # the turns bound it first
    assert loss_normalizer(episodes(max_turns=1), 13, 4) == 4 * 24.0  # one turn
    # a task without an environment is one turn whatever rollout.max_turns says
    assert loss_normalizer(small_config(rollout=ro, loss={"normalizer": "constant"}), 13, 4) == 4 * 24.0
