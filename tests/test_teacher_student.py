"""Teachers made from the student (teacher=ema|lagged|live) and privileged context.

- the EMA and lag updates equal a hand loop in float64, on every applied update (PPO's too);
- a live teacher's gradient is autograd of D(S || stopgrad(S_c)) by enumeration over the
  vocabulary on a model whose student and teacher views share every weight, for every divergence,
  with the sampled and the full estimator (and is not the gradient without the stop-gradient);
- privileged scoring scores every response position exactly once (an off-by-one view fails);
- the teacher state travels in the checkpoint: a resumed EMA / lagged run equals the straight one
  bit for bit; a teacher=live run learns from nothing but the context."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from helpers.tiny import AddTask, small_config
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.batch import Batch, positions_from_mask
from opd_exp.training.objective import Objective
from opd_exp.training.teacher_prompt import TeacherPrompt
from opd_exp.training.teacher_student import EmaTeacher, LaggedTeacher, LiveTeacher, frozen_copy
from opd_exp.training.trainer import Trainer

EXACT = ["rkl", "fkl", "jsd", "skl", "srkl", "tvd"]


def _pair(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    return SimpleNamespace(
        student=AutoModelForCausalLM.from_pretrained(tiny_dir / "student"),
        teacher=AutoModelForCausalLM.from_pretrained(tiny_dir / "teacher"),
        tokenizer=tok,
        vocab_size=len(tok),
    )


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- the updates, against a hand loop -----------------------------------------------------
def _perturb(model, g):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def test_ema_and_lagged_updates_equal_a_hand_loop_in_float64(tiny_dir):
    student = _pair(tiny_dir).student.double()
    start = {n: p.detach().clone() for n, p in student.named_parameters()}
    ema = EmaTeacher(frozen_copy(student), 8, decay=0.75, temperature=1.0, device="cpu")
    lag = LaggedTeacher(frozen_copy(student), 8, refresh_every=3, temperature=1.0, device="cpu")
    hand_ema, hand_lag = dict(start), dict(start)
    g = torch.Generator().manual_seed(0)
    for k in range(1, 8):
        _perturb(student, g)
        ema.sync(student, k)
        lag.sync(student, k)
        now = {n: p.detach().clone() for n, p in student.named_parameters()}
        hand_ema = {n: 0.75 * hand_ema[n] + 0.25 * now[n] for n in now}
        if k % 3 == 0:
            hand_lag = dict(now)
        for n, p in ema.model.named_parameters():
            torch.testing.assert_close(p, hand_ema[n], rtol=1e-15, atol=1e-15)
        for n, p in lag.model.named_parameters():
            assert torch.equal(p, hand_lag[n]), (k, n)
    assert lag.metrics()["self/lag_updates"] == 1.0  # 7 updates, refreshed at 6
    assert not any(p.requires_grad for p in ema.model.parameters())


def test_every_ppo_update_moves_the_ema_teacher(tiny_dir, tmp_path):
    cfg = small_config(
        teacher={"name": "ema", "decay": 0.5},
        estimator={"name": "sampled"},
        loss={"name": "ppo", "ppo_epochs": 2, "ppo_mini_batches": 2},
        trainer={"max_steps": 1},
    )
    tr = Trainer(cfg, tmp_path, pair=_pair(tiny_dir), task=AddTask())
    calls = []
    real = tr.teacher_scorer.sync
    tr.teacher_scorer.sync = lambda s, step: (calls.append(step), real(s, step))
    tr.run()
    assert calls == [1, 1, 1, 1]  # 2 epochs x 2 mini-batches, each an applied update of step 1
    assert tr.teacher_scorer.updates == 4


# -- a live teacher's gradient, by enumeration ----------------------------------------------
class BagLM(torch.nn.Module):
    """logits at position i = sum_{j <= i} A[x_j]: every view of a sequence reads the same table A,
    so a teacher that is the student under another prompt shares every weight with it."""

    def __init__(self, V: int, g: torch.Generator):
        super().__init__()
        self.A = torch.nn.Parameter(torch.randn(V, V, generator=g, dtype=torch.float64))

    def forward(self, input_ids, attention_mask, position_ids=None, logits_to_keep=0, use_cache=False):
        z = (self.A[input_ids] * attention_mask[..., None]).cumsum(1)
        return SimpleNamespace(logits=z)


def _views(V: int):
    """One row: student prompt [2], the teacher's [4, 2] (context 4 first), response of one token."""

    def batch(prompt, y):
        ids = torch.tensor([[*prompt, y]])
        mask = torch.ones_like(ids)
        return Batch(
            ids, mask, positions_from_mask(mask), len(prompt), torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long)
        )

    return lambda y: __import__("dataclasses").replace(batch([2], y), teacher_view=batch([4, 2], y))


