"""The lab worlds built for one claim each: the state-mismatch chain world (its recovery data,
its cache key, and the mismatch it was built to have, measured on the shipped pair), and the
teacher-free fixed-negative signal (exact in the divergence interface, registered only as a
plugin); both sweeps compose into the jobs their claims need."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opd_exp.divergences.check import exact_grad, expected_reinforce_grad, log_probs, random_pair
from opd_exp.divergences.fixed_negative import FixedNegative
from opd_exp.pairs.embedded import recovery
from opd_exp.tasks.arithmetic import make_problem

ROOT = Path(__file__).resolve().parents[1]
CHAIN = make_problem([7, 3, 5, 9, 2], list("-+-+"))  # 7-3=4;4+5=9;9-9=0;0+2=2;#### 2


# -- the recovery data -----------------------------------------------------------


def test_a_slip_is_a_near_miss_of_its_kind():
    rng = random.Random(0)
    assert [recovery.slip_step("4+5=9", kind, rng) for kind in recovery.SLIPS] == ["4+5=10", "4+6=10", "4-5=-1", "1+5=6"]
    with pytest.raises(ValueError, match="slip kind 'typo'; allowed: result, operand, operator, carry"):
        recovery.slip_step("4+5=9", "typo", rng)


def test_a_recovery_draw_keeps_the_slip_in_the_prompt_and_corrects_it_in_the_target():
    rng = random.Random(1)
    draws = [recovery.slipped(CHAIN, rng) for _ in range(3)]
    assert [(d.prompt, d.solution) for d in draws] == [
        ("7-3+5-9+2=?\n7-3=4;4+2=6", "!9;9-9=0;0+2=2;#### 2"),
        ("7-3+5-9+2=?\n7-3=4;4+5=9;9-9=1", "!0;0+2=2;#### 2"),
        ("7-3+5-9+2=?\n7-3=4;4+5=9;9-9=0;0-2=-2", "!2;#### 2"),
    ]
    steps, _ = recovery.solution_steps(CHAIN.solution)
    for d in draws:  # the wrong step is the prompt's last; the target gives that step's right value, then the rest
        done = d.prompt.split("\n")[1].split(";")
        i = len(done) - 1
        assert done[:i] == steps[:i] and done[i] != steps[i] and d.answer == "2"
        assert d.solution == recovery.MARK + ";".join([steps[i].split("=")[1], *steps[i + 1 :], "#### 2"])


def test_with_recovery_replaces_about_its_share_and_is_deterministic():
    problems = [CHAIN] * 2000
    mixed = recovery.with_recovery(problems, 0.3, seed=0)
    n = sum(p.solution.startswith(recovery.MARK) for p in mixed)
    assert 540 <= n <= 660  # 0.3 of 2000 draws, +-4.9 standard deviations
    assert mixed == recovery.with_recovery(problems, 0.3, seed=0) != recovery.with_recovery(problems, 0.3, seed=1)
    assert recovery.with_recovery(problems, 0.0, seed=0) == problems


def test_the_recovery_share_is_in_the_teacher_key_only_and_only_when_set():
    from opd_exp.config.world import EmbeddedPairConfig, TaskConfig
    from opd_exp.pairs.embedded.prepare import model_key
    from opd_exp.runtime.errors import ConfigError

    task = TaskConfig(min_operands=4, max_operands=6, max_digits=1)
    plain, fixing = EmbeddedPairConfig(), EmbeddedPairConfig(recovery=0.3)
    assert model_key("student", fixing, task) == model_key("student", plain, task)  # the same student
    assert model_key("teacher", fixing, task) == {
        **model_key("teacher", plain, task),
        "recovery": {"share": 0.3, "recipe": recovery.RECIPE},
    }
    assert "recovery" not in model_key("teacher", plain, task)  # every cached world keeps its key
    with pytest.raises(ConfigError, match=r"^model_pair.embedded.recovery=1.0 is not allowed; allowed: a share in \[0, 1\)$"):
        EmbeddedPairConfig(recovery=1.0)


# -- the mismatch statistic --------------------------------------------------------


def test_leave_point_and_step_end():
    from opd_exp.pairs.embedded.mismatch import leave_point, step_end

    paths = ["7-3=4;4+5=9;#### 9", "7-3=4;4+5=9;#### 8"]
    assert leave_point("7-3=4;4+5=9;#### 9", paths) is None
    assert leave_point("7-3=4;4+6=10;#### 10", paths) == 8  # "7-3=4;4+" is shared, "6" is not
    assert leave_point("7-3=4", paths) == 5  # stopped where the teacher went on
    assert step_end("7-3=4;4+6=10;#### 10", 8) == 12 and step_end("7-3=4;4+6=10!9;9", 8) == 12
    assert step_end("7-3=4;4+6=10", 8) == 12


def test_the_mismatch_world_is_shipped_and_only_its_teacher_learnt_corrections():
    """The first run copies it (no half-hour teacher build); the student is the chain world's,
    warmed up longer (2000 steps) on clean solutions only: it has never seen a correction."""
    import json

    from hydra import compose, initialize_config_dir

    import opd_exp.cli.train as T
    from opd_exp.pairs.embedded import cache
    from opd_exp.pairs.embedded.prepare import model_key, world_task_config

    with initialize_config_dir(config_dir=T.CONF_DIR, version_base="1.3"):
        cfg = T.to_train_config(compose("train", overrides=["model_pair=embedded_chain_recovery", "task=chain", "logger=none"]))
    task, pair = world_task_config(cfg.task), cfg.model_pair.embedded
    assert (pair.recovery, pair.teacher.sft_steps, pair.student.sft_steps) == (0.4, 3000, 2000)
    assert model_key("teacher", pair, task)["recovery"] == {"share": 0.4, "recipe": recovery.RECIPE}
    assert "recovery" not in model_key("student", pair, task)
    index = json.loads((cache.SHIPPED_ROOT / cache.SHIPPED_INDEX).read_text())["entries"]
    for role in ("teacher", "student"):
        name = cache.entry_path(f"embedded-{role}", model_key(role, pair, task)).name
        assert name in index, f"{role}: {name} is not shipped (python -m opd_exp.pairs.embedded.ship)"
        assert cache.check_entry(cache.shipped_entry(name)) is None


def _world(overrides: list[str]):
    from opd_exp.cli.prepare import _parse_overrides
    from opd_exp.pairs.embedded.models import load_model
    from opd_exp.pairs.embedded.prepare import prepare_embedded
    from opd_exp.pairs.embedded.tokenizer import load_tokenizer
    from opd_exp.tasks import build_task

    pair_cfg, task_cfg = _parse_overrides([*overrides, "task=chain"])
    prepared = prepare_embedded(pair_cfg, task_cfg, progress=False)
    task = build_task(task_cfg)
    models = load_model(prepared.student).eval(), load_model(prepared.teacher).eval()
    return (*models, load_tokenizer(prepared.tokenizer), task)


# the mismatch world, and the old chain teacher with the same student (both shipped)
WORLDS = {
    "recovery": ["model_pair=embedded_chain_recovery"],
    "old_teacher": ["model_pair=embedded_chain", "model_pair.embedded.student.sft_steps=2000"],
}


@pytest.fixture(scope="module")
def mismatch():
    """The statistics on the first 100 eval problems, 4 samples per model and prompt."""
    from opd_exp.pairs.embedded.mismatch import state_mismatch

    torch.set_num_threads(1)
    out = {}
    for name, overrides in WORLDS.items():
        student, teacher, tok, task = _world(overrides)
        out[name] = state_mismatch(student, teacher, tok, task, task.eval_problems()[:100], k=4)
    return out


def test_the_mismatch_world_has_states_the_teacher_never_visits_and_guides_from_them(mismatch):
    """Measured here (docs/world.md): 0.66 of student samples leave every teacher path (0.37 of
    their states), teacher samples 0.045 off the reference, 0.04 corrected, and the teacher
    leads 0.74 of the student's slips back to the right answer (264 prefixes). The bounds sit
    well inside, so another CPU's rounding, which flips an occasional draw, cannot cross them."""
    m = mismatch["recovery"]
    assert m["n_samples"] == 400
    assert m["student_samples_off"] > 0.5 and m["student_states_off"] > 0.25  # the student slips and stays off
    assert m["teacher_samples_off_reference"] < 0.1 and m["teacher_samples_corrected"] < 0.1  # the teacher's own: clean
    assert m["teacher_recovers"] > 0.6 and m["n_recover"] > 200  # and from the student's slips it leads back
    # right there the teacher's next token is the marker (0.80 measured), which the warmed-up
    # student, never shown a correction, gives no mass (2.5e-7): it never writes one
    assert m["teacher_mark_prob"] > 0.6 and m["student_mark_prob"] < 1e-4
    assert m["student_samples_corrected"] == 0.0 and 0.3 < m["student_samples_right"] < 0.6


