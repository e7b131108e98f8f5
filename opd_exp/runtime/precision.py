"""GPU settings of the student and the teacher, from ``trainer.*``: weight dtypes, autocast,
gradient checkpointing, where the teacher lives, and an optional LoRA student (peft).

* ``param_dtype=fp32`` + ``precision=bf16``: bf16 autocast over fp32 master weights (AdamW
  updates fp32 weights; matmuls run in bf16). ``param_dtype=bf16``: the student's weights and
  optimizer state are bf16 (half the memory, no master copy; small updates can round away).
  The objective always works in fp32 (``sampling_logits`` and the teacher logits are upcast).
* ``teacher_dtype=bf16``: the frozen teacher in bf16 (it is never updated: no master copy needed).
* ``grad_checkpointing``: HF's non-reentrant activation checkpointing on the student; the same
  gradients (tests/test_precision.py) for about a third more compute.
* ``teacher_device``: ``same`` (the student's device) or another device, e.g. ``cuda:1`` on a
  two-GPU node or ``cpu``; scoring moves the batch there and the logits back.
* ``lora_rank > 0``: peft LoRA adapters on ``lora_target_modules``; only adapter weights train.
  Needs peft: without it the run fails at start-up with one line, before any model loads.
"""

from __future__ import annotations

import importlib.util

import torch

from opd_exp.runtime.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def require_peft(tc) -> None:
    """Fail at start-up (one line) when LoRA is asked for and peft is not installed."""
    if tc.lora_rank and importlib.util.find_spec("peft") is None:
        raise ConfigError(
            f"scale.lora_rank={tc.lora_rank} needs the peft package, which is not installed; "
            f"allowed: pip install 'opd-exp[lora]' (or peft), or scale.lora_rank=0"
        )


def teacher_device(tc, student_device: torch.device) -> torch.device:
    name = tc.teacher_device
    if name == "same":
        return student_device
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"scale.teacher_device={name!r}: CUDA is not available here; allowed: same, cpu")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"scale.teacher_device={name!r}: only {torch.cuda.device_count()} CUDA devices; allowed: same, cpu, cuda:0..")
    return torch.device(name)


def autocast(device: torch.device, precision: str):
    """The forward passes' autocast context (a no-op for fp32)."""
    import contextlib

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def enable_grad_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing (works with DDP, FSDP2, LoRA and frozen inputs)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ConfigError(f"scale.grad_checkpointing=true: {type(model).__name__} does not support it; allowed: false")
    if hasattr(model, "config"):
        model.config.use_cache = False


def add_lora(model, tc):
    """Wrap the student in peft LoRA adapters; returns the peft model (only adapters train)."""
    require_peft(tc)
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in tc.lora_target_modules if m not in names]
    if missing:
        raise ConfigError(
            f"scale.lora_target_modules={list(tc.lora_target_modules)}: {missing} not in the student; "
            f"allowed: module names such as q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
        )
    lcfg = LoraConfig(
        r=tc.lora_rank,
        lora_alpha=tc.lora_alpha,
        lora_dropout=tc.lora_dropout,
        target_modules=list(tc.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lcfg)


def prepare_student(model, tc, device: torch.device):
    """The student as configured: dtype, device, gradient checkpointing, LoRA."""
    model = model.to(device=device, dtype=DTYPES[tc.param_dtype.value])
    if tc.grad_checkpointing:
        enable_grad_checkpointing(model)
    if tc.lora_rank:
        model = add_lora(model, tc)
        if tc.grad_checkpointing and hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    return model


def prepare_teacher(model, tc, device: torch.device):
    """The teacher frozen (no grad, eval mode) in its dtype on its device."""
    model = model.to(device=device, dtype=DTYPES[tc.teacher_dtype.value])
    return model.eval().requires_grad_(False)
