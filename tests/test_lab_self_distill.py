"""The self-distillation world (``model_pair=embedded_self_distill``) and its sweep: the student's
context draws are asked exactly as ``teacher.privileged`` asks the teacher, the share is in the
student's cache key only when set, the shipped student is a better teacher of itself with the
context (measured at preparation and again here), and every arm of ``lab_self_distill`` picks what
its claim needs."""

from __future__ import annotations

import json

import pytest
from test_sweeps import compose_job

from opd_exp.pairs.embedded import privileged
from opd_exp.tasks.arithmetic import ArithmeticTask, make_problem
from opd_exp.training.teacher_prompt import privileged_prompt, with_context

PROBLEM = make_problem([9, 5, 2], list("-+"))  # 9-5+2=?  9-5=4;4+2=6;#### 6


def _world():
    from hydra import compose, initialize_config_dir

    import opd_exp.cli.train as T
    from opd_exp.pairs.embedded.prepare import world_task_config

    overrides = ["model_pair=embedded_self_distill", "teacher=live", "teacher.privileged=solution", "logger=none"]
    with initialize_config_dir(config_dir=T.CONF_DIR, version_base="1.3"):
        cfg = T.to_train_config(compose("train", overrides=overrides))
    return cfg, world_task_config(cfg.task), cfg.model_pair.embedded


def test_a_context_draw_is_asked_as_the_teacher_is_asked():
    from opd_exp.pairs.embedded.prepare import embedded_tokenizer_dir
    from opd_exp.pairs.embedded.sft import encode_sft
    from opd_exp.pairs.embedded.tokenizer import load_tokenizer

    tok = load_tokenizer(embedded_tokenizer_dir())
    assert with_context(PROBLEM, "solution").prompt == "Reference solution: 9-5=4;4+2=6;#### 6\n\n9-5+2=?\n"
    assert with_context(PROBLEM, "answer").prompt == "Reference answer: 6\n\n9-5+2=?\n"
    problems = [make_problem([a, b], ["+"]) for a in range(20) for b in range(20)]
    mixed = privileged.with_privileged(problems, 0.5, seed=0)
    kinds = {k: [p for p in mixed if p.prompt.startswith(f"Reference {k}: ")] for k in privileged.KINDS}
    assert 150 < len(kinds["solution"]) + len(kinds["answer"]) < 250 and min(len(v) for v in kinds.values()) > 60
    for p, q in zip(problems, mixed):
        assert (q.answer, q.solution) == (p.answer, p.solution) and q.prompt.endswith(p.prompt)  # the target is the plain one
    # the SFT row's prompt is the teacher's privileged prompt, token for token
    for kind, rows in kinds.items():
        q = rows[0]
        p = next(p for p in problems if q.prompt.endswith("\n\n" + p.prompt))
        ids, mask, _ = encode_sft(tok, [q])
        teacher = tok(privileged_prompt(ArithmeticTask(), p, kind, tok), add_special_tokens=False)["input_ids"]
        assert ids[0, : len(teacher)].tolist() == teacher and not mask[0, : len(teacher)].any(), kind
    assert mixed == privileged.with_privileged(problems, 0.5, seed=0) != privileged.with_privileged(problems, 0.5, seed=1)
    assert privileged.with_privileged(problems, 0.0, seed=0) == problems


def test_the_privileged_share_is_in_the_student_key_only_and_only_when_set():
    from opd_exp.config.world import EmbeddedPairConfig, TaskConfig
    from opd_exp.pairs.embedded.prepare import model_key
    from opd_exp.runtime.errors import ConfigError

    task = TaskConfig()
    plain, context = EmbeddedPairConfig(), EmbeddedPairConfig(privileged=0.5)
    assert model_key("teacher", context, task) == model_key("teacher", plain, task)
    assert model_key("student", context, task) == {
        **model_key("student", plain, task),
        "privileged": {"share": 0.5, "recipe": privileged.RECIPE},
    }
    assert "privileged" not in model_key("student", plain, task)  # every cached world keeps its key
    with pytest.raises(ConfigError, match=r"^model_pair.embedded.privileged=1.0 is not allowed; allowed: a share in \[0, 1\)$"):
        EmbeddedPairConfig(privileged=1.0)


def test_the_shipped_student_is_a_better_teacher_of_itself_with_the_context():
    """Measured at preparation on the 200 eval problems (the manifest), and again here on 40."""
    from opd_exp.pairs.embedded import cache
    from opd_exp.pairs.embedded.models import load_model
    from opd_exp.pairs.embedded.prepare import model_key
    from opd_exp.pairs.embedded.tokenizer import load_tokenizer
    from opd_exp.tasks import build_task
    from opd_exp.training.evaluate import evaluate_accuracy

    cfg, task_cfg, pair = _world()
    assert (cfg.model_pair.student, cfg.model_pair.teacher) == ("embedded:student", "embedded:student")
    assert (pair.privileged, pair.student.sft_steps) == (0.5, 2000)
    name = cache.entry_path("embedded-student", model_key("student", pair, task_cfg)).name
    folder = cache.shipped_entry(name)
    assert folder is not None, f"{name} is not shipped (python -m opd_exp.pairs.embedded.ship)"
    info = json.loads((folder / cache.MANIFEST).read_text())["info"]
    assert (info["accuracy"], info["accuracy_solution"], info["accuracy_answer"], info["n_check"]) == (0.395, 1.0, 1.0, 200)
    model, tok = load_model(folder), load_tokenizer(folder)
    task = build_task(task_cfg)
    problems = task.eval_problems()[:40]
    plain = evaluate_accuracy(model, tok, task, problems, batch_size=40, max_new_tokens=40)["accuracy"]
    shown = evaluate_accuracy(model, tok, task, [with_context(p, "solution") for p in problems], batch_size=40, max_new_tokens=40)
    assert plain < 0.6 and shown["accuracy"] == 1.0


ARMS = {  # variant: (teacher, privileged, divergence)
    "opsd_fkl": ("in_process", "solution", "fkl"),
    "opsd_rkl": ("in_process", "solution", "rkl"),
    "opsd_control": ("lagged", "none", "fkl"),
    "opsd_ema": ("ema", "solution", "fkl"),
    "opsd_lagged": ("lagged", "solution", "fkl"),
    "opsd_live": ("live", "solution", "fkl"),
}


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_every_arm_of_the_sweep_picks_what_its_claim_needs(arm):
    hc, cfg = compose_job(["sweep=lab_self_distill", f"variant={arm}", "seed=1"], job_num=3)
    te = cfg.teacher
    assert (te.name.value, te.privileged.value, cfg.divergence.name.value) == ARMS[arm]
    assert (cfg.model_pair.name, cfg.model_pair.teacher, cfg.task.name) == ("embedded_self_distill", "embedded:student", "arithmetic")
    assert (cfg.trainer.max_steps, cfg.trainer.lr, cfg.trainer.batch_size, cfg.estimator.name.value) == (300, 3e-3, 64, "full")
    assert hc.sweep.subdir == f"3_{arm}_seed1"
    if arm == "opsd_control":  # a frozen copy of the starting student: it never refreshes
        assert te.refresh_every > cfg.trainer.max_steps
