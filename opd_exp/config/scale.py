"""The ``scale`` group: devices, precision, parallelism, LoRA and the LM head (docs/scale.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from opd_exp.config.baseline import whole_groups
from opd_exp.config.checks import check as _check
from opd_exp.config.checks import finite as _finite


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Parallel(Enum):
    none = "none"  # one process
    ddp = "ddp"  # torch DistributedDataParallel, one process per device (torchrun)
    fsdp = "fsdp"  # FSDP2 (torch.distributed.fsdp.fully_shard): student sharded across ranks


class ParamDtype(Enum):
    fp32 = "fp32"  # fp32 weights (with precision=bf16: bf16 autocast over fp32 master weights)
    bf16 = "bf16"  # bf16 weights (and bf16 optimizer state): half the memory, no master copy


class FusedLmHead(Enum):
    auto = "auto"  # fused where it wins: vocabulary >= 32768, one process, no LoRA, a plain Linear head
    on = "on"  # always fused (a model it cannot cover is an error)
    off = "off"  # always the materialised [N, R, V] logits


@dataclass
class ScaleConfig:
    """Where and how big: device, precision, dtypes, processes, teacher placement, the fused
    head and LoRA. Overlays in conf/scale/ (scale=gpu, scale=ddp) set the usual combinations."""

    # auto | cpu | cuda | cuda:N | mps
    device: str = "auto"
    # autocast precision of forward passes
    precision: Precision = Precision.fp32
    # CPU threads for torch (0: torch's default). 1 by default: the embedded models' ops are
    # too small to split, and on a shared machine extra threads spin (measured 30x slower)
    num_threads: int = 1
    # none | ddp | fsdp: multi-process training under torchrun (docs/scale.md); with ddp/fsdp
    # trainer.batch_size is the GLOBAL batch, split across ranks, and each sampled row draws from
    # its own generator keyed by (seed, step, global row), so any world size samples the same batch
    parallel: Parallel = Parallel.none
    # student weights: fp32 (master weights; add precision=bf16 for autocast) | bf16
    param_dtype: ParamDtype = ParamDtype.fp32
    # teacher weights (no grad, never updated): fp32 | bf16
    teacher_dtype: ParamDtype = ParamDtype.fp32
    # recompute the student's activations in backward (less memory, ~30% more compute)
    grad_checkpointing: bool = False
    # auto | on | off: compute the LM heads, the objective and its gradient a chunk of response
    # positions at a time from the final hidden states, so no [N, R, V] logits exist for either
    # model (docs/training.md); auto: on for vocabularies >= 32768 where the model allows it
    fused_lm_head: FusedLmHead = FusedLmHead.auto
    # where the teacher lives: same (the student's device) | cpu | cuda | cuda:N
    teacher_device: str = "same"
    # LoRA adapters on the student (0: off, full fine-tuning); needs peft (opd-exp[lora])
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    # module names that get adapters (Qwen/Llama attention projections by default)
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def __post_init__(self) -> None:
        tdev = self.teacher_device
        _check(
            tdev in ("same", "cpu", "cuda") or (tdev.startswith("cuda:") and tdev[5:].isdigit()),
            "scale.teacher_device",
            tdev,
            "same, cpu, cuda, cuda:N",
        )
        _check(isinstance(self.lora_rank, int) and self.lora_rank >= 0, "scale.lora_rank", self.lora_rank, "integer >= 0 (0: off)")
        _check(_finite(self.lora_alpha) and self.lora_alpha > 0, "scale.lora_alpha", self.lora_alpha, "> 0")
        _check(_finite(self.lora_dropout) and 0.0 <= self.lora_dropout < 1.0, "scale.lora_dropout", self.lora_dropout, "0 <= x < 1")
        _check(len(self.lora_target_modules) >= 1, "scale.lora_target_modules", self.lora_target_modules, "at least one module name")
        _check(self.num_threads >= 0, "scale.num_threads", self.num_threads, "integer >= 0")
        dev = self.device
        ok = dev in ("auto", "cpu", "cuda", "mps") or (dev.startswith("cuda:") and dev[5:].isdigit())
        _check(ok, "scale.device", dev, "auto, cpu, cuda, cuda:N, mps")


def fused_head_limit(cfg) -> str | None:
    """Why the fused LM head cannot serve this run (None: it can). Its limits, stated once: one
    process, no LoRA, one in-process teacher with this tokenizer (it reads that teacher's hidden
    states). ``scale.fused_lm_head=on`` with a limit is refused in one line; ``auto`` skips the fused
    head there. What a model itself allows is checked when it loads (``training/fused.py``)."""
    sc, te = cfg.scale, cfg.teacher
    if sc.parallel.value != "none":
        return f"with scale.parallel={sc.parallel.value} (the fused path is single-process)"
    if sc.lora_rank:
        return "with scale.lora_rank > 0 (a LoRA student's backbone is wrapped)"
    if te.served:
        return "with teacher=served (the fused head needs the teacher's hidden states)"
    n = len(cfg.teachers.map) if cfg.teachers.active else 1
    if n > 1:
        return f"with {n} teachers (teachers.map): the fused head holds one teacher"
    if te.align == "bytes":
        return "with teacher.align=bytes (the teacher scores its own tokens)"
    group = whole_groups(cfg)
    if group is not None:
        return f"with {group[0]} (it reads a prompt's samples as whole rows; the fused head cuts positions)"
    if cfg.rollout.staleness:
        return "with rollout.staleness > 0 (the importance weights are products over each row's whole response)"
    return None


def validate_fused_head(cfg) -> None:
    reason = fused_head_limit(cfg)
    if reason and cfg.scale.fused_lm_head is FusedLmHead.on:
        from opd_exp.config.checks import fail

        fail("scale.fused_lm_head", "on", f"auto or off {reason}")
