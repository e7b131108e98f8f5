"""The lab's pieces checked against exact numbers: the legacy JSD cost (seed formula, wrong
direction by enumeration), position-restricted losses, the k-sample eval metrics on a fixed
toy distribution, and the multimodal world's generator and verifier."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from opd_exp.config.world import TaskConfig
from opd_exp.divergences import get_divergence
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks import build_task
from opd_exp.tasks import multimodal as mm
from opd_exp.training.evaluate import Evaluator, sample_metrics
from opd_exp.training.objective import position_mask
from opd_exp.training.rollout import Batch

# --- the legacy JSD cost --------------------------------------------------------------


def _pair(seed, V=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g, dtype=torch.float64), torch.randn(V, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("beta", [0.3, 0.5, 0.9])
def test_legacy_cost_is_the_seed_formula(beta):
    d = get_divergence("jsd_legacy", beta=beta)
    zs, zt = _pair(0)
    s, t = zs.log_softmax(-1), zt.log_softmax(-1)
    m = beta * t.exp() + (1 - beta) * s.exp()  # the mixture, from probabilities
    want = beta * (t - m.log()) + (1 - beta) * (s - m.log())
    torch.testing.assert_close(d.token_cost(s, t), want, rtol=1e-12, atol=1e-12)
    # everything but the sampled cost is the correct JSD
    torch.testing.assert_close(d.full(zs, zt), get_divergence("jsd", beta=beta).full(zs, zt))
    torch.testing.assert_close(d.token_value(s, t), get_divergence("jsd", beta=beta).token_value(s, t))


@pytest.mark.parametrize("beta", [0.3, 0.5, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_legacy_expected_update_points_away_from_minus_grad_jsd(beta, seed):
    """E_{y~S}[-c(y) grad log S(y)] by enumeration, against -grad JSD_beta by autograd."""
    legacy, jsd = get_divergence("jsd_legacy", beta=beta), get_divergence("jsd", beta=beta)
    zs, zt = _pair(seed)
    zs.requires_grad_(True)
    jsd.full(zs, zt).backward()
    S = zs.detach().softmax(-1)
    s, t = S.log(), zt.log_softmax(-1)

    def update(cost):  # -E[c(y) grad_z log S(y)], grad_z log S(y) = e_y - S
        return -(S * cost - S * (S * cost).sum())

    cos_legacy = F.cosine_similarity(update(legacy.token_cost(s, t)), -zs.grad, dim=0).item()
    cos_fixed = F.cosine_similarity(update(jsd.token_cost(s, t)), -zs.grad, dim=0).item()
    assert cos_legacy < 0, cos_legacy
    assert cos_fixed > 0.9999
    assert not legacy.exact_cost and jsd.exact_cost


def test_legacy_is_refused_outside_the_sampled_estimator_and_at_the_endpoints():
    from opd_exp.cli.train import to_train_config
    from tests.test_config import _compose

    with pytest.raises(ConfigError, match=r"estimator.name='full' is not allowed; allowed: sampled with divergence=jsd_legacy"):
        to_train_config(_compose(["divergence=jsd_legacy"]))
    with pytest.raises(ConfigError, match=r"divergence.beta=1.0 is not allowed; allowed: 0 < beta < 1 with divergence=jsd_legacy"):
        to_train_config(_compose(["divergence=jsd_legacy", "divergence.beta=1.0", "estimator=sampled", "loss=ppo"]))
    with pytest.raises(ValueError, match=r"'jsd_legacy': beta=0\.0 is out of range; allowed: 0 < beta < 1"):
        get_divergence("jsd_legacy", beta=0.0)
    cfg = to_train_config(_compose(["divergence=jsd_legacy", "estimator=sampled", "loss=ppo", "divergence.beta=0.3"]))
    from opd_exp.training.objective import metric_beta

    assert cfg.divergence.params() == {"beta": 0.3} and metric_beta(cfg) == 0.3


# --- position-restricted loss -----------------------------------------------------------


def test_position_mask_first_last_all():
    # response lengths 10, 3 and 0 (mask is a prefix of each row)
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, :3] = True
    first = position_mask(mask, "first", 0.3)
    last = position_mask(mask, "last", 0.3)
    assert first[0].nonzero().flatten().tolist() == [0, 1, 2]  # ceil(0.3 * 10) = 3
    assert last[0].nonzero().flatten().tolist() == [7, 8, 9]
    assert first[1].nonzero().flatten().tolist() == [0]  # ceil(0.3 * 3) = 1
    assert last[1].nonzero().flatten().tolist() == [2]
    assert not first[2].any() and not last[2].any()
    assert torch.equal(position_mask(mask, "all", 0.3), mask)
    assert torch.equal(position_mask(mask, "first", 1.0), mask)


def test_objective_counts_only_the_chosen_positions():
    """The loss with positions=first equals the full loss summed over the first positions only."""
    from omegaconf import OmegaConf

    from opd_exp.config.schema import TrainConfig
    from opd_exp.config.world import ModelPairConfig
    from opd_exp.training.objective import Objective

    def cfg(**positions):
        base = OmegaConf.structured(TrainConfig(model_pair=ModelPairConfig(), task=TaskConfig()))
        return OmegaConf.to_object(OmegaConf.merge(base, {"positions": positions}))

    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(2, 10, 7, generator=g), torch.randn(2, 10, 7, generator=g)
    y = torch.randint(0, 7, (2, 10), generator=g)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, :10], mask[1, :4] = True, True
    per_pos = get_divergence("fkl").full(zs, zt)  # the default: fkl, full, direct, kl_coef 1
    out_all = Objective(cfg())(zs, zt, y, mask, on_policy=True, normalizer=14)
    out_first = Objective(cfg(name="first", fraction=0.3))(zs, zt, y, mask, on_policy=True, normalizer=14)
    out_last = Objective(cfg(name="last", fraction=0.5))(zs, zt, y, mask, on_policy=True, normalizer=14)
    torch.testing.assert_close(out_all.loss, per_pos[mask].sum() / 14)
    torch.testing.assert_close(out_first.loss, (per_pos[0, :3].sum() + per_pos[1, :2].sum()) / 14)
    torch.testing.assert_close(out_last.loss, (per_pos[0, 5:].sum() + per_pos[1, 2:4].sum()) / 14)
    # metrics still cover every response token (and say which share of them the loss counted)
    assert out_first.sums == {**out_all.sums, "positions/weight_mean": 5.0}
    with pytest.raises(ConfigError, match=r"positions.fraction=0.0 is not allowed; allowed: 0 < fraction <= 1"):
        cfg(name="first", fraction=0)


# --- k-sample eval metrics --------------------------------------------------------------


def test_sample_metrics_by_hand():
    correct = [[True, False, True, False], [False, False, False, False], [True, True, True, True]]
    found = [{"14", "21"}, set(), {"70"}]
    n_answers = [4, 2, 2]
    got = sample_metrics(correct, found, n_answers)
    assert got["eval/precision"] == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert got["eval/pass@k"] == pytest.approx(2 / 3)
    assert got["eval/coverage"] == pytest.approx((2 / 4 + 0 + 1 / 2) / 3)
    assert "eval/coverage" not in sample_metrics(correct)


class _ToyTokenizer:
    """Token id i (1..9) is the character str(i); 0 is EOS."""

    pad_token_id, eos_token_id, chat_template = 0, 0, None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids if i)


class _ToyEngine:
    """k 'samples' per prompt fixed in advance: response j of prompt i is ROWS[i][j] (a digit string)."""

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def generate(self, prompts, seeds=None, *, n_samples=1, greedy=False):
        self.calls.append((list(prompts), list(seeds), n_samples, greedy))
        texts = [r for p in prompts for r in self.rows[p]]
        R = max(len(t) for t in texts) + 1
        ids = torch.zeros(len(texts), 1 + R, dtype=torch.long)
        resp = torch.zeros(len(texts), R, dtype=torch.bool)
        for i, t in enumerate(texts):
            ids[i, 1 : 1 + len(t)] = torch.tensor([int(c) for c in t])
            resp[i, : len(t) + 1] = True  # the tokens and the EOS after them
        ones = torch.ones_like(ids)
        return Batch(ids, ones, torch.cumsum(ones, -1) - 1, 1, resp, torch.arange(len(prompts)).repeat_interleave(n_samples))


class _ToyTask:
    def render_prompt(self, p, tokenizer):
        return p.prompt

    def verify(self, completion, answer):
        return completion in answer.split("|")

    def extract_answer(self, completion):
        return completion


def test_evaluator_sampled_metrics_on_a_fixed_toy_distribution():
    """Two prompts, k = 3 fixed samples each, and a student whose sampling distribution is
    uniform over 4 tokens at every position (entropy log 4) on the first prompt's rows and
    one-hot (entropy 0) on the second's."""
    p1 = mm.MultiProblem(prompt="a", answer="14|21|28", solution="", answers=("14", "21", "28"))
    p2 = mm.MultiProblem(prompt="b", answer="5", solution="", answers=("5",))
    engine = _ToyEngine({"a": ["14", "21", "99"], "b": ["6", "7", "8"]})

    def student_logits(batch):
        z = torch.full((batch.num_sequences, batch.response_mask.shape[1], 10), -1e9)
        z[:3, :, :4] = 0.0  # prompt a's rows: uniform over 4 tokens
        z[3:, :, 0] = 0.0  # prompt b's rows: one-hot
        return z

    ev = Evaluator(
        _ToyTask(), _ToyTokenizer(), [p1, p2], batch_size=6, divergences={}, student_logits=student_logits, teacher=None, samples=3
    )
    got = ev.sampled(engine, "cpu")
    assert got["eval/precision"] == pytest.approx((2 / 3 + 0) / 2)
    assert got["eval/pass@k"] == pytest.approx(1 / 2)
    assert got["eval/coverage"] == pytest.approx((2 / 3 + 0) / 2)
    # response tokens: prompt a 3+3+3 (2 digits + EOS each), prompt b 2+2+2
    assert got["eval/entropy"] == pytest.approx(9 * math.log(4) / 15)
    ((prompts, seeds, k, greedy),) = engine.calls
    assert prompts == ["a", "b"] and k == 3 and not greedy and len(set(seeds)) == 6