def _exact(div: str, zs: torch.Tensor, zt: torch.Tensor, beta: float = 0.3, alpha: float = 0.2) -> torch.Tensor:
    """D(S, T) over the vocabulary from the two logit vectors, written out (DESIGN.md's table)."""
    S, T = torch.softmax(zs, -1), torch.softmax(zt, -1)
    kl = lambda p, q: (p * (p.log() - q.log())).sum()
    if div == "rkl":
        return kl(S, T)
    if div == "fkl":
        return kl(T, S)
    if div == "jsd":
        M = beta * T + (1 - beta) * S
        return beta * kl(T, M) + (1 - beta) * kl(S, M)
    if div == "skl":
        return kl(T, alpha * T + (1 - alpha) * S)
    if div == "srkl":
        return kl(S, alpha * S + (1 - alpha) * T)
    assert div == "tvd", div
    return 0.5 * (S - T).abs().sum()


@pytest.mark.parametrize("estimator", ["sampled", "full"])
@pytest.mark.parametrize("div", EXACT)
def test_a_live_teacher_follows_the_gradient_of_D_to_its_stopped_self(div, estimator):
    V = 6
    model = BagLM(V, torch.Generator().manual_seed(3))
    live = LiveTeacher(model, V, temperature=1.0, device="cpu")
    view = _views(V)
    cfg = small_config(
        divergence={"name": div, "beta": 0.3, "alpha": 0.2},
        estimator={"name": estimator, **({"baseline": "none"} if estimator == "sampled" else {})},
        loss={"name": "reinforce"},
    )
    obj = Objective(cfg, vocab_size=V)

    def student_z(b):
        return model(b.input_ids, b.attention_mask).logits[:, b.prompt_len - 1 : -1]

    # exact: D(S || stopgrad(S_c)) at the one position, by autograd of our own formula
    zs, zt = student_z(view(0)), student_z(view(0).teacher_view)
    # the scorer hands teacher logits over in float32 (every scorer does): the reference rounds them alike
    (exact,) = torch.autograd.grad(_exact(div, zs, zt.detach().float().double()), model.A, retain_graph=True)
    # without the stop-gradient: another vector (the test could tell them apart)
    (both,) = torch.autograd.grad(_exact(div, zs, zt), model.A)

    probs = torch.softmax(zs.detach(), -1)[0, 0]
    got = torch.zeros_like(model.A)
    for y in range(V) if estimator == "sampled" else [0]:
        b = view(y)
        scores = live.score(b)
        assert not scores.logits.requires_grad
        out = obj(student_z(b), scores, b.response_ids, b.trained_mask, on_policy=True, normalizer=1)
        (g,) = torch.autograd.grad(out.loss, model.A)
        got += (probs[y] if estimator == "sampled" else 1.0) * g
    # float32 teacher log-probs bound the agreement at ~1e-6 relative; the gradient without the
    # stop-gradient is 1e3-1e5 times farther away
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-8)
    assert (both - exact).abs().max() > 1e-3


