"""GPU settings by config (opd_exp/runtime/precision.py), checked on CPU: gradient checkpointing gives
the same gradients, bf16 autocast and bf16 weights train with finite losses, the teacher can
live elsewhere, LoRA trains only adapters, and a missing peft fails at start-up in one line."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers.tiny import small_config
from opd_exp.config import schema as S
from opd_exp.runtime import precision as P
from opd_exp.runtime.errors import ConfigError

HAS_PEFT = importlib.util.find_spec("peft") is not None


def _grads(model, batch, vocab):
    from opd_exp.training.sampling import SamplingSpec
    from opd_exp.training.scoring import student_logits

    model.zero_grad(set_to_none=True)
    z = student_logits(model, batch, vocab, SamplingSpec())
    (z.log_softmax(-1)[..., 3] * batch.response_mask).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grad_checkpointing_gives_the_same_gradients(tiny_pair):
    from opd_exp.training.rollout import generate

    torch.manual_seed(0)
    batch = generate(
        tiny_pair.student, tiny_pair.tokenizer, ["1+2=", "33+4="], max_new_tokens=5, max_prompt_tokens=8, vocab_size=tiny_pair.vocab_size
    )
    model = tiny_pair.student.train()
    plain = _grads(model, batch, tiny_pair.vocab_size)
    P.enable_grad_checkpointing(model)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    ckpt = _grads(model, batch, tiny_pair.vocab_size)
    assert plain.keys() == ckpt.keys() and len(plain) > 5
    for k in plain:
        assert torch.allclose(plain[k], ckpt[k], rtol=1e-5, atol=1e-7), k


def _train(tiny_pair, add_task, tmp_path, steps=2, **trainer):
    from opd_exp.training.trainer import Trainer

    cfg = small_config(trainer=dict(max_steps=steps, **trainer), estimator=dict(name="full"))
    t = Trainer(cfg, tmp_path / "run", pair=tiny_pair, task=add_task)
    out = [t.train_step() for _ in range(steps)]
    return t, out


@pytest.mark.parametrize("param_dtype,precision", [("fp32", "bf16"), ("bf16", "bf16"), ("bf16", "fp32")])
def test_bf16_settings_train_and_stay_finite(tiny_pair, add_task, tmp_path, param_dtype, precision):
    before = {n: p.detach().float().clone() for n, p in tiny_pair.student.named_parameters()}
    t, out = _train(
        tiny_pair,
        add_task,
        tmp_path,
        param_dtype=S.ParamDtype(param_dtype),
        precision=S.Precision(precision),
        teacher_dtype=S.ParamDtype("bf16"),
    )
    want = torch.bfloat16 if param_dtype == "bf16" else torch.float32
    assert {p.dtype for p in t.student.parameters()} == {want}  # fp32: master weights stay fp32
    assert {p.dtype for p in t.teacher.parameters()} == {torch.bfloat16}
    assert all(torch.isfinite(torch.tensor(m["loss"])) and m["grad/skipped"] == 0.0 for m in out)
    moved = max(float((p.detach().float() - before[n]).abs().max()) for n, p in t.student.named_parameters())
    assert moved > 1e-4


def test_bf16_autocast_close_to_fp32(tiny_pair, add_task, tmp_path):
    """The first step's loss under bf16 autocast is within bf16 rounding of the fp32 one."""
    import copy

    pair32 = copy.deepcopy(tiny_pair)
    _, a = _train(pair32, add_task, tmp_path / "a", steps=1)
    _, b = _train(tiny_pair, add_task, tmp_path / "b", steps=1, precision=S.Precision.bf16)
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 0.05 * abs(a[0]["loss"]) + 1e-3, (a[0]["loss"], b[0]["loss"])


def test_teacher_on_another_device_gives_the_same_step(tiny_pair, add_task, tmp_path, monkeypatch):
    """A teacher on another device (here 'cpu:0', distinct from the student's 'cpu') is scored
    there and its logits brought back: the same losses as a teacher beside the student."""
    import copy

    from opd_exp.training.rollout import Batch
    from opd_exp.training.trainer import Trainer

    pair2 = copy.deepcopy(tiny_pair)
    _, a = _train(tiny_pair, add_task, tmp_path / "a", steps=2)
    cfg = small_config(trainer=dict(max_steps=2), estimator=dict(name="full"))
    t = Trainer(cfg, tmp_path / "b", pair=pair2, task=add_task)
    t.teacher_scorer.device = torch.device("cpu", 0)
    assert t.teacher_scorer.device != t.device
    moves = []
    real_to = Batch.to
    monkeypatch.setattr(Batch, "to", lambda self, dev: (moves.append(torch.device(dev)), real_to(self, dev))[1])
    b = [t.train_step() for _ in range(2)]
    assert torch.device("cpu", 0) in moves
    assert [m["loss"] for m in a] == [m["loss"] for m in b]