def test_the_old_chain_teacher_does_not_guide_the_same_student_back(mismatch):
    """Same student, same slips (0.057 recovered here): the old teacher continues from the
    wrong running value, which is why the old chain world could not show GKD's effect."""
    old, new = mismatch["old_teacher"], mismatch["recovery"]
    assert old["teacher_samples_corrected"] < 0.01 and old["teacher_recovers"] < 0.2
    assert new["teacher_recovers"] - old["teacher_recovers"] > 0.4


def test_only_forward_kl_reaches_a_token_the_student_gives_no_mass():
    """Why the on-policy jsd student of lab_on_policy_mismatch never takes up the correction:
    at its slips the teacher puts 0.77 on the marker and the student 2.5e-7. The logit
    gradient of jsd (and rkl) on that token scales with the student's own probability of it;
    forward KL's is S - T. Exact, float64, the divergences' own full path."""
    from opd_exp.divergences.catalog import get_divergence

    s = torch.tensor([[1 - 2.5e-7, 2.5e-7]], dtype=torch.float64)
    t = torch.tensor([[0.23, 0.77]], dtype=torch.float64)
    grads = {}
    for name, kw in (("jsd", {"beta": 0.5}), ("fkl", {}), ("rkl", {})):
        z = s.log().clone().requires_grad_(True)
        get_divergence(name, **kw).full(z, t.log()).sum().backward()
        grads[name] = z.grad[0, 1].item()
    assert grads["fkl"] == pytest.approx(2.5e-7 - 0.77, rel=1e-12)
    # a factor S on that logit (with S -> 0: |grad| ~ S log(1/S)), six orders below forward KL
    assert -1e-5 < grads["jsd"] < 0 and -1e-5 < grads["rkl"] < 0
    assert grads["fkl"] / grads["jsd"] > 1e5


