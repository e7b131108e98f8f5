"""Episodes are trained on the student's own tokens only: exactness by enumeration.

A tabular student and teacher (one logit row per prefix, float64) over a 4-token vocabulary:
0 and 1 plain, 2 a tool call (the turn's stop), 3 EOS. A deterministic environment answers every
call with one token that depends on the episode so far, inside a budget of 4 tokens after the
prompt (an answer that would leave no room for another student token ends the episode, as
``training/episodes.py`` does). Every episode is enumerated with its probability, the product of
the student's probabilities of its own tokens (the environment's are certain).

For every divergence (rkl, fkl, jsd), estimator (sampled, topk, full) and credit (token,
sequence), the objective called on each episode's ``[1, L, V]`` logits with ``mask = loss_mask``
(what the heads pass: ``Batch.trained_mask``) has the expected gradient of the exact divergence
summed over the student's own tokens: with the prefix frozen for token credit, through the
episode's probability for sequence credit. The logit rows the student never samples from (those
right before an environment token) get exactly zero gradient on every episode. Trained on the
environment's tokens too (``loss_mask = response_mask``) the same check fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers.tiny import small_config
from opd_exp.divergences import get_divergence
from opd_exp.training.objective import Objective

V, BUDGET = 4, 4
PLAIN, CALL, EOS = (0, 1), 2, 3


def environment(tokens: tuple[int, ...]) -> int:
    """The tool's one-token answer to a call: a function of the episode so far."""
    return (sum(tokens) + len(tokens)) % 2


def episodes() -> list[tuple[tuple[int, ...], tuple[bool, ...]]]:
    """Every episode as (tokens after the prompt, who wrote each: True the student)."""
    out = []

    def grow(tokens, student):
        if len(tokens) == BUDGET:
            out.append((tokens, student))
            return
        for y in range(V):
            t, s = tokens + (y,), student + (True,)
            if y == EOS:
                out.append((t, s))
            elif y == CALL:
                if len(t) + 1 >= BUDGET:  # no room for the answer and another student token: the episode ends
                    out.append((t, s))
                else:
                    grow(t + (environment(t),), s + (False,))
            else:
                grow(t, s)

    grow((), ())
    return out


EPISODES = episodes()
PREFIXES = sorted({tok[:i] for tok, _ in EPISODES for i in range(len(tok))}, key=lambda p: (len(p), p))
# the rows the student never samples from: the position right before an environment token
ENV_ROWS = sorted({tok[:i] for tok, who in EPISODES for i in range(len(tok)) if not who[i]})


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    theta = {p: (1.5 * torch.randn(V, generator=g, dtype=torch.float64)).requires_grad_(True) for p in PREFIXES}
    teacher = {p: 1.5 * torch.randn(V, generator=g, dtype=torch.float64) for p in PREFIXES}
    return theta, teacher


def _logits(table, tokens):
    return torch.stack([table[tokens[:i]] for i in range(len(tokens))])[None]  # [1, L, V]


def _probability(theta, tokens, who, detach: bool) -> torch.Tensor:
    """P(episode): the student's probabilities of its own tokens (the environment's are certain)."""
    logp = _logits(theta, tokens)[0].log_softmax(-1)
    terms = [logp[i, y] for i, (y, w) in enumerate(zip(tokens, who)) if w]
    p = torch.stack(terms).sum().exp()
    return p.detach() if detach else p


def exact_gradient(cfg, theta, teacher) -> torch.Tensor:
    """grad of sum_episodes P(episode) sum_{student positions} D_t exactly (the prefix frozen: token credit)."""
    d = get_divergence(cfg.divergence.name.value, **cfg.divergence.params())
    frozen = cfg.loss.credit.value == "token"
    J = torch.zeros((), dtype=torch.float64)
    for tokens, who in EPISODES:
        D = d.full(_logits(theta, tokens), _logits(teacher, tokens))[0]  # [L]
        J = J + _probability(theta, tokens, who, frozen) * D[torch.tensor(who)].sum()
    params = [theta[p] for p in PREFIXES]
    grads = torch.autograd.grad(J, params, allow_unused=True)
    return torch.cat([torch.zeros(V, dtype=torch.float64) if g is None else g for g in grads])


def expected_gradient(cfg, theta, teacher, *, train_env_tokens: bool = False, zero_rows: list | None = None) -> torch.Tensor:
    """sum_episodes P(episode) grad loss(episode): the objective on each episode, ``mask`` its loss
    mask (or its response mask: every position). ``zero_rows`` collects, per episode, the largest
    |gradient| on the rows the student never samples from."""
    obj = Objective(cfg, vocab_size=V)
    params = [theta[p] for p in PREFIXES]
    total = torch.zeros(len(params) * V, dtype=torch.float64)
    env_index = [PREFIXES.index(p) for p in ENV_ROWS]
    for tokens, who in EPISODES:
        p = float(_probability(theta, tokens, who, detach=True))
        loss_mask = torch.tensor([who])
        mask = torch.ones_like(loss_mask) if train_env_tokens else loss_mask
        out = obj(_logits(theta, tokens), _logits(teacher, tokens).detach(), torch.tensor([tokens]), mask, on_policy=True, normalizer=1.0)
        grads = torch.autograd.grad(out.loss, params, allow_unused=True)
        flat = torch.cat([torch.zeros(V, dtype=torch.float64) if g is None else g for g in grads])
        if zero_rows is not None:
            zero_rows.append(max((float(flat[i * V : (i + 1) * V].abs().max()) for i in env_index), default=0.0))
        total += p * flat
    return total


