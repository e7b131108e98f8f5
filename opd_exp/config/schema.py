"""Typed schema of an `opd-train` run: plain dataclasses registered in Hydra's ConfigStore.

Every field has a default and a one-line help. Closed choices are enums, so an unknown name
fails with the list of valid ones. Ranges are checked in ``__post_init__`` (run by
``OmegaConf.to_object``) and combinations in ``validate``, all before any model loads; each
failure is a ``ConfigError`` with one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING

from opd_exp.config.checks import check as _check
from opd_exp.config.checks import fail as _fail
from opd_exp.config.checks import finite as _finite
from opd_exp.config.choices import RegistryChoice as _RegistryChoice
from opd_exp.config.positions import PositionsConfig, validate_positions
from opd_exp.config.reward import RewardConfig, validate_reward
from opd_exp.config.teacher import Privileged as Privileged
from opd_exp.config.teacher import TeacherConfig, validate_teacher
from opd_exp.config.teacher import TeacherName as TeacherName
from opd_exp.config.teachers import TeachersConfig, validate_teachers

try:  # the embedded world's schemas
    from opd_exp.config.world import ModelPairConfig, TaskConfig
except ImportError:  # pragma: no cover - only while the world is not installed
    ModelPairConfig = TaskConfig = Any  # type: ignore[misc,assignment]


def _divergence_choices():
    from opd_exp.divergences import DIVERGENCES

    return [(n, n) for n in DIVERGENCES]


# Built from the divergence registry (rkl, fkl, jsd, skl, srkl, tvd, and registered ones).
DivergenceName = _RegistryChoice("DivergenceName", _divergence_choices())


def _on_new_divergence(cls) -> None:
    unknown = [k for k in cls.param_names if k not in _DIVERGENCE_KEYS]
    if unknown:
        raise ValueError(
            f"register_divergence: {cls.__name__} takes {', '.join(unknown)}, which the config cannot set; "
            f"allowed parameter names: {', '.join(_DIVERGENCE_KEYS)} (keys of divergence.)"
        )
    DivergenceName._add(cls.name)


# estimator.name: a registry (training/estimators.py; register_estimator adds one). Built in:
# sampled (REINFORCE on the sampled token's exact cost) | topk (exact over the teacher's top-k +
# unbiased sampled tail) | topk_renorm (ms-swift / NeMo-RL renormalised top-k; biased) |
# topk_student / topk_union (exact over the student's / both top-k sets + unbiased tail) |
# topk_generalized_kl (ms-swift MOPD; biased low, KL only) | topk_verl (verl *_topk; biased) |
# full (exact over the whole vocabulary)
EstimatorName = _RegistryChoice(
    "EstimatorName",
    [(n, n) for n in ("sampled", "topk", "topk_renorm", "topk_student", "topk_union", "topk_generalized_kl", "topk_verl", "full")],
)


class Baseline(Enum):
    none = "none"  # the sampled cost as it is
    # minus the score-weighted mean cost sum_v S_v w_v c_v / sum_v S_v w_v, w_v = |e_v - S|^2, over the
    # whole vocabulary (divergences/baseline.py; needs the teacher's whole distribution)
    exact = "exact"
    topk = "topk"  # the same from the teacher's top-k (estimator.k), its remaining mass spread evenly over the tail


class LossName(Enum):
    ppo = "ppo"
    reinforce = "reinforce"
    direct = "direct"


class Credit(Enum):
    token = "token"  # prefix-frozen per-token objective (GKD)
    # gradient of E_S[sum_t D_t] (future values added to the return); this is the
    # whole-sequence divergence only for rkl (KL has a chain rule, the others do not)
    sequence = "sequence"


class Normalizer(Enum):
    # the step's trained-token count (TRL / verl token-mean): random when responses end at EOS, so
    # the expected gradient is off the per-token target (docs/training.md, "The loss normaliser")
    tokens = "tokens"
    # rows x rollout.max_new_tokens: a constant, every expected-gradient statement exact
    constant = "constant"


class Schedule(Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


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


class RolloutEngine(Enum):
    auto = "auto"  # lean, except with scale.parallel=fsdp (hf: sharded forwards need generate's synced_gpus)
    hf = "hf"  # transformers generate on the training copy of the model
    lean = "lean"  # our own KV-cache decode loop on the training copy (Gumbel-max draws; no generate)
    vllm = "vllm"  # a vLLM engine (optional extra), weights synced after every update


class FusedLmHead(Enum):
    auto = "auto"  # fused where it wins: vocabulary >= 32768, one process, no LoRA, a plain Linear head
    on = "on"  # always fused (a model it cannot cover is an error)
    off = "off"  # always the materialised [N, R, V] logits


class LoggerName(Enum):
    wandb = "wandb"
    none = "none"


@dataclass
class DivergenceConfig:
    """Which divergence D(S, T) the student lowers, per response position."""

    # rkl KL(S||T) | fkl KL(T||S) | jsd | skl KL(T||aT+(1-a)S) | srkl KL(S||aS+(1-a)T) | tvd
    # | jsd_legacy (jsd with the pre-fix sampled cost: wrong, for reproducing that bug only)
    # | any registered with register_divergence (docs/extending.md)
    name: DivergenceName = DivergenceName.fkl
    # jsd mixing weight, TRL/GKD convention: M = beta*T + (1-beta)*S; beta=0 is fkl, beta=1 is rkl.
    # (Trinity-RFT's lambda_coef documents the reverse endpoints.)
    beta: float = 0.5
    # skl/srkl skew in (0, 1)
    alpha: float = 0.1
    # divides the TEACHER's logits; the student side is the rollout's sampling distribution
    temperature: float = 1.0
    # fkl only: clip of the importance weight exp(t - s) in the sampled cost (null: no clip);
    # bites with estimator=sampled and in topk's sampled tail, nowhere else
    clip: float | None = None

    def __post_init__(self) -> None:
        _check(_finite(self.beta) and 0.0 <= self.beta <= 1.0, "divergence.beta", self.beta, "0 <= beta <= 1")
        _check(_finite(self.alpha) and 0.0 < self.alpha < 1.0, "divergence.alpha", self.alpha, "0 < alpha < 1")
        _check(_finite(self.temperature) and self.temperature > 0, "divergence.temperature", self.temperature, "> 0")
        if self.clip is not None:
            _check(_finite(self.clip) and self.clip > 0, "divergence.clip", self.clip, "null or > 0")

    def params(self) -> dict[str, float]:
        """Keyword arguments of ``get_divergence`` for this divergence (unset ones left out);
        also what W&B logs of this group (a jsd run has no alpha)."""
        from opd_exp.divergences import parameter_names

        return {k: getattr(self, k) for k in parameter_names(self.name.value) if getattr(self, k) is not None}


_DIVERGENCE_KEYS = ("beta", "alpha", "clip")  # the DivergenceConfig fields a divergence may take


def _hook_registry() -> None:
    from opd_exp.divergences import on_register

    on_register(_on_new_divergence)


_hook_registry()


@dataclass
class EstimatorConfig:
    """How the gradient of D per position is estimated."""

    name: EstimatorName = EstimatorName.full
    # top-k size of every topk* estimator (the teacher's, the student's, or each of both)
    k: int = 16
    # rows per chunk of the full-vocab path (null: sized from the vocabulary)
    chunk_size: int | None = None
    # estimator=sampled: a control variate b per position (the score-weighted mean cost under S; never
    # reads y, so unbiased; divergences/baseline.py), subtracted from the sampled cost: none | exact | topk
    baseline: Baseline = Baseline.none

    def __post_init__(self) -> None:
        _check(isinstance(self.k, int) and self.k >= 1, "estimator.k", self.k, "integer >= 1")
        if self.chunk_size is not None:
            _check(self.chunk_size >= 1, "estimator.chunk_size", self.chunk_size, "null or >= 1")


@dataclass
class LossConfig:
    """The loss form that turns per-token costs/estimates into a gradient."""

    # ppo: clipped surrogate, A = -kl_coef*R (sampled only); reinforce; direct: GKD-style loss
    name: LossName = LossName.direct
    # scale of the distillation term (Trinity-RFT kl_coef, AReno opd_kl_coef); 0 with reward.coef > 0: reward-only RL
    kl_coef: float = 1.0
    # token: prefix-frozen per-token objective (GKD); sequence: the gradient of E_S[sum_t D_t]
    # (prefix distribution moves too), the whole-sequence divergence only for rkl
    credit: Credit = Credit.token
    # discount of future values in sequence credit, [0, 1]
    gamma: float = 1.0
    # PPO ratio clip epsilon
    clip_eps: float = 0.2
    # PPO passes over each rollout (loss=ppo, estimator=sampled); with ppo_mini_batches=1 and
    # ppo_epochs=1 there is one update per rollout, the ratio is 1 and ppo equals reinforce
    ppo_epochs: int = 1
    # optimizer steps per PPO pass, each on a disjoint share of the rollout's rows (docs/training.md)
    ppo_mini_batches: int = 1
    # what the summed loss is divided by: tokens (the step's trained tokens; the default, as TRL and
    # verl, and what every pinned number was made with) | constant (rows x rollout.max_new_tokens:
    # unbiased for responses of any length)
    normalizer: Normalizer = Normalizer.tokens

    def __post_init__(self) -> None:
        _check(_finite(self.kl_coef) and self.kl_coef >= 0, "loss.kl_coef", self.kl_coef, "> 0, or 0 with reward.coef > 0 (reward-only RL)")
        _check(_finite(self.gamma) and 0.0 <= self.gamma <= 1.0, "loss.gamma", self.gamma, "0 <= gamma <= 1")
        _check(_finite(self.clip_eps) and 0.0 < self.clip_eps < 1.0, "loss.clip_eps", self.clip_eps, "0 < clip_eps < 1")
        _check(isinstance(self.ppo_epochs, int) and self.ppo_epochs >= 1, "loss.ppo_epochs", self.ppo_epochs, "integer >= 1")
        _check(
            isinstance(self.ppo_mini_batches, int) and self.ppo_mini_batches >= 1,
            "loss.ppo_mini_batches",
            self.ppo_mini_batches,
            "integer >= 1",
        )

    @property
    def ppo_updates(self) -> int:
        """Optimizer steps per rollout."""
        return self.ppo_epochs * self.ppo_mini_batches


@dataclass
class RolloutConfig:
    """How responses are sampled."""

    # responses sampled per prompt
    n_samples: int = 1
    # sampling temperature (divides the student's logits; also the student side of D)
    temperature: float = 1.0
    # nucleus sampling mass (1.0: off); the student side of D is the filtered distribution,
    # so fkl (and jsd at beta=0) is infinite under a filter and refused
    top_p: float = 1.0
    # top-k sampling (0: off); same as top_p for fkl. A checkpoint's own generation_config
    # (repetition_penalty, no_repeat_ngram_size, min_p, ...) is never applied to rollouts
    top_k: int = 0
    # prompts longer than this are truncated from the left
    max_prompt_tokens: int = 256
    # response length cap
    max_new_tokens: int = 40
    # GKD's lambda: share of steps whose responses the student samples (the rest: the teacher)
    on_policy_fraction: float = 1.0
    # auto: lean (hf under scale.parallel=fsdp) | hf: transformers generate | lean: our
    # KV-cache decode loop over the same module (the same distribution, a fraction of
    # generate's per-token overhead; docs/training.md) | vllm: a vLLM engine (pip install 'opd-exp[vllm]'; docs/scale.md)
    engine: RolloutEngine = RolloutEngine.auto
    # vllm only: share of the GPU's memory the engine may take (the trainer needs the rest)
    vllm_gpu_memory_utilization: float = 0.3

    def __post_init__(self) -> None:
        _check(
            _finite(self.vllm_gpu_memory_utilization) and 0.0 < self.vllm_gpu_memory_utilization < 1.0,
            "rollout.vllm_gpu_memory_utilization",
            self.vllm_gpu_memory_utilization,
            "0 < x < 1",
        )
        _check(self.n_samples >= 1, "rollout.n_samples", self.n_samples, "integer >= 1")
        _check(_finite(self.temperature) and self.temperature > 0, "rollout.temperature", self.temperature, "> 0")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "rollout.top_p", self.top_p, "0 < top_p <= 1")
        _check(self.top_k >= 0, "rollout.top_k", self.top_k, "integer >= 0 (0: off)")
        _check(self.max_prompt_tokens >= 1, "rollout.max_prompt_tokens", self.max_prompt_tokens, "integer >= 1")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", self.max_new_tokens, "integer >= 1")
        _check(
            _finite(self.on_policy_fraction) and 0.0 <= self.on_policy_fraction <= 1.0,
            "rollout.on_policy_fraction",
            self.on_policy_fraction,
            "0 <= on_policy_fraction <= 1",
        )

    @property
    def filtered(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


@dataclass
class TrainerConfig:
    """The optimisation loop: steps, batch, optimiser, schedule, logging and the step monitors."""

    # optimizer steps
    max_steps: int = 2500
    # distinct prompts per step (each sampled rollout.n_samples times)
    batch_size: int = 64
    # sequences per forward/backward (0: all at once); the loss is normalised by the step's
    # global response-token count, so accumulation equals one big batch
    micro_batch_size: int = 0
    # peak learning rate (AdamW)
    lr: float = 3e-3
    weight_decay: float = 0.0
    # learning-rate schedule after warm-up
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 20
    # gradient-norm clip (0: off)
    grad_clip: float = 1.0
    # log metrics every N steps
    log_every: int = 1
    # console progress bar
    progress: bool = True
    # stop (exit 3) after this many steps in a row whose loss, gradient norm or teacher
    # log-probs were NaN/inf; each such step is skipped (no update) and counted
    max_bad_steps: int = 10
    # exact/jsd, exact/kl_reverse, exact/kl_forward every step on the step's own rollout (read off
    # the monitors' one pass over [tokens, V]); false drops them
    exact_metrics: bool = True
    # size of the top-k sets of overlap/teacher_mass, overlap/student_mass, overlap/ratio; 0 drops
    # those three (their two top-k searches are the monitors' largest cost at small vocabularies)
    overlap_k: int = 8

    def __post_init__(self) -> None:
        _check(
            isinstance(self.overlap_k, int) and self.overlap_k >= 0, "trainer.overlap_k", self.overlap_k, "integer >= 0 (0: no overlap/*)"
        )
        _check(self.max_steps >= 0, "trainer.max_steps", self.max_steps, "integer >= 0")
        _check(self.batch_size >= 1, "trainer.batch_size", self.batch_size, "integer >= 1")
        _check(self.micro_batch_size >= 0, "trainer.micro_batch_size", self.micro_batch_size, "integer >= 0")
        _check(_finite(self.lr) and self.lr >= 0, "trainer.lr", self.lr, ">= 0")
        _check(_finite(self.weight_decay) and self.weight_decay >= 0, "trainer.weight_decay", self.weight_decay, ">= 0")
        _check(self.warmup_steps >= 0, "trainer.warmup_steps", self.warmup_steps, "integer >= 0")
        _check(
            _finite(self.grad_clip) and self.grad_clip >= 0,
            "trainer.grad_clip",
            self.grad_clip,
            "a finite number >= 0, the largest gradient norm kept (0 turns clipping off, which is what inf would mean)",
        )
        for key in ("log_every", "max_bad_steps"):
            _check(getattr(self, key) >= 1, f"trainer.{key}", getattr(self, key), "integer >= 1")


@dataclass
class EvalConfig:
    """Evaluation on the task's eval split (greedy; optional temperature-1 samples)."""

    # evaluate every N steps (0: only before and after training)
    every: int = 250
    # eval prompts (0: the task's whole eval split); more than the split holds is refused
    size: int = 0
    # sequences per eval generation batch
    batch_size: int = 128
    # k temperature-1 samples per eval prompt for eval/precision, eval/pass@k, eval/entropy and
    # (tasks that list their answers) eval/coverage; 0: off (greedy eval only, the default's cost)
    samples: int = 0

    def __post_init__(self) -> None:
        for key in ("every", "size", "samples"):
            _check(getattr(self, key) >= 0, f"eval.{key}", getattr(self, key), "integer >= 0")
        _check(self.batch_size >= 1, "eval.batch_size", self.batch_size, "integer >= 1")


