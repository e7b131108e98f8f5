"""PPO with several updates per rollout (loss.ppo_epochs, loss.ppo_mini_batches): the surrogate's
gradient at ratio 1 is REINFORCE's (and the exact divergence gradient), the ratio moves after the
first update and the clip acts, the mini-batch's token count normalises its gradient, and the
one-update default is unchanged (the golden runs pin it)."""

from __future__ import annotations

import pytest
import torch

from helpers import golden
from helpers.tiny import AddTask, small_config
from opd_exp.divergences import DIVERGENCES, get_divergence
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.objective import Objective, ppo_surrogate
from opd_exp.training.ppo import select_rows
from opd_exp.training.trainer import Trainer

PPO = dict(estimator={"name": "sampled"}, loss={"name": "ppo"}, divergence={"name": "rkl"})
EXACT = [n for n in DIVERGENCES if get_divergence(n).exact_cost]  # what is registered, minus the wrong-on-purpose


def groups(**changes):
    out = {g: dict(v) for g, v in PPO.items()}
    out.setdefault("rollout", {})["engine"] = "hf"
    for g, fields in changes.items():
        out.setdefault(g, {}).update(fields)
    return out


@pytest.fixture(scope="module")
def pair_root(tmp_path_factory):
    return golden.build_pair(tmp_path_factory.mktemp("ppo_pair"))


def trainer64(pair_root, run_dir, **changes) -> Trainer:
    """A float64 trainer on the golden pair (call inside ``golden.float64()``)."""
    return Trainer(small_config(**groups(**changes)), run_dir, pair=golden.load_pair(pair_root), task=AddTask())


# -- config -------------------------------------------------------------------


def test_defaults_are_one_update_per_rollout():
    lo = small_config(**PPO).loss
    assert (lo.ppo_epochs, lo.ppo_mini_batches, lo.ppo_updates) == (1, 1, 1)


@pytest.mark.parametrize(
    "changes, line",
    [
        (
            {"loss": {"ppo_epochs": 0}},
            "loss.ppo_epochs=0 is not allowed; allowed: integer >= 1",
        ),
        (
            {"loss": {"ppo_mini_batches": 0}},
            "loss.ppo_mini_batches=0 is not allowed; allowed: integer >= 1",
        ),
        (
            {"loss": {"name": "reinforce", "ppo_epochs": 2}},
            "loss.ppo_epochs=2 is not allowed; allowed: 1 with loss=reinforce estimator=sampled (several updates per rollout "
            "need loss=ppo estimator=sampled)",
        ),
        (
            {"loss": {"ppo_mini_batches": 2}, "rollout": {"on_policy_fraction": 0.5}},
            "loss.ppo_mini_batches=2 is not allowed; allowed: 1 with rollout.on_policy_fraction=0.5 (teacher-sampled steps use "
            "the exact full-vocabulary loss, which has no behaviour policy to clip against); allowed: rollout.on_policy_fraction=1.0",
        ),
        (
            {"loss": {"ppo_mini_batches": 5}},
            "loss.ppo_mini_batches=5 is not allowed; allowed: at most the rollout's 4 rows (trainer.batch_size x rollout.n_samples)",
        ),
    ],
)
def test_refused_in_one_line(changes, line):
    from opd_exp.config import schema as S

    with pytest.raises(ConfigError) as ex:
        g = groups(**changes)
        for group in ("trainer", "scale"):
            if "fused_lm_head" in g.get(group, {}):
                g[group]["fused_lm_head"] = S.FusedLmHead(g[group]["fused_lm_head"])
        small_config(**g)
    assert str(ex.value) == line


