"""The guards the field needed, each a bug someone shipped: EOS ids that differ between student and
teacher (ms-swift #9526), a distillation that runs as a no-op (atropos #456), a teacher that is the
student, a teacher at ~0 accuracy, a local pair on the toy world's batch and lr. (A served teacher
whose scores depend on what shares its batch, vLLM #42245: tests/test_served_teacher.py.)"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers.reliability import BASE, one_error_line, pair_args, run_in_process
from helpers.tiny import AddTask, small_config
from opd_exp.config.world import ModelPairConfig
from opd_exp.pairs import preflight
from opd_exp.runtime.errors import ConfigError
from opd_exp.training.objective import Objective
from opd_exp.training.scoring import TeacherScores, teacher_topk, token_logprobs
from opd_exp.training.trainer import Trainer


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# -- EOS agreement before training -------------------------------------------------------------


def _set_eos(folder: Path, eos) -> None:
    path = folder / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    gen["eos_token_id"] = eos
    path.write_text(json.dumps(gen))


def test_teacher_eos_ids_unlike_the_students_are_refused_with_the_fix(local_pair_dir, tmp_path):
    """Before: preflight compared only the tokenizers' ids of a probe text; a teacher whose
    generation_config ends on another id passed, and OPD lengths grow without end."""
    pair = tmp_path / "pair"
    shutil.copytree(local_pair_dir, pair)
    cfg = ModelPairConfig(name="local", student=str(pair / "student"), teacher=str(pair / "teacher"))
    checked = preflight(cfg)  # the pair as built: one EOS (id 1) on both sides
    assert checked.vocab_size == 259
    _set_eos(pair / "teacher", [1, 2])
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    assert _one_line(err) == (
        "model_pair.teacher: its end-of-sequence ids [1, 2] (generation_config eos_token_id [1, 2], tokenizer eos [1]) differ "
        "from the student's [1] (generation_config eos_token_id [1], tokenizer eos [1]): the teacher would score the student's "
        "end of sequence as an unlikely token and OPD lengths grow without end; allowed: one set of end-of-sequence ids for "
        f'both, e.g. "eos_token_id": [1] in {pair / "teacher"}/generation_config.json'
    )
    # the fix named: the student's ids in the teacher's generation_config (a list or one id: the same set)
    _set_eos(pair / "teacher", [1])
    preflight(cfg)
    _set_eos(pair / "student", [1, 2])
    _set_eos(pair / "teacher", [2, 1])
    preflight(cfg)


def test_eos_mismatch_is_one_line_exit_2_before_training(local_pair_dir, tmp_path, monkeypatch, capsys):
    pair = tmp_path / "pair"
    shutil.copytree(local_pair_dir, pair)
    _set_eos(pair / "teacher", 2)
    code, _, err = run_in_process(pair_args(pair) + BASE + ["trainer.max_steps=1"], tmp_path / "run", monkeypatch, capsys)
    assert code == 2
    assert one_error_line(err).startswith(
        "opd-train: error: model_pair.teacher: its end-of-sequence ids [1, 2] (generation_config eos_token_id [2]"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- a teacher that is the student ---------------------------------------------------------------


def test_the_student_as_its_own_teacher_is_refused_before_anything_loads(local_pair_dir, tmp_path, monkeypatch, capsys):
    """Before: model_pair.teacher = model_pair.student (teacher.privileged=none) trained on zero signal."""
    student = local_pair_dir / "student"
    code, _, err = run_in_process(pair_args(local_pair_dir, teacher=student) + BASE, tmp_path / "run", monkeypatch, capsys)
    assert code == 2
    assert one_error_line(err) == (
        f"opd-train: error: model_pair.teacher='{student}' is not allowed; allowed: a teacher other than the student "
        f"(model_pair.student='{student}' is the same model: the student scoring its own tokens gives zero signal), or "
        "teacher.privileged=solution|answer (the student with privileged context as its own teacher), or teacher=ema|lagged "
        "(self-distillation, named; a frozen copy of the starting student, as a negative control: teacher=lagged with "
        "teacher.refresh_every above trainer.max_steps)"
    )


def test_a_copy_of_the_student_as_teacher_is_refused_once_loaded(local_pair_dir, tmp_path, monkeypatch, capsys):
    copy_dir = tmp_path / "copy_of_student"
    shutil.copytree(local_pair_dir / "student", copy_dir)
    code, _, err = run_in_process(pair_args(local_pair_dir, teacher=copy_dir) + BASE, tmp_path / "run", monkeypatch, capsys)
    assert code == 2
    line = one_error_line(err)
    assert line.startswith(f"opd-train: error: model_pair.teacher='{copy_dir}' is not allowed; allowed: a teacher whose weights")
    assert f"(they equal those of model_pair.student='{local_pair_dir / 'student'}', tensor for tensor: " in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_same_model_with_privileged_context_or_named_self_distillation_is_allowed():
    from opd_exp.config.schema import validate

    same = ModelPairConfig(name="local", student="embedded:student", teacher="embedded:student")
    for teacher in ({"privileged": "solution"}, {"name": "ema"}, {"name": "lagged", "refresh_every": 10**9}):
        cfg = dataclasses.replace(small_config(teacher=teacher), model_pair=same)
        validate(cfg)
    with pytest.raises(ConfigError, match=r"^model_pair.teacher='embedded:student' is not allowed; allowed: a teacher other"):
        validate(dataclasses.replace(small_config(), model_pair=same))


# -- step 1: the distillation term is not zero and moves with the teacher's scores ---------------


def _fresh(tiny_pair, teacher=None):
    pair = copy.copy(tiny_pair)
    pair.student = type(tiny_pair.student).from_pretrained(tiny_pair.student.name_or_path)
    if teacher is not None:
        pair.teacher = teacher
    return pair


def test_a_teacher_whose_scores_are_the_students_is_refused_at_step_1(tiny_pair, tmp_path):
    """Before: a teacher equal to the student trained max_steps steps on nothing (a warning at step 3)."""
    pair = _fresh(tiny_pair)
    pair.teacher = copy.deepcopy(pair.student).eval().requires_grad_(False)
    t = Trainer(small_config(trainer={"max_steps": 3}), tmp_path, pair=pair, task=AddTask())
    with pytest.raises(ConfigError) as err:
        t.run()
    line = _one_line(err)
    assert line.startswith("teacher.name='in_process' is not allowed here: at step 1 the teacher's log-prob equals the student's")
    assert t.step == 0  # refused before the first update


def _ignore_the_teacher(monkeypatch):
    """The atropos bug: the loss built with the teacher's fields dropped (the student's own in their place)."""
    real = Objective._on_policy

    def dropped(self, student_z, scores, y, m, s, t, *rest):
        own = TeacherScores(logits=student_z.detach())
        return real(self, student_z, own, y, m, s, token_logprobs(student_z.detach(), y), *rest)

    monkeypatch.setattr(Objective, "_on_policy", dropped)


@pytest.mark.parametrize(
    "groups",
    [
        dict(),  # estimator=full, fkl
        dict(estimator={"name": "sampled"}, divergence={"name": "rkl"}, loss={"name": "ppo"}),
        dict(estimator={"name": "topk", "k": 3}, divergence={"name": "jsd", "beta": 0.5}),
        dict(teacher={"name": "ema"}),  # self-distillation: zero at step 1 is allowed, a loss blind to the teacher is not
    ],
    ids=["full", "sampled-ppo", "topk-jsd", "ema"],
)
def test_a_loss_that_ignores_the_teachers_scores_is_refused_at_step_1(groups, tiny_pair, tmp_path, monkeypatch):
    _ignore_the_teacher(monkeypatch)
    t = Trainer(small_config(trainer={"max_steps": 2}, **groups), tmp_path, pair=_fresh(tiny_pair), task=AddTask())
    with pytest.raises(ConfigError) as err:
        t.run()
    line = _one_line(err)
    assert "is not allowed here: at step 1 the distillation term does not change when the teacher's log-probs change" in line
    assert "distillation would be a silent no-op" in line and t.step == 0


def test_self_distillation_starts_at_zero_and_is_not_refused(tiny_pair, tmp_path):
    t = Trainer(small_config(teacher={"name": "ema"}, trainer={"max_steps": 2}), tmp_path, pair=_fresh(tiny_pair), task=AddTask())
    t.run()
    assert t.step == 2 and not t.objective.pending  # checked at step 1, and passed


@pytest.mark.parametrize(
    "groups",
    [
        # a clamp that holds the loss at 0 near the student (fkl, k=1) on a teacher that starts as the student
        dict(teacher={"name": "ema"}, divergence={"name": "fkl"}, estimator={"name": "topk_verl", "k": 1}),
        dict(teacher={"name": "live", "privileged": "answer"}),  # the student with the answer in view
        dict(rollout={"on_policy_fraction": 0.0}),  # teacher-sampled steps: the exact loss
        dict(estimator={"name": "sampled"}, divergence={"name": "jsd", "beta": 0.5}, loss={"name": "ppo"}),
    ],
    ids=["ema-topk_verl-k1", "live-answer", "teacher-sampled", "sampled-ppo"],
)
def test_legitimate_runs_pass_the_step_1_check(groups, tiny_pair, tmp_path):
    t = Trainer(small_config(trainer={"max_steps": 1}, **groups), tmp_path, pair=_fresh(tiny_pair), task=AddTask())
    t.run()
    assert t.step == 1 and not t.objective.pending


def test_reward_only_rl_has_no_distillation_term_to_check(tiny_pair, tmp_path):
    cfg = small_config(loss={"kl_coef": 0.0}, reward={"coef": 1.0, "baseline": "none"})
    assert not Trainer(cfg, tmp_path, pair=_fresh(tiny_pair), task=AddTask()).objective.pending


def test_the_check_passes_a_real_teacher_and_leaves_the_losses_alone(tiny_pair, tmp_path):
    runs = {}
    for name, check in (("checked", True), ("unchecked", False)):
        t = Trainer(small_config(trainer={"max_steps": 2}), tmp_path / name, pair=_fresh(tiny_pair), task=AddTask())
        t.objective.pending = check
        t.run()
        runs[name] = [json.loads(r)["loss"] for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()[1:]]
    assert runs["checked"] == runs["unchecked"] and len(runs["checked"]) == 2


def test_a_sparse_payload_shifted_stays_a_distribution():
    from opd_exp.training.advice import SHIFT_NATS, shifted

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)
    y = torch.randint(0, 7, (2, 3))
    lp, ids = teacher_topk(logits, 3)
    sparse = TeacherScores(topk_ids=ids, topk_logprobs=lp, sampled_logprobs=token_logprobs(logits, y))
    for sign in (-1.0, 1.0):
        out = shifted(sparse, y, sign)
        assert (out.topk_logprobs <= 0).all() and (out.topk_logprobs.exp().sum(-1) <= 1 + 1e-6).all()
        moved = (out.sampled_logprobs - sparse.sampled_logprobs).abs().max() + (out.topk_logprobs - lp).abs().max()
        assert moved >= SHIFT_NATS - 1e-6
    dense = shifted(TeacherScores(logits=logits), y, 1.0)
    assert (dense.token_logprobs(y) > token_logprobs(logits, y)).all()


# -- notices: a teacher at ~0 accuracy, a local pair on the toy world's batch and lr --------------


def _log(run: Path) -> str:
    return (run / "train.log").read_text() if (run / "train.log").is_file() else ""


@pytest.mark.parametrize("accuracy", [0.0, 0.5])
def test_a_teacher_at_zero_accuracy_is_said_once(accuracy, tiny_pair, tmp_path, monkeypatch, capsys):
    """Before: a teacher that solves nothing (a random one here) was distilled without a word."""
    t = Trainer(small_config(trainer={"max_steps": 1}), tmp_path, pair=_fresh(tiny_pair), task=AddTask())
    monkeypatch.setattr(t.teachers, "accuracy", lambda evaluator, engine: {"eval/teacher_accuracy": accuracy})
    t.run()
    err = capsys.readouterr().err
    want = (
        f"opd-train: warning: the teacher's eval accuracy is {accuracy:.3f} (<= 0.01) before training: the teacher solves "
        "(almost) none of the eval problems, so distilling it cannot raise the student's accuracy"
    )
    assert err.count(want) == _log(tmp_path).count(want) == (1 if accuracy == 0.0 else 0)


def test_a_local_pair_on_the_toy_batch_and_lr_is_told(tiny_pair, tmp_path, capsys):
    """Before: model_pair=local silently trained a real model at the toy world's batch 64, lr 3e-3."""
    local = ModelPairConfig(name="local", student="/models/s", teacher="/models/t")
    want = "opd-train: warning: model_pair=local trains with trainer.batch_size=64 and trainer.lr=0.003, the embedded toy world's"
    for trainer, told in (({"batch_size": 64, "lr": 3e-3}, True), ({"batch_size": 64, "lr": 1e-5}, False)):
        run = tmp_path / str(told)
        cfg = dataclasses.replace(small_config(trainer=trainer), model_pair=local)
        Trainer(cfg, run, pair=_fresh(tiny_pair), task=AddTask())
        err = capsys.readouterr().err
        assert (want in err) == (want in _log(run)) == told
        if told:
            assert "trainer.batch_size=32 trainer.lr=1e-6 (conf/model_pair/qwen3.yaml)" in err
    Trainer(small_config(trainer={"batch_size": 64, "lr": 3e-3}), tmp_path / "embedded", pair=_fresh(tiny_pair), task=AddTask())
    assert want not in capsys.readouterr().err  # the embedded world's own defaults