@dataclass
class CheckpointConfig:
    """Checkpoints in the run folder, and what a resume may change."""

    # checkpoint every N steps (0: only at the end)
    every: int = 250
    # complete checkpoints kept in the run folder
    keep: int = 2
    # resume a run folder whose checkpoint was made with other settings (e.g. a larger
    # trainer.max_steps): without it such a resume is refused, naming the keys that differ. The
    # learning rate continues from the checkpoint's value, decaying over the remaining steps;
    # each session's overrides are appended to <run>/history.yaml
    extend: bool = False

    def __post_init__(self) -> None:
        _check(self.every >= 0, "checkpoint.every", self.every, "integer >= 0")
        _check(self.keep >= 1, "checkpoint.keep", self.keep, "integer >= 1")


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


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl (always written)."""

    name: LoggerName = LoggerName.wandb
    project: str = "opd-exp"
    entity: str | None = None
    group: str | None = None
    job_type: str | None = "train"
    tags: list[str] = field(default_factory=list)
    # offline: no network; online; disabled
    mode: str = "offline"
    # when W&B cannot start (bad key, no network, disk full): fail (one line, exit 2) | offline
    on_error: str = "fail"

    def __post_init__(self) -> None:
        _check(self.mode in ("offline", "online", "disabled"), "logger.mode", self.mode, "offline, online, disabled")
        _check(self.on_error in ("fail", "offline"), "logger.on_error", self.on_error, "fail, offline")


@dataclass
class TrainConfig:
    """One `opd-train` run."""

    # student/teacher/tokenizer (conf/model_pair/*)
    model_pair: ModelPairConfig = MISSING  # type: ignore[assignment]
    # prompts, answers and verifier (conf/task/*)
    task: TaskConfig = MISSING  # type: ignore[assignment]
    # seeds the data order, sampling and the on/off-policy draw of each step; -2**63 <= seed < 2**63
    seed: int = 0
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    positions: PositionsConfig = field(default_factory=PositionsConfig)  # which positions the loss counts, weighted how
    reward: RewardConfig = field(default_factory=RewardConfig)  # the task's reward beside distillation (config/reward.py)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    teachers: TeachersConfig = field(default_factory=TeachersConfig)  # several teachers, routed (config/teachers.py)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # free-form run name (W&B name, summary line)
    name: str | None = None

    def __post_init__(self) -> None:
        # torch's generators take 64-bit seeds; per-step seeds are derived modulo 2**63
        _check(-(2**63) <= self.seed < 2**63, "seed", self.seed, "an integer with -2**63 <= seed < 2**63 (torch's seed range)")
        validate(self)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check combinations that cannot work; ranges are checked by each group."""
    est, loss = cfg.estimator.name, cfg.loss.name
    if loss is LossName.ppo and est is not EstimatorName.sampled:
        _fail(
            "estimator.name",
            est.value,
            "sampled with loss=ppo (PPO's ratio needs sampled-token costs; use loss=reinforce or direct)",
        )
    if loss is LossName.direct and est is EstimatorName.sampled:
        _fail(
            "loss.name",
            loss.value,
            "ppo or reinforce with estimator=sampled (a direct loss needs estimator=full, topk or topk_renorm)",
        )
    if loss is LossName.direct and cfg.loss.credit is Credit.sequence:
        _fail("loss.credit", cfg.loss.credit.value, "token with loss=direct (sequence credit needs ppo or reinforce)")
    validate_ppo(cfg)
    validate_positions(cfg)
    validate_reward(cfg)
    validate_teachers(cfg)
    if cfg.estimator.baseline is not Baseline.none and est is not EstimatorName.sampled:
        _fail(
            "estimator.baseline",
            cfg.estimator.baseline.value,
            f"none with estimator={est.value} (the baseline is subtracted from estimator=sampled's cost)",
        )
    if cfg.divergence.name is DivergenceName.jsd_legacy:
        if est is not EstimatorName.sampled:
            _fail("estimator.name", est.value, "sampled with divergence=jsd_legacy (only its sampled cost differs from jsd)")
        _check(0.0 < cfg.divergence.beta < 1.0, "divergence.beta", cfg.divergence.beta, "0 < beta < 1 with divergence=jsd_legacy")
    if cfg.divergence.clip is not None and cfg.divergence.name is not DivergenceName.fkl:
        _fail("divergence.clip", cfg.divergence.clip, f"null for divergence={cfg.divergence.name.value} (clip is fkl's)")
    if cfg.divergence.clip is not None and est in _NO_SAMPLED_COST:
        _fail(
            "divergence.clip",
            cfg.divergence.clip,
            f"null with estimator={est.value} (the clip caps the sampled cost; estimator={est.value} uses none)",
        )
    ro, div = cfg.rollout, cfg.divergence
    validate_topk_variant(cfg)
    forward_kl = div.name is DivergenceName.fkl or (div.name is DivergenceName.jsd and div.beta == 0.0)
    if forward_kl and ro.filtered:
        key, value = ("rollout.top_k", ro.top_k) if ro.top_k > 0 else ("rollout.top_p", ro.top_p)
        name = "fkl" if div.name is DivergenceName.fkl else "jsd with beta=0"
        _fail(
            key,
            value,
            f"{'0' if key.endswith('top_k') else '1.0'} (off) with divergence={name}: KL(T||S) is infinite where the "
            "teacher has mass the filter removes; use rkl, jsd (beta > 0), skl, srkl or tvd with a filter",
        )
    tc = cfg.scale
    if tc.param_dtype is ParamDtype.bf16 and tc.precision is Precision.fp16:
        _fail("scale.precision", "fp16", "fp32 or bf16 with scale.param_dtype=bf16 (fp16 autocast over bf16 weights loses range)")
    if tc.parallel is not Parallel.none and tc.teacher_device not in ("same", "cpu"):
        _fail(
            "scale.teacher_device",
            tc.teacher_device,
            f"same or cpu with scale.parallel={tc.parallel.value} (each rank's teacher sits beside its student)",
        )
    if tc.parallel is not Parallel.none and tc.device == "mps":
        _fail("scale.device", "mps", f"auto, cpu, cuda with scale.parallel={tc.parallel.value} (no process group backend for mps)")
    if tc.fused_lm_head is FusedLmHead.on and tc.parallel is not Parallel.none:
        _fail("scale.fused_lm_head", "on", f"auto or off with scale.parallel={tc.parallel.value} (the fused path is single-process)")
    if tc.fused_lm_head is FusedLmHead.on and tc.lora_rank:
        _fail("scale.fused_lm_head", "on", "auto or off with scale.lora_rank > 0 (a LoRA student's backbone is wrapped)")
    if cfg.rollout.engine is RolloutEngine.lean and tc.parallel is Parallel.fsdp:
        _fail("rollout.engine", "lean", "hf or vllm with scale.parallel=fsdp (sharded forwards need generate's synced_gpus)")
    validate_teacher(cfg)
    if cfg.rollout.engine is RolloutEngine.vllm:
        if tc.parallel is not Parallel.none:
            _fail("rollout.engine", "vllm", f"hf with scale.parallel={tc.parallel.value} (the vLLM engine is single-process for now)")
        if tc.lora_rank:
            _fail("rollout.engine", "vllm", "hf with scale.lora_rank > 0 (adapter weights are not synced into vLLM)")
    return cfg