def test_the_fused_head_on_auto_is_picked_for_several_updates_too():
    from types import SimpleNamespace

    from opd_exp.training.fused import use_fused_lm_head

    def cfg(updates):
        return SimpleNamespace(
            scale=SimpleNamespace(fused_lm_head=SimpleNamespace(value="auto"), parallel=SimpleNamespace(value="none"), lora_rank=0),
            loss=SimpleNamespace(ppo_updates=updates),
            teacher=SimpleNamespace(served=False, align="none"),
            teachers=SimpleNamespace(active=False),
            rollout=SimpleNamespace(staleness=0),
            estimator=SimpleNamespace(baseline=SimpleNamespace(value="none")),
        )

    # a model the fused path supports, at a vocabulary where auto would pick it
    from transformers import AutoModelForCausalLM, Qwen2Config

    m = AutoModelForCausalLM.from_config(
        Qwen2Config(vocab_size=40000, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    )
    assert use_fused_lm_head(cfg(1), m, m, 40000) is True
    assert use_fused_lm_head(cfg(4), m, m, 40000) is True  # several updates go through the fused head too


# -- the surrogate, by enumeration ---------------------------------------------


@pytest.mark.parametrize("name", EXACT)
def test_surrogate_gradient_at_ratio_one_is_reinforce_and_the_exact_gradient(name):
    """Tabular student over V tokens, A = -c(y) the exact cost: grad of E_{y~S_old}[PPO surrogate]
    at S = S_old equals grad of E[-A log S(y)] (REINFORCE) and grad D(S, T), in float64."""
    V = 7
    g = torch.Generator().manual_seed(3)
    z = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_(True)
    zt = torch.randn(V, generator=g, dtype=torch.float64)
    d = get_divergence(name)
    s, t = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    s0 = s.detach()
    adv = -d.token_cost(s0, t)
    ppo = (s0.exp() * ppo_surrogate(torch.exp(s - s0), adv, 0.2)[0]).sum()
    reinforce = (s0.exp() * (-adv * s)).sum()
    exact = d.full(z.view(1, 1, V), zt.view(1, 1, V)).sum()
    grads = [torch.autograd.grad(f, z, retain_graph=True)[0] for f in (ppo, reinforce, exact)]
    assert grads[0].abs().max() > 1e-3  # not a vacuous 0 == 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grads[0], grads[2], rtol=1e-10, atol=1e-12)


def test_beyond_the_clip_a_token_gives_no_gradient_and_inside_it_the_importance_weighted_one():
    """Away from S_old: E_{S_old}[surrogate] has gradient sum_y S_old(y) [clip not active] (-A r grad log S(y))."""
    V, eps = 6, 0.2
    g = torch.Generator().manual_seed(5)
    z_old = torch.randn(V, generator=g, dtype=torch.float64)
    z = (z_old + 0.6 * torch.randn(V, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(V, generator=g, dtype=torch.float64)
    s, s_old = torch.log_softmax(z, -1), torch.log_softmax(z_old, -1)
    ratio = torch.exp(s - s_old)
    per_token, active = ppo_surrogate(ratio, adv, eps)
    assert 0 < int(active.sum()) < V  # some tokens clipped, some not
    r = ratio.detach()
    assert bool((active == (((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps)))).all())
    got = torch.autograd.grad((s_old.exp() * per_token).sum(), z, retain_graph=True)[0]
    jac = torch.autograd.functional.jacobian(lambda x: torch.log_softmax(x, -1), z.detach())  # [V(y), V(z)]
    want = ((s_old.exp() * (~active) * (-adv) * r).unsqueeze(-1) * jac).sum(0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    unclipped = torch.autograd.grad((s_old.exp() * (-adv * ratio)).sum(), z)[0]
    assert (got - unclipped).abs().max() > 1e-3  # the clip changed the gradient


# -- the loop ------------------------------------------------------------------


def test_one_update_per_rollout_equals_reinforce(pair_root, tmp_path):
    """ppo_epochs=1, ppo_mini_batches=1: the ratio is 1, so ppo trains exactly as reinforce does."""
    with golden.float64():
        runs = {}
        for form in ("ppo", "reinforce"):
            t = trainer64(pair_root, tmp_path / form, loss={"name": form}, trainer={"max_steps": 2})
            norms = [t.train_step()["grad/norm"] for _ in range(2)]
            runs[form] = (norms, [p.detach().clone() for p in t.student.parameters()])
    # the losses' values differ (-A r = -A vs -A log S), their gradients do not
    assert runs["ppo"][0] == pytest.approx(runs["reinforce"][0], rel=1e-13)
    for a, b in zip(runs["ppo"][1], runs["reinforce"][1]):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def test_the_ratio_moves_after_the_first_update_and_the_clip_acts(pair_root, tmp_path):
    """Two epochs of two mini-batches at a large lr: the first update's ratio is exactly 1 (the
    behaviour log-probs are the trainer's own), every later one sees r != 1, the clip is active
    on some tokens, and the metrics say so. Fails if the old log-probs followed the student."""
    with golden.float64():
        t = trainer64(pair_root, tmp_path, loss={"ppo_epochs": 2, "ppo_mini_batches": 2}, trainer={"lr": 0.05, "max_steps": 1})
        m = t.train_step()
    ups = t.ppo.last_updates
    assert len(ups) == 4
    assert ups[0]["ratio_min"] == ups[0]["ratio_max"] == 1.0 and ups[0]["clip_frac"] == 0.0
    for u in ups[1:]:
        assert max(u["ratio_max"] - 1, 1 - u["ratio_min"]) > 1e-3
    assert max(u["clip_frac"] for u in ups[1:]) > 0
    assert m["ppo/clip_frac"] > 0 and m["ppo/approx_kl"] > 0 and m["ppo/skipped_updates"] == 0
    assert m["ppo/ratio_min"] < 1 < m["ppo/ratio_max"]
    assert m["ppo/ratio_min"] <= m["ppo/ratio_mean"] <= m["ppo/ratio_max"]
    n = sum(u["tokens"] for u in ups)
    assert m["ppo/clip_frac"] == pytest.approx(sum(u["clip_frac"] * u["tokens"] for u in ups) / n, rel=1e-12)


def test_ppo_and_reinforce_differ_when_the_clip_acts(pair_root, tmp_path):
    """Same rollout, three epochs: the clipped updates move the weights elsewhere than the one
    REINFORCE update, and elsewhere than the same epochs with a wider clip (acting less)."""
    with golden.float64():
        out = {}
        for name, loss in (
            ("reinforce", {"name": "reinforce"}),
            ("ppo", {"ppo_epochs": 3, "clip_eps": 0.1}),
            ("wide", {"ppo_epochs": 3, "clip_eps": 0.999999}),
        ):
            t = trainer64(pair_root, tmp_path / name, loss=loss, trainer={"lr": 0.05, "max_steps": 1})
            m = t.train_step()
            out[name] = (m, torch.cat([p.detach().reshape(-1) for p in t.student.parameters()]))
    assert out["ppo"][0]["ppo/clip_frac"] > out["wide"][0]["ppo/clip_frac"]
    assert (out["ppo"][1] - out["reinforce"][1]).abs().max() > 1e-4
    assert (out["ppo"][1] - out["wide"][1]).abs().max() > 1e-6


def _recording_sgd(params, lr):
    """SGD (linear in the gradient, unlike Adam) that keeps a copy of every gradient it applied."""
    opt = torch.optim.SGD(params, lr=lr)
    opt.seen = []
    step = opt.step

    def recorded(*a, **k):
        opt.seen.append([p.grad.detach().clone() for p in params])
        return step(*a, **k)

    opt.step = recorded
    return opt


@pytest.mark.parametrize("micro", [0, 1])
def test_each_update_is_normalised_by_its_mini_batch_token_count(pair_root, tmp_path, micro):
    """The first update's gradient is REINFORCE's over the first mini-batch's rows divided by
    that mini-batch's response-token count, whatever the micro-batch size (accumulation)."""
    with golden.float64():
        t = trainer64(pair_root, tmp_path, loss={"ppo_mini_batches": 2}, trainer={"micro_batch_size": micro, "max_steps": 1})
        t.ppo.optimizer = opt = _recording_sgd(t.params, lr=0.1)
        batch = t.sample(0)
        first = t.ppo._order(batch.num_sequences, 1, 0)[0]
        t.ppo.step(batch, batch.num_response_tokens, 1)
        assert len(opt.seen) == 2
        # REINFORCE on the same rows, from the weights before any update
        fresh = trainer64(pair_root, tmp_path / "ref", loss={"name": "reinforce"})
        mb = select_rows(batch, first)
        n_mb = mb.num_response_tokens
        assert 0 < n_mb < batch.num_response_tokens
        ref = Objective(fresh.cfg)
        with torch.no_grad():
            zt = fresh.teacher_scorer.submit(mb).result()
        zs = fresh.student_logits(fresh.student, mb)
        ref(zs, zt, mb.response_ids, mb.response_mask, on_policy=True, normalizer=n_mb).loss.backward()
        want = [p.grad for p in fresh.params]
    for got, w in zip(opt.seen[0], want):
        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-13)


def test_micro_batch_size_does_not_change_the_updates(pair_root, tmp_path):
    with golden.float64():
        weights = []
        for micro in (0, 1):
            t = trainer64(
                pair_root, tmp_path / str(micro), loss={"ppo_epochs": 2, "ppo_mini_batches": 2}, trainer={"micro_batch_size": micro}
            )
            t.ppo.optimizer = _recording_sgd(t.params, lr=0.2)
            t.train_step()
            weights.append(torch.cat([p.detach().reshape(-1) for p in t.student.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-10, atol=1e-12)


def test_a_non_finite_update_is_skipped_alone(pair_root, tmp_path, monkeypatch):
    """The guard acts per update: a NaN gradient in one update leaves the others applied and the
    step counted as trained; NaN in all of them skips the step."""
    with golden.float64():
        t = trainer64(pair_root, tmp_path, loss={"ppo_mini_batches": 2}, trainer={"max_steps": 2})
        calls = {"n": 0}
        clip = torch.nn.utils.clip_grad_norm_

        def second_is_nan(params, max_norm):
            calls["n"] += 1
            return torch.tensor(float("nan")) if calls["n"] == 2 else clip(params, max_norm)

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", second_is_nan)
        before = [p.detach().clone() for p in t.student.parameters()]
        m = t.train_step()
        assert m["ppo/skipped_updates"] == 1 and m["grad/skipped"] == 0 and t.state.guard.skipped_steps == 0
        assert any((a != p).any() for a, p in zip(before, t.student.parameters()))
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(float("nan")))
        before = [p.detach().clone() for p in t.student.parameters()]
        m = t.train_step()
        assert m["ppo/skipped_updates"] == 2 and m["grad/skipped"] == 1 and t.state.guard.skipped_steps == 1
        assert all((a == p).all() for a, p in zip(before, t.student.parameters()))


# -- the warning when a sampled run's eval divergence keeps rising ---------------


def test_eval_rise_is_said_once_after_three_evals_in_a_row_above_the_start():
    from opd_exp.training.advice import EvalRise

    w = EvalRise("eval/rkl", "sampled", 3e-3)
    before = {"eval/rkl": 1.0}
    said = [w.update(before, {"eval/rkl": v}, step) for step, v in enumerate((1.2, 1.1, 0.9, 1.3, 1.4, 1.5, 1.6, 1.7), 1)]
    assert [i for i, line in enumerate(said) if line] == [5]  # the dip at the third eval restarts the count; said once
    assert said[5] == (
        "opd-train: warning: eval/rkl has been above its value before training (1) for 3 evals in a row (now 1.5 at step 6) "
        "with estimator=sampled estimator.baseline=none at trainer.lr=0.003: the sampled estimator's one-token gradient is "
        "noisy and this lr makes the student worse; try estimator.baseline=exact (topk with a served teacher) and "
        "trainer.lr=0.001 (estimator=sampled's defaults, measured on the embedded pair; docs/training.md)"
    )
    defaults = "(estimator=sampled's defaults, measured on the embedded pair; docs/training.md)"
    ends = {
        (3e-4, "none"): f"try estimator.baseline=exact (topk with a served teacher) {defaults}",
        (3e-3, "exact"): f"try trainer.lr=0.001 {defaults}",
        (1e-3, "topk"): "try a lower trainer.lr, or estimator=full|topk_student (docs/training.md)",
    }
    for (lr, baseline), end in ends.items():
        w = EvalRise("eval/rkl", "sampled", lr, baseline)
        lines = [w.update(before, {"eval/rkl": 2.0}, s) for s in (1, 2, 3)]
        assert lines[:2] == [None, None] and lines[2].endswith(end)
    assert EvalRise("eval/rkl", "sampled", 3e-3).update({}, {"eval/rkl": 2.0}, 1) is None  # no value before: nothing


def test_a_sampled_run_whose_eval_divergence_rises_warns_once(pair_root, tmp_path, monkeypatch):
    values = iter((1.0, 1.5, 1.6, 1.7, 1.8, 1.9))
    with golden.float64():
        t = trainer64(pair_root, tmp_path, loss={"name": "reinforce"}, trainer={"max_steps": 5, "eval_every": 1})
        monkeypatch.setattr(t, "evaluate", lambda: dict.fromkeys(("eval/kl_reverse", "eval/rkl"), next(values)))
        t.run()
        full = trainer64(pair_root, tmp_path / "full", estimator={"name": "full"}, loss={"name": "direct"})
    log = (tmp_path / "train.log").read_text()
    assert log.count("opd-train: warning: eval/rkl has been above its value before training (1) for 3 evals") == 1
    assert "(now 1.7 at step 3) with estimator=sampled estimator.baseline=none at trainer.lr=0.01" in log
    assert full.eval_rise is None  # the exact estimator is not watched


def test_several_updates_under_a_sampling_filter_never_skip_on_masked_positions(pair_root, tmp_path):
    """rollout.top_k: a pad or filtered-out token holds log S = -1e9 in the behaviour log-probs;
    after an update it may be inside the filter (s - old ~ +1e9). Masked positions must not enter
    the ratio (exp -> inf, 0 * inf = NaN in backward): every update is applied, every statistic finite."""
    import math

    with golden.float64():
        t = trainer64(
            pair_root, tmp_path, loss={"ppo_epochs": 3, "ppo_mini_batches": 2}, rollout={"top_k": 3}, trainer={"lr": 0.05, "max_steps": 2}
        )
        for _ in range(2):
            m = t.train_step()
            assert m["ppo/skipped_updates"] == 0 and m["grad/skipped"] == 0.0
            assert all(math.isfinite(m[k]) for k in ("ppo/approx_kl", "ppo/ratio_mean", "ppo/ratio_max", "ppo/ratio_min", "loss"))


def test_approx_kl_and_clip_frac_leave_out_tokens_pushed_out_of_the_filter():
    """A token an update pushed out of the sampling filter (log S = -1e9, r = 0) has no finite KL term:
    ppo/approx_kl and ppo/clip_frac are over the other tokens, ppo/filtered_out_frac counts it."""
    import math
    import types

    from opd_exp.training.ppo import Piece, PpoUpdates
    from opd_exp.training.rollout import FILTERED_LOGIT

    V, R = 4, 3
    z = torch.nn.Parameter(torch.zeros(1, R, V, dtype=torch.float64))
    new = torch.tensor([[[0.5, 0.0, 0.0, 0.0], [0.0, 0.2, 0.0, 0.0], [FILTERED_LOGIT, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    ids = torch.zeros(1, 2 + R, dtype=torch.long)  # the sampled token is 0 at every position
    batch = types.SimpleNamespace(response_ids=ids[:, 2:], num_trained_tokens=R, num_sequences=1)
    old = torch.full((1, R), math.log(0.25), dtype=torch.float64)
    from opd_exp.training.heads import ratio_terms
    from opd_exp.training.scoring import token_logprobs

    def ratio_backward(b, fixed, *, eps, normalizer):  # the materialised head's, on these logits
        s = token_logprobs(new + 0 * z, b.response_ids)
        loss, ratio, clip = ratio_terms(s, fixed.old_logprobs, fixed.advantages, fixed.counted, eps, normalizer)
        loss.backward()
        return float(loss), ratio.detach(), clip

    upd = PpoUpdates(
        small_config(loss={"name": "ppo"}, estimator={"name": "sampled"}),
        head=types.SimpleNamespace(ratio_backward=ratio_backward),
        check_teacher=lambda scores: None,
        optimizer=torch.optim.SGD([z], lr=0.0),
        params=[z],
        warn=print,
    )
    stats = {"tokens": 0.0, "filtered_out": 0.0, "clipped": 0.0, "ratio": 0.0, "kl": 0.0, "max": -math.inf, "min": math.inf}
    piece = Piece(batch, old, torch.ones(1, R, dtype=torch.float64), torch.ones(1, R, dtype=torch.bool))
    _, _, problem, record = upd._update([piece], stats)
    lp = torch.log_softmax(new, -1)[0, :2, 0]
    r = torch.exp(lp - math.log(0.25))
    assert problem is None and record["tokens"] == 2.0 and record["filtered_out"] == 1.0
    assert stats["kl"] == pytest.approx(float(((r - 1) - torch.log(r)).sum()), rel=1e-12)  # no ~707 from the filtered token
    assert record["clip_frac"] == pytest.approx(float((r > 1.2).sum()) / 2)


@pytest.mark.parametrize("groups_", [
    dict(loss={"name": "ppo", "ppo_epochs": 2}),
    dict(loss={"name": "ppo", "ppo_epochs": 2, "ppo_mini_batches": 2}, trainer={"micro_batch_size": 1}),
    dict(loss={"name": "ppo", "ppo_epochs": 2, "credit": "sequence", "gamma": 0.9}, divergence={"name": "jsd", "beta": 0.3}),
])  # fmt: skip
def test_several_ppo_updates_through_the_fused_head_equal_the_materialised_path(groups_, pair_root, tmp_path):
    """The fused head scores the rollout once and runs each update's ratio loss a chunk of positions
    at a time: the same losses, metrics and weights as the materialised head (float64, 3 steps)."""
    runs = {}
    with golden.float64():
        for head in ("off", "on"):
            g = {k: dict(v) for k, v in groups_.items()}
            g.setdefault("trainer", {}).update(max_steps=3)
            g["scale"] = {"fused_lm_head": head}
            g["estimator"] = {"name": "sampled", "chunk_size": 3}  # several chunks per micro-batch
            t = trainer64(pair_root, tmp_path / head, **g)
            assert type(t.head).__name__ == ("FusedHead" if head == "on" else "MaterialisedHead")
            runs[head] = ([t.train_step() for _ in range(3)], [p.detach().clone() for p in t.params])
    (off, w_off), (on, w_on) = runs["off"], runs["on"]
    for a, b in zip(off, on):
        for k in ("loss", "kl/reverse", "jsd/mean", "grad/norm", "ppo/approx_kl", "ppo/clip_frac", "ppo/ratio_mean", "advantages/mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-12), k
    assert off[-1]["ppo/approx_kl"] > 0  # later updates moved off the behaviour policy
    for a, b in zip(w_off, w_on):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
