"""The multi-teacher lab (sweeps/sweep/lab_mopd.yaml): its task puts one operator in each problem,
so ``teachers.route=operator`` gives every prompt a domain; its experts are trained on their
operators only (``model_pair.embedded.sft_ops``) without ever seeing the task's eval set; and the
sweep composes into its four arms x three seeds, each naming the teachers its arm needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_lab_sweeps import TINY as SWEEP_TINY
from test_sweeps import compose_job

from opd_exp.config.teachers import OPERATORS
from opd_exp.config.world import EmbeddedPairConfig, TaskConfig, as_task_config
from opd_exp.pairs.embedded.prepare import _sft_data, _spec, model_key
from opd_exp.runtime.errors import ConfigError
from opd_exp.tasks.arithmetic import eval_split

ROOT = Path(__file__).resolve().parents[1]
ARMS = ["mopd_routed", "mopd_generalist", "mopd_addsub_only", "mopd_mul_only"]
# each arm's teacher of the + and - domain and of the * domain (a conf/model_pair option, or the pair's own)
TEACHERS = {
    "mopd_routed": ("pair:embedded_mopd_addsub", "pair:embedded_mopd_mul"),
    "mopd_generalist": ("path:embedded:teacher", "path:embedded:teacher"),
    "mopd_addsub_only": ("pair:embedded_mopd_addsub", "pair:embedded_mopd_addsub"),
    "mopd_mul_only": ("pair:embedded_mopd_mul", "pair:embedded_mopd_mul"),
}


def mopd_task() -> TaskConfig:
    return as_task_config(OmegaConf.load(ROOT / "conf" / "task" / "mopd.yaml"))


def operators(prompt: str) -> set[str]:
    return {c for c in prompt if c in OPERATORS}


def test_every_mopd_problem_has_one_operator_family():
    task = mopd_task()
    assert (task.min_operands, task.max_operands, task.max_digits, task.ops) == (2, 2, 2, "+-*")
    problems = eval_split(_spec(task), task.n_eval, task.eval_seed)
    assert all(len(operators(p.prompt)) == 1 for p in problems)
    # the eval split the sweep reports on: 133 prompts of the + and - domain, 67 of the * one
    assert sum("*" in p.prompt for p in problems) == 67 and len(problems) == 200


def test_sft_ops_restricts_the_sft_data_and_still_excludes_the_task_eval_set():
    task = mopd_task()
    evals = {p.prompt for p in eval_split(_spec(task), task.n_eval, task.eval_seed)}
    for ops, n_checks in (("+-", 133), ("*", 67)):
        checks, sft = _sft_data(task, EmbeddedPairConfig(n_sft=3000, sft_ops=ops))
        assert all(operators(p.prompt) <= set(ops) for p in sft)
        assert {o for p in sft for o in operators(p.prompt)} == set(ops)
        assert not evals & {p.prompt for p in sft}  # never a prompt of the run's eval set
        assert len(checks) == n_checks and all(operators(p.prompt) <= set(ops) for p in checks)  # checked on its domain
    checks, sft = _sft_data(task, EmbeddedPairConfig(n_sft=3000))
    assert len(checks) == 200 and {o for p in sft for o in operators(p.prompt)} == set("+-*")


def test_sft_ops_is_in_the_key_only_when_set():
    task = mopd_task()
    plain, expert = EmbeddedPairConfig(), EmbeddedPairConfig(sft_ops="*")
    assert "sft_ops" not in model_key("teacher", plain, task)  # every cached world keeps its key
    for role in ("teacher", "student"):
        assert model_key(role, expert, task) == {**model_key(role, plain, task), "sft_ops": "*"}
    with pytest.raises(
        ConfigError, match=r"^model_pair.embedded.sft_ops='/' is not allowed; allowed: null \(the task's operators\) or a non-empty"
    ):
        EmbeddedPairConfig(sft_ops="/")
    with pytest.raises(ConfigError, match=r"^model_pair.embedded.sft_ops='\+' is not allowed; allowed: null with task=multimodal"):
        model_key("teacher", EmbeddedPairConfig(sft_ops="+"), TaskConfig(name="multimodal"))


def test_the_experts_are_the_generalist_recipe_on_their_operators():
    from opd_exp.config.teachers import pair_option
    from opd_exp.config.world import as_pair_config

    generalist = as_pair_config(OmegaConf.load(pair_option("k", "embedded_mopd")))
    assert (generalist.for_task, generalist.embedded.sft_ops) == ("mopd", None)
    for option, ops in (("embedded_mopd_addsub", "+-"), ("embedded_mopd_mul", "*")):
        expert = as_pair_config(OmegaConf.load(pair_option("k", option)))
        assert (expert.for_task, expert.embedded.sft_ops) == ("mopd", ops)
        assert expert.embedded.teacher == generalist.embedded.teacher  # same size, steps, lr, seed


def test_the_sweep_composes_four_arms_by_three_seeds():
    hc, _ = compose_job(["sweep=lab_mopd"])
    params = {k: str(v).split(",") for k, v in OmegaConf.to_container(hc.sweeper.params).items()}
    assert params == {"variant": ARMS, "seed": ["0", "1", "2"]}
    for num, arm in enumerate(ARMS):
        hc, cfg = compose_job(["sweep=lab_mopd", f"variant={arm}", "seed=2"], job_num=num)
        assert hc.sweep.subdir == f"{num}_{arm}_seed2" and hc.sweep.dir == "multirun/lab_mopd/embedded_mopd"
        assert (cfg.task.max_operands, cfg.task.ops, cfg.model_pair.name, cfg.teachers.route) == (2, "+-*", "embedded_mopd", "operator")
        te = cfg.teachers.map
        assert list(te) == ["addsub", "mul"] and (te["addsub"].covers, te["mul"].covers) == (["+", "-"], ["*"])
        named = tuple(f"pair:{s.pair}" if s.pair else f"path:{s.path}" for s in te.values())
        assert named == TEACHERS[arm]
        assert (cfg.rollout.on_policy_fraction, cfg.checkpoint.every, cfg.logger.name.value) == (1.0, 0, "none")


def test_every_job_of_the_sweep_passes_the_dry_launcher():
    cmd = [sys.executable, "-m", "opd_exp.cli.train", "-m", "sweep=lab_mopd", "hydra/launcher=dry"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, WANDB_MODE="disabled"), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = [line for line in proc.stdout.splitlines() if line.startswith("opd-train: dry run: job #")]
    assert len(jobs) == 12 and all(line.endswith(": ok") for line in jobs), proc.stdout
    assert [sum(f"variant={arm} " in line for line in jobs) for arm in ARMS] == [3, 3, 3, 3]


@pytest.mark.parametrize("option", ["embedded_mopd", "embedded_mopd_addsub", "embedded_mopd_mul"])
def test_the_mopd_world_is_shipped(option):
    """The generalist pair and both experts (each with the student its option builds beside it) are
    copied from the package, not built: each teacher is 4000 SFT steps (~35 min on a busy core)."""
    from opd_exp.config.world import as_pair_config
    from opd_exp.pairs.embedded import cache
    from opd_exp.runtime import files

    index = json.loads((cache.SHIPPED_ROOT / cache.SHIPPED_INDEX).read_text())["entries"]
    pair = as_pair_config(OmegaConf.load(ROOT / "conf" / "model_pair" / f"{option}.yaml")).embedded
    for role in ("teacher", "student"):
        name = cache.entry_path(f"embedded-{role}", model_key(role, pair, mopd_task())).name
        assert name in index, f"{option} {role}: {name} is not shipped"
        folder = cache.shipped_entry(name)
        assert folder is not None and cache.check_entry(folder) is None
        assert files.sha256_file(folder / cache.MANIFEST) == index[name]


# the lab sweeps' tiny recipe, with all 6 eval problems so that both domains are evaluated
TINY = [o for o in SWEEP_TINY if not o.startswith(("eval.size=", "eval.samples=", "seed="))] + ["eval.size=6"]


@pytest.mark.slow
def test_every_arm_runs_two_tiny_steps_with_per_domain_metrics(tmp_path):
    """Each arm end to end through ``opd-train -m sweep=lab_mopd`` on a fresh cache: the experts
    are copied from the package, the run's own pair is shrunk to 2 SFT steps."""
    env = dict(os.environ, OPD_EXP_CACHE=str(tmp_path / "cache"), WANDB_MODE="disabled")
    out = tmp_path / "multirun"
    cmd = [sys.executable, "-m", "opd_exp.cli.train", "-m", "sweep=lab_mopd", "seed=0", *TINY, f"hydra.sweep.dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    builds = [line for line in proc.stderr.splitlines() if "opd-exp: building the embedded" in line]
    assert builds and all("(2 SFT steps" in line for line in builds), builds  # only the run's tiny pair is built
    jobs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert jobs == [f"{num}_{arm}_seed0" for num, arm in enumerate(ARMS)]
    for job in jobs:
        rows = [json.loads(line) for line in (out / job / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2]
        for d in ("addsub", "mul"):
            assert 0.0 <= rows[0][f"eval/teacher/{d}/teacher_accuracy"] <= 1.0
            assert 0.0 <= rows[-1][f"eval/teacher/{d}/accuracy"] <= 1.0
        assert sum(rows[1][f"teacher/{d}/token_share"] for d in ("addsub", "mul")) == pytest.approx(1.0)
    # each domain's teacher as the arm routes it: the expert of a domain is far ahead of the other expert there
    teachers = {job: json.loads((out / job / "metrics.jsonl").read_text().splitlines()[0]) for job in jobs}
    routed, addsub_only, mul_only = (teachers[jobs[i]] for i in (0, 2, 3))
    assert routed["eval/teacher/addsub/teacher_accuracy"] > mul_only["eval/teacher/addsub/teacher_accuracy"]
    assert routed["eval/teacher/mul/teacher_accuracy"] > addsub_only["eval/teacher/mul/teacher_accuracy"]


def _other_world(root: Path) -> Path:
    from test_compare_paper import make  # a divergence sweep on the default world: no per-domain metrics

    return make(root)


@pytest.mark.parametrize(
    ("folder", "says"),
    [
        (lambda tmp: tmp / "nope", "no such folder: {tmp}/nope; "),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no metrics.jsonl under {tmp}/empty: "),
        (
            _other_world,
            "{tmp}/multirun/divergence/embedded/0_rkl_seed0: logs no eval/teacher/addsub/accuracy (sweep=divergence, "
            "model_pair=embedded): not a run of the lab_mopd world; ",
        ),
    ],
    ids=["missing", "empty", "another_world"],
)
def test_the_table_script_answers_a_wrong_folder_in_one_line(tmp_path, folder, says):
    path = folder(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lab_mopd.py"), str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("lab_mopd: " + says.format(tmp=tmp_path)), proc.stderr
    assert proc.stderr.rstrip().endswith("allowed: folders of `opd-train -m sweep=lab_mopd` (multirun/lab_mopd/embedded_mopd)")