# estimators whose loss uses no sampled-token cost (divergence.clip would cap nothing)
_NO_SAMPLED_COST = (EstimatorName.full, EstimatorName.topk_renorm, EstimatorName.topk_generalized_kl, EstimatorName.topk_verl)
# the top-k estimators of divergences/topk_variants.py routed through TOPK_ESTIMATORS
TOPK_VARIANTS = (EstimatorName.topk_student, EstimatorName.topk_union, EstimatorName.topk_generalized_kl, EstimatorName.topk_verl)


def validate_topk_variant(cfg: TrainConfig) -> None:
    """What the TOPK_ESTIMATORS variants refuse, known from the config alone (a served teacher
    whose top-k misses the vocabulary: the objective, once the vocabulary is known)."""
    est, ro, div = cfg.estimator.name, cfg.rollout, cfg.divergence
    if est not in TOPK_VARIANTS:
        return
    if ro.filtered:
        key, value = ("rollout.top_k", ro.top_k) if ro.top_k > 0 else ("rollout.top_p", ro.top_p)
        _fail(
            key,
            value,
            f"{'0' if key.endswith('top_k') else '1.0'} (off) with estimator={est.value}: its estimate is not defined under a "
            "sampling filter (no filtered-mass term); use estimator=topk, full or sampled with a filter",
        )
    kl = div.name.value in ("rkl", "fkl") or (div.name.value == "jsd" and div.beta in (0.0, 1.0))
    if est is EstimatorName.topk_generalized_kl and not kl:
        key, value = ("divergence.beta", div.beta) if div.name.value == "jsd" else ("divergence.name", div.name.value)
        _fail(key, value, "rkl, fkl, or jsd with beta 0 or 1 with estimator=topk_generalized_kl (the generalised KL is a KL's)")