# --- the multimodal world ---------------------------------------------------------------


def test_multimodal_answers_are_exactly_the_valid_ones():
    rng = random.Random(0)
    spec = mm.MultimodalSpec()
    for _ in range(300):
        p = mm.sample_problem(rng, spec)
        family, k, _, rng_text = p.prompt.split()
        lo, hi = (int(x) for x in rng_text.rstrip("?").split("-"))
        k = int(k)
        # brute force over the range
        want = [str(x) for x in range(lo, hi + 1) if (x % k == 0 if family == "mul" else sum(map(int, str(x))) == k)]
        assert list(p.answers) == want
        assert spec.min_answers <= len(want) <= spec.max_answers
        assert p.solution.removeprefix("#### ") in want


def test_multimodal_verifier_accepts_every_valid_answer_and_nothing_else():
    task = build_task(TaskConfig(name="multimodal", n_train=50, n_eval=20))
    for p in task.eval_problems():
        valid = set(p.answers)
        for x in range(0, 120):
            assert task.verify(f"#### {x}", p.answer) == (str(x) in valid)
        assert not task.verify("14", p.answer)  # no answer marker
    assert mm.make_problem("mul", 7, 10, 40).answer == "14|21|28|35"


def test_multimodal_splits_are_disjoint_deterministic_and_spread_their_answers():
    a = build_task(TaskConfig(name="multimodal", n_train=2000, n_eval=100))
    b = build_task(TaskConfig(name="multimodal", n_train=2000, n_eval=100))
    assert [p.prompt for p in a.eval_problems()] == [p.prompt for p in b.eval_problems()]
    assert len({p.prompt for p in a.eval_problems()}) == 100
    assert not {p.prompt for p in a.train_problems()} & {p.prompt for p in a.eval_problems()}
    # a prompt drawn repeatedly gets different SFT answers (the teacher learns all of them)
    draws = mm.train_split(mm.MultimodalSpec(2, 2), 4000, 0, set())
    by_prompt: dict[str, set] = {}
    for p in draws:
        by_prompt.setdefault(p.prompt, set()).add(p.solution)
    repeated = [v for v in by_prompt.values() if len(v) > 1]
    assert repeated, "no prompt was drawn with both of its answers"
    with pytest.raises(ConfigError, match=r"task.max_answers=1 is not allowed; allowed: an integer in \[min_answers=2, 10\]"):
        TaskConfig(name="multimodal", max_answers=1)
