"""Reward + distillation (reward.*): the mixed estimator's expected gradient by enumeration on a
tabular model, the group baselines' exact bias, the config's refusals, and the trainer's wiring
(reward/* metrics, the gradient of the reward term, PPO's stored combined advantages)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from helpers import golden
from helpers.tiny import AddTask, small_config
from opd_exp.config.reward import RewardBaseline
from opd_exp.divergences import get_divergence
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.objective import Objective, ppo_surrogate
from opd_exp.training.reward import REWARD_METRICS, group_advantages, with_reward
from opd_exp.training.scoring import token_logprobs
from opd_exp.training.trainer import Trainer

W = 3  # tabular model: vocabulary 3, responses of 2 tokens (9 sequences)


def _tabular(seed: int, real: bool = False):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    z1, z2 = rnd(W).requires_grad_(True), rnd(W, W).requires_grad_(True)  # student: token 1, token 2 given token 1
    t1, t2 = rnd(W), rnd(W, W)
    score = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)  # a 0/1 verifier
    return z1, z2, t1, t2, (rnd(W, W) if real else score)  # or a task's real-valued score


def _expected_gradient(cfg, n: int, seed: int, *, std_normalize: bool = False, real: bool = False):
    """E over n i.i.d. responses to one prompt of grad(loss), the objective fed the reward's
    advantages, enumerated over all 9**n tuples; and the pieces of the exact gradient."""
    z1, z2, t1, t2, score = _tabular(seed, real)
    obj, rw = Objective(cfg), cfg.reward
    p1 = torch.softmax(z1, -1)
    p = (p1.unsqueeze(-1) * torch.softmax(z2, -1)).detach()  # P(a, b)
    got = [torch.zeros_like(z1), torch.zeros_like(z2)]
    mask = torch.ones(n, 2, dtype=torch.bool)
    seqs = list(itertools.product(range(W), repeat=2))
    for tup in itertools.product(seqs, repeat=n):
        prob = math.prod(float(p[a, b]) for a, b in tup)
        zs = torch.stack([torch.stack([z1, z2[a]]) for a, _ in tup])
        zt = torch.stack([torch.stack([t1, t2[a]]) for a, _ in tup])
        r = torch.stack([score[a, b] for a, b in tup])
        adv = rw.coef * group_advantages(r, torch.zeros(n, dtype=torch.long), rw.baseline, std_normalize)
        out = obj(zs, zt, torch.tensor(tup), mask, on_policy=True, normalizer=n, reward_advantages=adv.unsqueeze(-1).expand(n, 2))
        g1, g2 = torch.autograd.grad(out.loss, (z1, z2))
        got[0] += prob * g1
        got[1] += prob * g2
    d = get_divergence(cfg.divergence.name.value, **cfg.divergence.params())
    frozen = p1.detach() if cfg.loss.credit.value == "token" else p1  # token credit: the prefix-frozen sum_t D_t
    distill = torch.autograd.grad(d.full(z1, t1) + (frozen * d.full(z2, t2)).sum(), (z1, z2), retain_graph=True)
    reward = torch.autograd.grad((p1.unsqueeze(-1) * torch.softmax(z2, -1) * score).sum(), (z1, z2))  # grad E[r]
    return got, distill, reward


def _config(divergence, estimator, loss, *, n, coef, baseline, kl_coef):
    return small_config(
        divergence=divergence,
        estimator=estimator,
        loss={**loss, "kl_coef": kl_coef},
        rollout={"n_samples": n},
        reward={"coef": coef, "baseline": RewardBaseline(baseline)},
    )


@pytest.mark.parametrize(
    "divergence,estimator,loss,n,baseline,kl_coef,coef",
    [
        ({"name": "rkl"}, {"name": "sampled"}, {"name": "reinforce"}, 2, "loo", 0.7, 1.3),
        ({"name": "jsd", "beta": 0.3}, {"name": "sampled"}, {"name": "ppo"}, 3, "loo", 0.5, 2.0),  # ExOPD scale > 1
        ({"name": "rkl"}, {"name": "sampled"}, {"name": "reinforce", "credit": "sequence"}, 1, "none", 1.0, 0.8),
        ({"name": "fkl"}, {"name": "full"}, {"name": "direct"}, 2, "loo", 1.0, 1.0),  # the REINFORCE term on top of GKD
        ({"name": "skl", "alpha": 0.2}, {"name": "topk", "k": 2}, {"name": "reinforce", "credit": "sequence"}, 2, "loo", 0.6, 0.9),
        ({"name": "rkl"}, {"name": "sampled"}, {"name": "reinforce"}, 2, "loo", 0.0, 1.0),  # reward-only
        ({"name": "tvd"}, {"name": "sampled"}, {"name": "ppo"}, 1, "none", 0.0, 1.5),  # reward-only, no baseline
    ],
)
def test_expected_gradient_is_kl_coef_grad_distillation_minus_coef_grad_reward(divergence, estimator, loss, n, baseline, kl_coef, coef):
    """E[grad loss] = kl_coef * grad E[sum_t D_t] - reward.coef * grad E[r], exactly (float64)."""
    cfg = _config(divergence, estimator, loss, n=n, coef=coef, baseline=baseline, kl_coef=kl_coef)
    got, distill, reward = _expected_gradient(cfg, n, seed=11)
    for mine, d, r in zip(got, distill, reward):
        assert r.abs().max() > 1e-2  # the reward's gradient is not a vacuous 0
        torch.testing.assert_close(mine, kl_coef * d - coef * r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [2, 3])
def test_the_group_mean_baseline_scales_the_reward_gradient_by_n_minus_1_over_n(n):
    """GRPO's mean (the sample's own reward inside its baseline): E[(r_i - mean r) grad log p(y_i)]
    = (n-1)/n grad E[r]; leave-one-out is exact (previous test)."""
    kl_coef, coef = 0.4, 1.0
    cfg = _config({"name": "rkl"}, {"name": "sampled"}, {"name": "reinforce"}, n=n, coef=coef, baseline="group", kl_coef=kl_coef)
    got, distill, reward = _expected_gradient(cfg, n, seed=5)
    for mine, d, r in zip(got, distill, reward):
        torch.testing.assert_close(mine, kl_coef * d - coef * (n - 1) / n * r, rtol=1e-10, atol=1e-12)
        assert (mine - (kl_coef * d - coef * r)).abs().max() > 1e-3  # and not the unscaled one


def test_std_normalisation_is_grpo_s_direction_not_a_gradient_of_the_expected_reward():
    """reward.std_normalize: with a 0/1 verifier and n=2 every mixed pair has std sqrt(1/2), so the
    expected gradient is exactly -coef * (1/2) / (sqrt(1/2) + 1e-6) * grad E[r]; with a real-valued
    score it is not a multiple of grad E[r] at all."""
    cfg = _config({"name": "rkl"}, {"name": "sampled"}, {"name": "reinforce"}, n=2, coef=1.0, baseline="group", kl_coef=0.0)
    got, _, reward = _expected_gradient(cfg, 2, seed=7, std_normalize=True)
    for mine, r in zip(got, reward):
        torch.testing.assert_close(mine, -0.5 / (0.5**0.5 + 1e-6) * r, rtol=1e-10, atol=1e-12)
    got, _, reward = _expected_gradient(cfg, 2, seed=7, std_normalize=True, real=True)
    g, r = torch.cat([x.flatten() for x in got]), torch.cat([x.flatten() for x in reward])
    best = (g @ r) / (r @ r) * r  # the closest multiple of grad E[r]
    assert float((g - best).norm() / g.norm()) > 0.05


def test_group_advantages_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    groups = torch.tensor([0, 0, 0, 7, 7, 7, 3, 3])
    loo = group_advantages(r, groups, "loo")
    torch.testing.assert_close(loo, torch.tensor([1.0, -0.5, -0.5, 0, 0, 0, 0.5, -0.5], dtype=torch.float64))
    grp = group_advantages(r, groups, "group")
    torch.testing.assert_close(grp, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0.25, -0.25], dtype=torch.float64))
    std = group_advantages(r, groups, "group", std_normalize=True)  # unbiased std: sqrt(1/3) and sqrt(1/8)
    want = [2 / 3 / (3**-0.5 + 1e-6), -1 / 3 / (3**-0.5 + 1e-6), -1 / 3 / (3**-0.5 + 1e-6), 0, 0, 0]
    want += [0.25 / (8**-0.5 + 1e-6), -0.25 / (8**-0.5 + 1e-6)]
    torch.testing.assert_close(std, torch.tensor(want, dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(group_advantages(r, groups, "none"), r.double())
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_advantages(r[:4], groups[:4], "loo")  # group 7 has one sample here


def test_with_reward_under_ppo_equals_the_clipped_surrogate_of_the_combined_advantage():
    """At ratio 1 (the objective's own forward), -A_d-clip-surrogate - A_r r has the value and the
    gradient of the clipped surrogate of A_d + A_r."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(3, 5, 7, generator=g, dtype=torch.float64).requires_grad_(True)
    y = torch.randint(0, 7, (3, 5), generator=g)
    a_d, a_r = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    s = token_logprobs(z, y)
    ratio = torch.exp(s - s.detach())
    mine, adv = with_reward(ppo_surrogate(ratio, a_d, 0.2)[0], a_d, a_r, s, ppo=True)
    want = ppo_surrogate(ratio, a_d + a_r, 0.2)[0]
    torch.testing.assert_close(adv, a_d + a_r, rtol=0, atol=0)
    torch.testing.assert_close(mine, want, rtol=1e-15, atol=1e-15)
    g_mine, g_want = (torch.autograd.grad(x.sum(), z, retain_graph=True)[0] for x in (mine, want))
    torch.testing.assert_close(g_mine, g_want, rtol=1e-13, atol=1e-15)


# -- config ---------------------------------------------------------------------


def test_defaults_are_off():
    rw = small_config().reward
    assert (rw.coef, rw.baseline, rw.std_normalize, rw.active) == (0.0, RewardBaseline.loo, False, False)


@pytest.mark.parametrize(
    "groups, line",
    [
        ({"loss": {"kl_coef": 0.0}}, "loss.kl_coef=0.0 is not allowed; allowed: > 0, or 0 with reward.coef > 0 (reward-only RL)"),
        (
            {"reward": {"coef": -1.0}},
            "reward.coef=-1.0 is not allowed; allowed: 0 <= reward.coef <= 1e+06 (0: off; larger scales the loss past float range)",
        ),
        (
            {"reward": {"coef": 1e30}},
            "reward.coef=1e+30 is not allowed; allowed: 0 <= reward.coef <= 1e+06 (0: off; larger scales the loss past float range)",
        ),
        (
            {"loss": {"kl_coef": 1e30}},
            "loss.kl_coef=1e+30 is not allowed; allowed: 0 <= loss.kl_coef <= 1e+06 (larger scales the loss past float range)",
        ),
        (
            {"reward": {"coef": 1.0}},
            "reward.baseline='loo' is not allowed; allowed: none with rollout.n_samples=1 (a group baseline needs at least 2 "
            "samples of each prompt), or rollout.n_samples >= 2",
        ),
        (
            {"reward": {"coef": 1.0, "baseline": RewardBaseline.none, "std_normalize": True}},
            "reward.std_normalize=True is not allowed; allowed: false with reward.baseline=none (the std is taken over a prompt's group)",
        ),
        (
            {"reward": {"coef": 1.0}, "rollout": {"n_samples": 2, "on_policy_fraction": 0.5}},
            "rollout.on_policy_fraction=0.5 is not allowed; allowed: 1.0 with reward.coef=1.0 (the reward's REINFORCE term needs "
            "the student's own samples)",
        ),
        (
            {"reward": {"coef": 0.5, "baseline": RewardBaseline.none}, "positions": {"name": "first_n", "tokens": 2}},
            "positions.name='first_n' is not allowed; allowed: all, first, last, iw_opd or entropy_gate with reward.coef=0.5 "
            "(first_n stops the rollouts early: the verifier would score cut responses)",
        ),
    ],
)
def test_refused_in_one_line(groups, line):
    with pytest.raises(ConfigError) as ex:
        small_config(**groups)
    assert str(ex.value) == line


def test_reward_only_and_extrapolated_reward_are_allowed():
    assert small_config(loss={"kl_coef": 0.0}, reward={"coef": 1.0, "baseline": RewardBaseline.none}).loss.kl_coef == 0.0
    big = small_config(loss={"kl_coef": 1e6}, rollout={"n_samples": 2}, reward={"coef": 1e6})  # the bounds themselves
    assert (big.loss.kl_coef, big.reward.coef) == (1e6, 1e6)
    assert small_config(rollout={"n_samples": 4}, reward={"coef": 3.0, "std_normalize": True}).reward.coef == 3.0


def test_composed_from_the_command_line():
    from helpers.compose import compose_config

    cfg = compose_config("estimator=sampled", "loss=reinforce", "rollout.n_samples=2", "reward.coef=0.5", "reward.baseline=group")
    assert (cfg.reward.coef, cfg.reward.baseline) == (0.5, RewardBaseline.group)
    with pytest.raises(ConfigError, match=r"^reward.baseline='loo' is not allowed"):
        compose_config("reward.coef=1")


# -- the trainer ----------------------------------------------------------------------


class ScoredAddTask(AddTask):
    """AddTask with its own real-valued score (the share of '1' characters), so a random tiny
    student's rewards differ between samples."""

    def score(self, completion: str, problem) -> float:
        return completion.count("1") / max(len(completion), 1)


@pytest.fixture(scope="module")
def pair_root(tmp_path_factory):
    return golden.build_pair(tmp_path_factory.mktemp("reward_pair"))


def _trainer(pair_root, run_dir, task=None, **groups) -> Trainer:
    base = dict(estimator={"name": "sampled"}, loss={"name": "reinforce"}, divergence={"name": "rkl"}, rollout={"engine": "hf"})
    for g, fields in groups.items():
        base[g] = {**base.get(g, {}), **fields}
    return Trainer(small_config(**base), run_dir, pair=golden.load_pair(pair_root), task=task or ScoredAddTask())


def test_off_by_default_nothing_attached_and_no_reward_metrics(pair_root, tmp_path):
    with golden.float64():
        t = _trainer(pair_root, tmp_path)
        assert t.sample(0).reward_advantages is None
        m = t.train_step()
    assert not any(k.startswith("reward/") for k in m)


def _step_problems(t) -> list:
    """The problems the trainer's next ``sample`` draws (a copy of its data cursor)."""
    from opd_exp.training.state import DataCursor

    cursor = DataCursor(len(t.train_problems), t.cfg.seed)
    cursor.load_state_dict(t.state.cursor.state_dict())
    return [t.train_problems[i] for i in cursor.next(t.cfg.trainer.batch_size)]


def _rewards(task, batch, problems, tokenizer) -> torch.Tensor:
    from opd_exp.training.rollout import decode_responses

    rows = zip(decode_responses(tokenizer, batch), batch.prompt_index.tolist())
    if hasattr(task, "score"):
        return torch.tensor([task.score(x, problems[i]) for x, i in rows], dtype=torch.float64)
    return torch.tensor([float(task.verify(x, problems[i].answer)) for x, i in rows], dtype=torch.float64)


@pytest.mark.parametrize("task", [ScoredAddTask(), AddTask()], ids=["score", "verify"])
def test_reward_metrics_are_the_sampled_rollouts_scores(pair_root, tmp_path, task):
    """reward/mean is the mean score of the step's decoded rows; with a 0/1 verifier, their accuracy."""
    with golden.float64():
        t = _trainer(pair_root, tmp_path, task=task, rollout={"n_samples": 2}, reward={"coef": 1.0, "baseline": RewardBaseline.group})
        problems = _step_problems(t)
        batch = t.sample(0)
        m = dict(t.reward.metrics)
        assert set(REWARD_METRICS) <= set(t.train_step())
    r = _rewards(task, batch, problems, t.tokenizer)
    assert list(m) == list(REWARD_METRICS)
    assert m["reward/mean"] == pytest.approx(float(r.mean()), abs=1e-12)
    assert m["reward/std"] == pytest.approx(float(r.std(correction=0)), abs=1e-12)
    assert m["reward/advantage_mean"] == pytest.approx(0.0, abs=1e-12)  # a group's advantages sum to 0
    if isinstance(task, ScoredAddTask):
        assert float(r.std()) > 0


def test_reward_only_gradient_is_the_reinforce_term_on_the_batch(pair_root, tmp_path):
    """kl_coef=0: the step's gradient is that of -sum_i A_i sum_t log S(y_it) / (response tokens),
    A_i = coef * (r_i - mean of the other samples), computed here from the decoded batch."""
    coef = 1.7
    with golden.float64():
        t = _trainer(pair_root, tmp_path, loss={"kl_coef": 0.0}, rollout={"n_samples": 2}, reward={"coef": coef})
        problems = _step_problems(t)
        batch = t.sample(0)
        r = _rewards(t.task, batch, problems, t.tokenizer)
        assert r.std() > 0  # the advantages are not all 0
        adv = coef * group_advantages(r, batch.prompt_index, "loo")
        torch.testing.assert_close(batch.reward_advantages, adv.unsqueeze(-1) * batch.response_mask, rtol=0, atol=1e-15)
        t.optimizer.zero_grad(set_to_none=True)
        t.accumulate(batch)
        got = [p.grad.clone() for p in t.params]
        t.optimizer.zero_grad(set_to_none=True)
        s = token_logprobs(t.student_logits(t.student, batch), batch.response_ids)
        loss = -(adv.unsqueeze(-1) * torch.where(batch.response_mask, s, torch.zeros_like(s))).sum() / batch.num_response_tokens
        want = torch.autograd.grad(loss, t.params)
    assert max(float(g.abs().max()) for g in got) > 1e-4
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)