# -- privileged scoring: every response position exactly once ------------------------------------
def test_privileged_view_scores_each_response_position_once(tiny_dir):
    pair = _pair(tiny_dir)
    task = AddTask()
    problems = task.train_problems()[:3]
    tp = TeacherPrompt(task, pair.tokenizer, "solution", max_prompt_tokens=8)
    from opd_exp.training.rollout import encode_prompts

    ids, mask = encode_prompts(pair.tokenizer, [p.prompt for p in problems], 8)
    response = torch.tensor([[5, 6, 1, 0], [7, 1, 0, 0], [8, 9, 10, 11]])
    plain = Batch.from_responses(ids, mask, response, [1])
    batch = tp.attach(plain, problems)
    view = batch.teacher_view
    assert torch.equal(view.response_ids, batch.response_ids) and view.prompt_len > batch.prompt_len
    teacher = LiveTeacher(pair.teacher, pair.vocab_size, temperature=1.0, device="cpu")
    got = teacher.logits(batch)
    with torch.no_grad():  # the teacher read by hand: position P'-1+i predicts response token i
        full = pair.teacher(input_ids=view.input_ids, attention_mask=view.attention_mask, position_ids=view.position_ids).logits
    P = view.prompt_len
    for i in range(response.shape[1]):
        torch.testing.assert_close(got[:, i], full[:, P - 1 + i, : pair.vocab_size])
        if i:
            assert not torch.allclose(got[:, i], full[:, P - 2 + i, : pair.vocab_size])  # off by one would fail
    # the context is in the teacher's prompt, never the student's
    text = pair.tokenizer.decode(view.input_ids[0, :P][view.attention_mask[0, :P].bool()])
    assert text.endswith(problems[0].prompt) and int(view.attention_mask[0, :P].sum()) > int(mask[0].sum()) + len(problems[0].solution)
    assert torch.equal(batch.input_ids, plain.input_ids) and batch.prompt_len == plain.prompt_len
    # slicing keeps the view in step with its rows
    part = batch.select(torch.tensor([2, 0]))
    assert torch.equal(part.teacher_view.input_ids, view.input_ids[[2, 0]])


