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

from opd_exp.config.baseline import Baseline as Baseline
from opd_exp.config.baseline import validate_baseline
from opd_exp.config.baseline import whole_groups as whole_groups
from opd_exp.config.checks import check as _check
from opd_exp.config.checks import fail as _fail
from opd_exp.config.checks import finite as _finite
from opd_exp.config.choices import RegistryChoice as _RegistryChoice
from opd_exp.config.loop import CheckpointConfig, EvalConfig, LoggerConfig, TrainerConfig
from opd_exp.config.loop import LoggerName as LoggerName
from opd_exp.config.loop import Schedule as Schedule
from opd_exp.config.positions import PositionsConfig, validate_positions
from opd_exp.config.reward import RewardConfig, validate_reward
from opd_exp.config.rollout import RolloutConfig, validate_engine, validate_staleness
from opd_exp.config.rollout import RolloutEngine as RolloutEngine
from opd_exp.config.scale import FusedLmHead as FusedLmHead
from opd_exp.config.scale import Parallel, ParamDtype, Precision, ScaleConfig, validate_fused_head
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
    # reads y, so unbiased; divergences/baseline.py), subtracted from the sampled cost: none | exact | topk | loo
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
    # verl, and what every pinned number was made with) | constant (rows x rollout.max_new_tokens, or
    # for episodes x their budget rollout.max_episode_tokens: unbiased for responses of any length)
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
    validate_baseline(cfg)
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
    validate_fused_head(cfg)
    validate_engine(cfg)
    validate_staleness(cfg)
    validate_teacher(cfg)
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