def test_ppo_updates_keep_the_combined_advantage(pair_root, tmp_path):
    """Several PPO updates: every update's stored advantages are the scoring pass's distillation
    advantages plus the reward's (kl_coef=0 here: exactly the reward's), row by row."""
    with golden.float64():
        t = _trainer(
            pair_root,
            tmp_path,
            loss={"name": "ppo", "kl_coef": 0.0, "ppo_epochs": 2, "ppo_mini_batches": 2},
            rollout={"n_samples": 2},
            reward={"coef": 1.0},
        )
        seen = []
        update = t.ppo._update
        t.ppo._update = lambda group, stats: (seen.extend(group), update(group, stats))[1]
        m = t.train_step()
    assert (
        sum(p.batch.num_sequences for p in seen) == 2 * 8 and m["ppo/skipped_updates"] == 0
    )  # 2 epochs over 8 rows and set(REWARD_METRICS) <= set(m)
    assert any(float(p.advantages.abs().max()) > 0 for p in seen)
    for p in seen:
        torch.testing.assert_close(p.advantages, p.batch.reward_advantages * p.counted, rtol=0, atol=0)


def test_one_ppo_update_with_a_reward_equals_reinforce_with_it(pair_root, tmp_path):
    with golden.float64():
        weights = {}
        for form in ("ppo", "reinforce"):
            t = _trainer(pair_root, tmp_path / form, loss={"name": form, "kl_coef": 0.5}, rollout={"n_samples": 2}, reward={"coef": 2.0})
            for _ in range(2):
                t.train_step()
            weights[form] = [p.detach().clone() for p in t.student.parameters()]
    for a, b in zip(weights["ppo"], weights["reinforce"]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_opd_train_with_a_reward_on_the_embedded_world_logs_reward_metrics(tmp_path):
    """`opd-train ... reward.coef=2` on the shipped embedded world: every step row has reward/*;
    the arithmetic verifier is 0/1, so reward/mean is a share of the step's 8 sampled rows."""
    import json
    import os
    import subprocess
    import sys

    args = [
        "estimator=sampled",
        "loss=reinforce",
        "divergence=rkl",
        "rollout.n_samples=2",
        "reward.coef=2",
        "trainer.max_steps=3",
        "trainer.batch_size=4",
        "eval.size=8",
        "scale.num_threads=1",
        "trainer.progress=false",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    done = subprocess.run([sys.executable, "-m", "opd_exp.cli.train", *args], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert not any(k.startswith("reward/") for k in rows[0])  # the eval before training
    for r in rows[1:]:
        assert 0.0 <= r["reward/mean"] <= 1.0 and (8 * r["reward/mean"]) == pytest.approx(round(8 * r["reward/mean"]), abs=1e-9)
        assert r["reward/std"] == pytest.approx(math.sqrt(r["reward/mean"] * (1 - r["reward/mean"])), abs=1e-9)  # 0/1 rewards
        assert r["reward/advantage_mean"] == pytest.approx(0.0, abs=1e-12)