# -- runs: state in the checkpoint, resume exact --------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("teacher", [{"name": "ema", "decay": 0.6}, {"name": "lagged", "refresh_every": 2}])
def test_a_resumed_run_equals_the_straight_one(teacher, tiny_dir, tmp_path):
    groups = dict(
        teacher={**teacher, "privileged": "answer"},  # without context a copy of the student is a fixed point: nothing moves
        divergence={"name": "rkl"},
        estimator={"name": "sampled"},
        loss={"name": "reinforce"},
        trainer={"max_steps": 5, "lr": 0.05},
        checkpoint={"every": 2},
        eval={"every": 0},
    )
    straight = Trainer(small_config(**groups), tmp_path / "a", pair=_pair(tiny_dir), task=AddTask())
    straight.run()
    first = Trainer(small_config(**groups), tmp_path / "b", pair=_pair(tiny_dir), task=AddTask())
    assert first.run(stop_after=3) == {}
    assert (tmp_path / "b" / "checkpoints" / "step_000002" / "teacher.safetensors").is_file()
    resumed = Trainer(small_config(**groups), tmp_path / "b", pair=_pair(tiny_dir), task=AddTask())
    resumed.run()
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(6))
    for ra, rb in zip(a, b):
        for key in ra:
            if not key.startswith("perf/"):
                assert ra[key] == rb[key], (ra["step"], key)
    assert any(r["self/weight_distance"] > 0 for r in a[1:]) and any(r["kl/reverse"] != 0 for r in a[1:])  # not a run of no-ops
    for pa, pb in zip(straight.teacher_scorer.model.parameters(), resumed.teacher_scorer.model.parameters()):
        assert torch.equal(pa, pb)
    for pa, pb in zip(straight.student.parameters(), resumed.student.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.slow
def test_an_ema_run_killed_at_a_random_step_then_rerun_equals_the_straight_one(local_pair_dir, tmp_path):
    """SIGKILL through the real CLI (no chance to save: the run restarts from its last periodic
    checkpoint, teacher.safetensors with it), then the same command: every metric of every step,
    the student's and the EMA teacher's weights equal the uninterrupted run's, bit for bit."""
    import random
    import signal
    import time

    from safetensors.torch import load_file

    from helpers.reliability import BASE, comparable, pair_args, popen, read_metrics, run_subprocess
    from opd_exp.runtime import checkpoint

    steps = 24
    args = pair_args(local_pair_dir) + BASE
    args += ["teacher=ema", "teacher.decay=0.8", "teacher.privileged=answer", "divergence=rkl", f"trainer.max_steps={steps}"]
    args += ["checkpoint.every=5", "checkpoint.keep=2"]
    straight = run_subprocess(args, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir, k = tmp_path / "killed", random.Random().randint(7, steps - 4)
    proc, deadline = popen(args, run_dir), time.monotonic() + 240
    metrics = run_dir / "metrics.jsonl"
    while (not metrics.is_file() or len(metrics.read_text().splitlines()) < k) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and 0 < len(read_metrics(run_dir)) - 1 < steps
    assert (checkpoint.latest(run_dir) / checkpoint.TEACHER_FILE).is_file()  # the teacher state it resumes from
    again = run_subprocess(args, run_dir)
    assert again.returncode == 0 and "opd-train: resuming from step " in again.stderr, again.stderr[-3000:]
    got, want = comparable(read_metrics(run_dir)), comparable(read_metrics(tmp_path / "straight"))
    assert [r["step"] for r in got] == list(range(steps + 1)) and got == want
    assert any(r["self/weight_distance"] > 0 for r in want[1:])  # the teacher moved: not a run of no-ops
    for name in ("model.safetensors", checkpoint.TEACHER_FILE):
        a, b = (load_file(str(checkpoint.latest(d) / name)) for d in (run_dir, tmp_path / "straight"))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), name


def test_a_checkpoint_without_teacher_state_is_refused_for_an_ema_run(tiny_dir, tmp_path):
    Trainer(small_config(trainer={"max_steps": 1}, checkpoint={"every": 1}), tmp_path, pair=_pair(tiny_dir), task=AddTask()).run()
    ema = Trainer(small_config(teacher={"name": "ema"}, trainer={"max_steps": 2}), tmp_path, pair=_pair(tiny_dir), task=AddTask())
    with pytest.raises(ConfigError) as err:
        ema.resume()
    assert "teacher" in str(err.value)


def test_live_teacher_trains_on_the_context_alone(tiny_dir, tmp_path):
    cfg = small_config(teacher={"name": "live", "privileged": "answer"}, divergence={"name": "rkl"}, trainer={"max_steps": 2})
    tr = Trainer(cfg, tmp_path, pair=_pair(tiny_dir), task=AddTask())
    assert tr.teacher_scorer.model is tr.student  # no copy
    tr.run()
    rows = _metrics(tmp_path)
    assert all(r["kl/reverse"] == pytest.approx(-r["self/privileged_gain"], rel=1e-5) for r in rows[1:])
    assert rows[1]["loss"] != 0.0


def test_teacher_kind_limits_in_one_line():
    from helpers.compose import compose_config

    with pytest.raises(ConfigError, match=r"teacher.privileged='none' is not allowed; allowed: solution or answer with teacher=live"):
        compose_config("teacher=live", "teacher.privileged=none")
    with pytest.raises(ConfigError, match=r"rollout.on_policy_fraction=0.5 is not allowed; allowed: 1.0 with teacher=lagged"):
        compose_config("teacher=lagged", "rollout.on_policy_fraction=0.5")
    with pytest.raises(ConfigError, match=r"teacher.privileged='solution' is not allowed; allowed: none with teacher=served"):
        compose_config("teacher=served", "teacher.url=http://127.0.0.1:9", "teacher.privileged=solution")
    cfg = compose_config("teacher=ema", "teacher.decay=0.9")
    assert (cfg.teacher.name.value, cfg.teacher.decay, cfg.teacher.privileged.value) == ("ema", 0.9, "none")


def test_a_copy_of_the_student_without_context_is_a_fixed_point_and_is_said(tiny_dir, tmp_path, capsys):
    cfg = small_config(
        teacher={"name": "ema"},
        divergence={"name": "rkl"},
        estimator={"name": "sampled"},
        loss={"name": "reinforce"},
        trainer={"max_steps": 3, "weight_decay": 0.0},
    )
    tr = Trainer(cfg, tmp_path, pair=_pair(tiny_dir), task=AddTask())
    tr.run()
    rows = _metrics(tmp_path)
    assert all(r["jsd/mean"] == 0.0 and r["grad/norm"] == 0.0 for r in rows[1:]), rows  # s - t = 0 exactly: no gradient at all
    err = capsys.readouterr().err
    assert "the divergence to the teacher has stayed at ~0 (|jsd/mean| <= 1e-06) for the first 3 steps up to step 3" in err
    assert "teacher=ema starts as the student" in err


def test_the_memory_estimate_counts_the_copy(tiny_dir):
    from opd_exp.training.memory import estimate

    student = _pair(tiny_dir).student
    size = sum(p.numel() * p.element_size() for p in student.parameters())
    for name, copy in (("in_process", 0), ("ema", size), ("lagged", size), ("live", 0)):
        extra = {"privileged": "answer"} if name == "live" else {}
        need = estimate(small_config(teacher={"name": name, **extra}), student, 100)
        assert need.teacher_copy == copy and need.peak == max(need.kv_cache, need.logits) + copy, name