def validate_ppo(cfg: TrainConfig) -> None:
    """Several PPO updates per rollout (loss.ppo_epochs, loss.ppo_mini_batches): where they apply."""
    lo = cfg.loss
    if lo.ppo_updates == 1:
        return
    key, value = ("loss.ppo_epochs", lo.ppo_epochs) if lo.ppo_epochs > 1 else ("loss.ppo_mini_batches", lo.ppo_mini_batches)
    est, tc, ro = cfg.estimator.name, cfg.scale, cfg.rollout
    if lo.name is not LossName.ppo or est is not EstimatorName.sampled:
        _fail(
            key, value, f"1 with loss={lo.name.value} estimator={est.value} (several updates per rollout need loss=ppo estimator=sampled)"
        )
    if ro.on_policy_fraction < 1.0:
        _fail(
            key,
            value,
            f"1 with rollout.on_policy_fraction={ro.on_policy_fraction!r} (teacher-sampled steps use the exact full-vocabulary "
            "loss, which has no behaviour policy to clip against); allowed: rollout.on_policy_fraction=1.0",
        )
    if tc.parallel is not Parallel.none:
        _fail(key, value, f"1 with scale.parallel={tc.parallel.value} (several updates per rollout are single-process for now)")
    rows = cfg.trainer.batch_size * ro.n_samples
    _check(
        lo.ppo_mini_batches <= rows,
        "loss.ppo_mini_batches",
        lo.ppo_mini_batches,
        f"at most the rollout's {rows} rows (trainer.batch_size x rollout.n_samples)",
    )