# -- the fixed-negative signal -----------------------------------------------------------


def test_fixed_negative_cost_is_one_below_the_threshold_and_ignores_the_teacher():
    d = FixedNegative()
    s = torch.tensor([0.5, 0.019, 0.021, 1e-4, 0.0], dtype=torch.float64).log()  # threshold 0.02
    for t in (torch.zeros(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)):
        assert d.token_cost(s, t).tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]
        assert d.token_value(s, t).tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("regime", ["far", "near"])
def test_fixed_negative_is_exact_for_its_own_d_the_mass_below_the_threshold(seed, regime):
    """E_y~S[cost grad log S] = grad D and E_y~S[value] = D, enumerated in float64, where
    D = sum_v S_v [S_v < threshold] (not zero when S = T: it is no divergence)."""
    d = FixedNegative()
    zs, zt = random_pair(seed, vocab=12, regime=regime)
    zs = 2.0 * zs  # a peaked student: entries on both sides of the threshold
    probs, s, t = log_probs(zs, zt)
    below = probs < d.threshold
    assert 0 < int(below.sum()) < 12
    value = float(d.full(zs, zt))
    assert value == pytest.approx(float(probs[below].sum()), rel=1e-12)
    assert float((probs * d.token_value(s, t)).sum()) == pytest.approx(value, rel=1e-12)
    torch.testing.assert_close(expected_reinforce_grad(d.token_cost(s, t), probs), exact_grad(d, zs, zt), rtol=1e-10, atol=1e-12)
    assert float(d.full(zs, zs)) == pytest.approx(value, rel=1e-12)  # the teacher does not enter


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """A fresh interpreter: registrations are process-wide, other tests must not see them."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=dict(os.environ, **env), cwd=ROOT)


def test_fixed_negative_is_registered_by_its_plugin_only():
    probe = "from opd_exp.config.plugins import load_plugins; load_plugins(); from opd_exp.divergences import DIVERGENCES; print('fixed_negative' in DIVERGENCES)"
    assert _python(probe, OPD_PLUGINS="").stdout.split() == ["False"]
    assert _python(probe, OPD_PLUGINS="opd_exp.divergences.lab").stdout.split() == ["True"]


# -- the sweeps ------------------------------------------------------------------------------


def _dry(sweep: str, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "opd_exp.cli.train", "-m", f"sweep={sweep}", "hydra/launcher=dry"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, WANDB_MODE="disabled", **env), cwd=ROOT)


def test_the_mismatch_sweep_composes_two_divergences_by_three_fractions_by_three_seeds():
    from test_sweeps import compose_job

    hc, cfg = compose_job(["sweep=lab_on_policy_mismatch", "rollout.on_policy_fraction=0.5", "seed=2"], job_num=4)
    params = {k: str(v).split(",") for k, v in hc.sweeper.params.items()}
    assert params == {"divergence": ["jsd", "fkl"], "rollout.on_policy_fraction": ["0.0", "0.5", "1.0"], "seed": ["0", "1", "2"]}
    assert (cfg.model_pair.name, cfg.model_pair.embedded.recovery, cfg.task.min_operands, cfg.divergence.name.value) == (
        "embedded_chain_recovery",
        0.4,
        4,
        "jsd",
    )
    assert (cfg.trainer.lr, cfg.trainer.max_steps, cfg.rollout.max_new_tokens, cfg.eval.samples) == (1e-3, 300, 64, 4)
    assert hc.sweep.subdir == "4_jsd_onpolicy0.5_seed2"
    _, cfg = compose_job(["sweep=lab_on_policy_mismatch", "divergence=fkl", "seed=0"])
    assert cfg.divergence.name.value == "fkl"
    proc = _dry("lab_on_policy_mismatch")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count(": ok\n") == 18, proc.stdout


def test_the_fixed_negative_sweep_composes_with_its_plugin_and_names_it_without():
    proc = _dry("lab_fixed_negative", OPD_PLUGINS="opd_exp.divergences.lab")
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = (
        "import sys; sys.path.insert(0, 'tests'); from opd_exp.config.plugins import load_plugins; load_plugins(); "
        "from test_sweeps import compose_job; _, c = compose_job(['sweep=lab_fixed_negative', 'variant=fixed_negative']); "
        "print(c.divergence.name.value, c.estimator.name.value, c.loss.name.value, c.trainer.lr, c.trainer.max_steps, c.task.name)"
    )
    out = _python(probe, OPD_PLUGINS="opd_exp.divergences.lab")
    assert out.stdout.split() == ["fixed_negative", "sampled", "reinforce", "0.0003", "500", "multimodal"], out.stderr[-2000:]
    jobs = [line for line in proc.stdout.splitlines() if line.startswith("opd-train: dry run: job #")]
    assert len(jobs) == 6 and all(line.endswith(": ok") for line in jobs), proc.stdout
    assert sum("variant=fixed_negative" in line for line in jobs) == 3
    proc = _dry("lab_fixed_negative", OPD_PLUGINS="")  # without it: one line naming the value it lacks
    assert proc.returncode == 2 and "Invalid value 'fixed_negative'" in proc.stderr, proc.stderr[-2000:]


def _other_world_checkpoint(tmp: Path) -> Path:
    """A checkpoint of a run that trained the default world's pair (its run folder says so)."""
    step = tmp / "run" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"weights")
    (tmp / "run" / ".hydra").mkdir()
    (tmp / "run" / ".hydra" / "config.yaml").write_text("model_pair:\n  name: embedded\n")
    return step


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (lambda tmp: ["model_pair=nonexistent_xyz"], "model_pair: no option 'nonexistent_xyz'; allowed: embedded, embedded_chain, "),
        (lambda tmp: ["model_pair=smollm2"], "model_pair=smollm2 is not allowed; allowed: an embedded chain world"),
        (lambda tmp: ["--student", str(tmp / "nope")], "--student {tmp}/nope: no such folder; allowed: a run's checkpoints/step_* "),
        (lambda tmp: ["--student", str(tmp)], "--student {tmp}: no model.safetensors there; allowed: a run's checkpoints/step_* "),
        (
            lambda tmp: ["--student", str(_other_world_checkpoint(tmp))],
            "--student {tmp}/run/checkpoints/step_000002: a checkpoint of a model_pair=embedded run, not of "
            "embedded_chain_recovery's world; allowed: model_pair=embedded (with its task) to measure it, or ",
        ),
    ],
    ids=["unknown_option", "not_embedded", "missing", "empty", "another_world"],
)
def test_the_mismatch_script_answers_a_wrong_input_in_one_line(tmp_path, args, says):
    """Each refused before the pair is prepared (no cache is touched)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "state_mismatch.py"), *args(tmp_path)]
    env = dict(os.environ, OPD_EXP_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("state_mismatch: " + says.format(tmp=tmp_path)), proc.stderr
    assert not (tmp_path / "cache").exists()