ESTIMATORS = [("sampled", "reinforce"), ("topk", "reinforce"), ("full", "direct")]
CASES = [
    (est, loss if not (credit == "sequence" and loss == "direct") else "reinforce", credit, div)
    for (est, loss), credit, div in itertools.product(ESTIMATORS, ("token", "sequence"), ("rkl", "fkl", "jsd"))
]


def _cfg(est, loss, credit, div, baseline="none"):
    return small_config(
        estimator={"name": est, "k": 2, "baseline": baseline},
        loss={"name": loss, "credit": credit},
        divergence={"name": div},
    )


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_the_enumeration_has_episodes_with_environment_tokens():
    with_env = [who for _, who in EPISODES if not all(who)]
    assert len(EPISODES) > 20 and len(with_env) > 5 and ENV_ROWS
    assert abs(sum(float(_probability(_tables(0)[0], t, w, True)) for t, w in EPISODES) - 1.0) < 1e-12


@pytest.mark.parametrize("est,loss,credit,div", CASES)
def test_expected_gradient_is_the_exact_divergence_over_the_students_own_tokens(est, loss, credit, div):
    theta, teacher = _tables(3)
    cfg = _cfg(est, loss, credit, div)
    zero_rows: list[float] = []
    got = expected_gradient(cfg, theta, teacher, zero_rows=zero_rows)
    want = exact_gradient(cfg, theta, teacher)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    # environment tokens contribute exactly zero: no episode moves the rows the student never samples from
    assert max(zero_rows) == 0.0


def test_a_control_variate_baseline_keeps_it_exact():
    theta, teacher = _tables(5)
    cfg = _cfg("sampled", "reinforce", "sequence", "jsd", baseline="exact")
    torch.testing.assert_close(expected_gradient(cfg, theta, teacher), exact_gradient(cfg, theta, teacher), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("est,loss,credit,div", CASES)
def test_the_check_fails_when_environment_tokens_are_trained(est, loss, credit, div):
    """loss_mask = response_mask: the environment's tokens scored as if the student wrote them."""
    theta, teacher = _tables(3)
    cfg = _cfg(est, loss, credit, div)
    zero_rows: list[float] = []
    wrong = expected_gradient(cfg, theta, teacher, train_env_tokens=True, zero_rows=zero_rows)
    assert _rel(wrong, exact_gradient(cfg, theta, teacher)) > 1e-3
    assert max(zero_rows) > 1e-3  # and the rows the student never samples from are pushed


def discounted_gradient(cfg, theta, teacher, gamma: float) -> torch.Tensor:
    """The expected gradient of sequence credit at ``loss.gamma=gamma``, by enumeration: each student
    position's own grad D_t, plus its score times the later student positions' D_t' discounted by
    gamma per STUDENT token between them (environment tokens are not a step of the discount)."""
    d = get_divergence(cfg.divergence.name.value, **cfg.divergence.params())
    J = torch.zeros((), dtype=torch.float64)
    for tokens, who in EPISODES:
        D = d.full(_logits(theta, tokens), _logits(teacher, tokens))[0]  # [L], each with grad through its own row
        logp = _logits(theta, tokens)[0].log_softmax(-1)
        own = [i for i, w in enumerate(who) if w]
        term = D[own].sum()
        for k, i in enumerate(own):
            score = logp[i, tokens[i]] - logp[i, tokens[i]].detach()
            future = sum(gamma ** (m - k) * D[j].detach() for m, j in enumerate(own) if m > k)
            term = term + score * future
        J = J + _probability(theta, tokens, who, detach=True) * term
    grads = torch.autograd.grad(J, [theta[p] for p in PREFIXES], allow_unused=True)
    return torch.cat([torch.zeros(V, dtype=torch.float64) if g is None else g for g in grads])


@pytest.mark.parametrize("est", [e for e, _ in ESTIMATORS])
@pytest.mark.parametrize("div", ["rkl", "jsd"])
def test_gamma_discounts_by_the_students_own_tokens(est, div):
    """loss.gamma < 1: the discount between two student tokens is gamma^(student tokens between
    them), never counting the environment's (before the fix an episode's tool answer cost a factor)."""
    theta, teacher = _tables(7)
    cfg = small_config(
        estimator={"name": est, "k": 2}, loss={"name": "reinforce", "credit": "sequence", "gamma": 0.5}, divergence={"name": div}
    )
    got = expected_gradient(cfg, theta, teacher)
    torch.testing.assert_close(got, discounted_gradient(cfg, theta, teacher, 0.5), rtol=1e-9, atol=1e-12)
    # gamma=1 is the exact gradient itself (the same helper, so the check above can tell them apart)
    assert (
        _rel(discounted_gradient(cfg, theta, teacher, 1.0), exact_gradient(_cfg(est, "reinforce", "sequence", div), theta, teacher)) < 1e-9
    )
    assert (
        _rel(discounted_gradient(cfg, theta, teacher, 0.5), exact_gradient(_cfg(est, "reinforce", "sequence", div), theta, teacher)) > 1e-3
    )