def test_teacher_device_choices():
    tc = S.ScaleConfig(teacher_device="same")
    assert P.teacher_device(tc, torch.device("cpu")) == torch.device("cpu")
    assert P.teacher_device(S.ScaleConfig(teacher_device="cpu"), torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ConfigError, match="scale.teacher_device"):
        S.ScaleConfig(teacher_device="gpu1")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            P.teacher_device(S.ScaleConfig(teacher_device="cuda:1"), torch.device("cpu"))


def test_schema_refuses_what_cannot_work():
    with pytest.raises(ConfigError, match="scale.precision='fp16'"):
        small_config(trainer=dict(param_dtype=S.ParamDtype.bf16, precision="fp16"))
    with pytest.raises(ConfigError, match="scale.lora_rank"):
        S.ScaleConfig(lora_rank=-1)
    with pytest.raises(ConfigError, match="scale.teacher_device='cuda:1'.*scale.parallel=ddp"):
        small_config(trainer=dict(parallel=S.Parallel.ddp, teacher_device="cuda:1"))
    with pytest.raises(ConfigError, match="rollout.engine='vllm'"):
        small_config(rollout=dict(engine=S.RolloutEngine.vllm), trainer=dict(parallel=S.Parallel.ddp))


def test_lora_without_peft_fails_before_models_load(monkeypatch, tmp_path, add_task):
    from opd_exp.training.trainer import Trainer

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    cfg = small_config(trainer=dict(lora_rank=4))

    class Boom:
        def __getattr__(self, name):
            raise AssertionError("a model was touched before the peft check")

    with pytest.raises(ConfigError) as ex:
        Trainer(cfg, tmp_path / "run", pair=Boom(), task=add_task)
    msg = str(ex.value)
    assert "\n" not in msg and "scale.lora_rank=4 needs the peft package" in msg and "opd-exp[lora]" in msg


@pytest.mark.skipif(not HAS_PEFT, reason="peft not installed (pip install 'opd-exp[lora]')")
def test_lora_trains_only_adapters(tiny_pair, tiny_dir, add_task, tmp_path):
    base = {n: p.detach().clone() for n, p in tiny_pair.student.named_parameters()}
    t, out = _train(tiny_pair, add_task, tmp_path, steps=2, lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    names = {n for n, p in t.student.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    assert {id(p) for p in t.params} == {id(p) for p in t.student.parameters() if p.requires_grad}
    in_opt = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in t.student.named_parameters() if "lora_" in n}
    for n, p in t.student.named_parameters():
        if "lora_" in n:
            continue
        key = n.replace("base_model.model.", "").replace(".base_layer", "")
        # frozen base weights: not in the optimizer, unchanged (an lr-1e-2 Adam step would move them ~1e-2;
        # in a full-suite run a ~1e-9 wobble of the tied embedding was seen, from peft's wrapping)
        assert torch.allclose(p.detach(), base[key], rtol=0, atol=1e-7), (n, float((p.detach() - base[key]).abs().max()))
    lora_b = [p for n, p in t.student.named_parameters() if "lora_B" in n]
    assert max(float(p.detach().abs().max()) for p in lora_b) > 0  # B starts at 0: it moved
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in out)
    t.save()  # a LoRA student checkpoints and resumes like any other
    from transformers import AutoModelForCausalLM

    fresh = copy_pair(tiny_pair, student=AutoModelForCausalLM.from_pretrained(tiny_dir / "student"))
    t2 = type(t)(t.cfg, tmp_path / "run", pair=fresh, task=add_task)
    assert t2.resume() and t2.step == 2
    for (n, p), (n2, p2) in zip(t.student.named_parameters(), t2.student.named_parameters()):
        assert n == n2 and torch.equal(p.detach(), p2.detach()), n


def copy_pair(pair, **kw):
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(pair), **kw})


@pytest.mark.skipif(not HAS_PEFT, reason="peft not installed")
def test_lora_unknown_target_module_fails_with_one_line(tiny_pair):
    with pytest.raises(ConfigError, match="lora_target_modules"):
        P.add_lora(tiny_pair.student, S.ScaleConfig(lora_rank=2, lora_target_modules=["qkv"]))
