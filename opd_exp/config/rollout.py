"""The ``rollout`` group: how responses are sampled (the sampling distribution is the trained one)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from opd_exp.config.checks import check as _check
from opd_exp.config.checks import fail as _fail
from opd_exp.config.checks import finite as _finite
from opd_exp.config.choices import RegistryChoice

# rollout.engine, a registry (training/engines.py; register_rollout_engine adds one). Built in:
# auto (lean, except with scale.parallel=fsdp: hf, sharded forwards need generate's synced_gpus) |
# hf (transformers generate on the training copy) | lean (our KV-cache decode loop on the training
# copy; Gumbel-max draws) | vllm (a vLLM engine, optional extra; weights synced after every update)
RolloutEngine = RegistryChoice("RolloutEngine", [(n, n) for n in ("auto", "hf", "lean", "vllm")])
# rollout.correction (training/staleness.py registers each): recompute | is | none
StalenessCorrection = RegistryChoice("StalenessCorrection", [(n, n) for n in ("recompute", "is", "none")])


class EnvTokens(Enum):
    """``rollout.env_tokens``: what an episode's environment tokens are to the loss."""

    # scored by the teacher, never trained (the student trains on its own tokens only)
    masked = "masked"
    # an ablation: trained as if the student had written them (the lab's lab_tool_masks arm)
    trained = "trained"


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
    # asynchronous OPD (training/staleness.py): the learner trains on rollouts sampled `staleness`
    # updates earlier, by a producer that samples ahead while the learner updates; 0: in the loop
    staleness: int = 0
    # with staleness > 0, named (no default): recompute (the sampled-token costs and log-probs
    # recomputed under the current student, times importance weights S_now/S_behaviour) | is (the
    # same weights on the costs as sampled) | none (no correction: biased, logged as such)
    correction: StalenessCorrection | None = None
    # truncation of those weights: min(w, is_cap) (null: untruncated; unbiased, higher variance)
    is_cap: float | None = 2.0
    # episodes (a task with an environment, opd_exp/tasks/environment.py): student turns per episode,
    # each ended by a stop string or EOS and answered by the environment. 1: one turn (a task
    # without an environment is always one turn, whatever this says)
    max_turns: int = 1
    # episodes: tokens after the prompt (the student's and the environment's together); an episode
    # that reaches it ends there (counted: episode/budget_stops). null: max_turns x max_new_tokens
    max_episode_tokens: int | None = None
    # episodes: masked (the environment's tokens are scored, never trained) | trained (an ablation:
    # the student is trained on them too, as if it had written them; docs/training.md, "Episodes")
    env_tokens: EnvTokens = EnvTokens.masked

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

        _check(isinstance(self.staleness, int) and 0 <= self.staleness <= 64, "rollout.staleness", self.staleness, "an integer 0..64")
        _check(
            self.is_cap is None or (_finite(self.is_cap) and self.is_cap >= 1.0),
            "rollout.is_cap",
            self.is_cap,
            ">= 1 (the weights' truncation), or null (untruncated)",
        )
        _check(isinstance(self.max_turns, int) and 1 <= self.max_turns <= 64, "rollout.max_turns", self.max_turns, "an integer 1..64")
        _check(
            self.max_episode_tokens is None or (isinstance(self.max_episode_tokens, int) and self.max_episode_tokens >= 1),
            "rollout.max_episode_tokens",
            self.max_episode_tokens,
            "an integer >= 1, or null (max_turns x max_new_tokens)",
        )

    @property
    def filtered(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0

    @property
    def episode_tokens(self) -> int:
        """An episode's token budget after the prompt (``max_episode_tokens``, or every turn at its cap)."""
        return self.max_episode_tokens or self.max_turns * self.max_new_tokens


def _lean_limit(parallel: str, lora: bool) -> str | None:
    if parallel == "fsdp":
        return "hf or vllm with scale.parallel=fsdp (sharded forwards need generate's synced_gpus)"
    return None


def _vllm_limit(parallel: str, lora: bool) -> str | None:
    if parallel != "none":
        return f"hf with scale.parallel={parallel} (the vLLM engine is single-process for now)"
    if lora:
        return "hf with scale.lora_rank > 0 (adapter weights are not synced into vLLM)"
    return None


# what an engine cannot do, from the run facts it reads (scale.parallel, LoRA on or off): why not,
# or None; an engine registered with limits adds its own (training/engines.py)
ENGINE_LIMITS = {"lean": _lean_limit, "vllm": _vllm_limit}


def validate_engine(cfg) -> None:
    """``rollout.engine``'s own limits (one line naming the engine and what is allowed)."""
    name = cfg.rollout.engine.value
    limit = ENGINE_LIMITS.get(name)
    reason = limit(cfg.scale.parallel.value, bool(cfg.scale.lora_rank)) if limit else None
    if reason:
        _fail("rollout.engine", name, reason)


def validate_staleness(cfg) -> None:
    """What ``rollout.staleness > 0`` needs: a named correction, and what the producer cannot do yet."""
    ro = cfg.rollout
    if ro.staleness == 0:
        return
    why = f"with rollout.staleness={ro.staleness}"
    if ro.correction is None:
        _fail(
            "rollout.correction",
            None,
            f"recompute, is or none {why} (a rollout sampled by an older student needs a named correction: recompute "
            "reweights the recomputed costs by S_now/S_behaviour, is reweights the sampled costs, none trains as if on-policy: biased)",
        )
    if ro.correction.value == "is" and cfg.estimator.name.value != "sampled":
        _fail(
            "rollout.correction", "is", f"recompute or none {why} and estimator={cfg.estimator.name.value} (is keeps sampled-token costs)"
        )
    if cfg.loss.name.value == "ppo":
        _fail("loss.name", "ppo", f"reinforce or direct {why} (PPO's ratio would need the behaviour policy's log-probs as its old ones)")
    if ro.on_policy_fraction < 1.0:
        _fail("rollout.on_policy_fraction", ro.on_policy_fraction, f"1.0 {why} (the producer samples the student only)")
    if ro.engine.value not in ("auto", "lean", "hf", "vllm"):  # a plugin engine: the producer would not be it
        _fail(
            "rollout.engine",
            ro.engine.value,
            f"auto, lean, hf or vllm {why} (the producer samples a copy of the student with an in-process decoder, or is vLLM's engine)",
        )
    if cfg.scale.parallel.value != "none":
        _fail("scale.parallel", cfg.scale.parallel.value, f"none {why} (one producer, one learner)")
