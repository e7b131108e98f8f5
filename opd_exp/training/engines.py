"""Engines picked once from config: which rollout engine samples for the student and for the
teacher, and what a run records of its pair. The loop asks
none of these again."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd_exp.config.positions import positions_notices
from opd_exp.config.schema import TrainConfig
from opd_exp.runtime import files, fingerprint
from opd_exp.runtime import precision as prec
from opd_exp.training.positions import training_rollout_config
from opd_exp.training.rollout import ModuleRollout, RolloutEngine


@dataclass(frozen=True)
class Engines:
    """The run's rollout engines: the student's (trained on), the teacher's (on_policy_fraction < 1),
    and greedy evaluation's (HF ``generate`` over the live modules)."""

    student: RolloutEngine
    teacher: RolloutEngine
    eval_student: RolloutEngine
    eval_teacher: RolloutEngine


def build_engines(cfg: TrainConfig, student, teacher, tokenizer, vocab_size: int, *, autocast, synced_gpus: bool, warn) -> Engines:
    train = training_rollout_config(cfg)  # positions=first_n: training rollouts stop early, evaluation does not
    for line in positions_notices(cfg):
        warn(line)
    own = build_student_engine(train, student, tokenizer, vocab_size, autocast=autocast, synced_gpus=synced_gpus, warn=warn)
    teacher_engine = in_process_engine(train, teacher, tokenizer, vocab_size, source="teacher", autocast=autocast)
    eval_teacher = (
        teacher_engine if train is cfg else in_process_engine(cfg, teacher, tokenizer, vocab_size, source="teacher", autocast=autocast)
    )
    greedy = ModuleRollout(student, tokenizer, cfg.rollout, vocab_size, autocast=autocast)
    return episodes_for_task(cfg, train, Engines(own, teacher_engine, greedy, eval_teacher), warn)


def episodes_for_task(cfg: TrainConfig, train: TrainConfig, engines: Engines, warn) -> Engines:
    """A task with an environment (``tasks/environment.py``) samples episodes: every engine runs
    turn by turn against it (``training/episodes.py``), the training ones recording their episodes
    for the step's metrics; eval accuracy is then over episodes. Without one: the engines as built."""
    from opd_exp.tasks.environment import build_environment
    from opd_exp.training.episodes import EpisodeLog, episode_engine

    env = build_environment(cfg.task)
    if env is None:
        if cfg.rollout.env_tokens.value != "masked":
            from opd_exp.config.checks import fail

            fail(
                "rollout.env_tokens",
                cfg.rollout.env_tokens.value,
                f"masked with task={cfg.task.name} (no environment: no environment tokens)",
            )
        if cfg.rollout.max_turns > 1:
            warn(
                f"opd-train: warning: rollout.max_turns={cfg.rollout.max_turns} does nothing with task={cfg.task.name} (no environment: one turn)"
            )
        return engines
    if cfg.scale.parallel.value == "fsdp":
        from opd_exp.config.checks import fail

        fail(
            "scale.parallel",
            "fsdp",
            f"none or ddp with task={cfg.task.name} (ranks would run different numbers of turns, each a collective)",
        )
    if cfg.rollout.max_turns == 1:
        warn(
            f"opd-train: warning: task={cfg.task.name} has an environment but rollout.max_turns=1: each episode is one student "
            f"turn, ended at {' or '.join(env.stop) or 'EOS'}, and the environment never answers (set rollout.max_turns)"
        )
    log = EpisodeLog(env)
    return Engines(
        student=episode_engine(engines.student, env, train.rollout, log=log),
        teacher=episode_engine(engines.teacher, env, train.rollout, log=log),
        eval_student=episode_engine(engines.eval_student, env, cfg.rollout),
        eval_teacher=episode_engine(engines.eval_teacher, env, cfg.rollout),
    )


def require_extras(cfg: TrainConfig) -> None:
    """Optional packages the config needs (peft for LoRA, vllm for its engine): one line each,
    before any model loads."""
    prec.require_peft(cfg.scale)
    if cfg.rollout.engine.value == "vllm":
        from opd_exp.training.rollout_vllm import require_vllm

        require_vllm()


# rollout.engine -> builder(cfg, student, tokenizer, vocab_size, *, autocast, synced_gpus, warn) -> RolloutEngine
ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {}


def register_rollout_engine(name: str, builder: Callable[..., RolloutEngine] | None = None, *, limits=None):
    """Register the student's rollout engine ``rollout.engine=<name>`` (usable as a decorator): a
    builder ``(cfg, student, tokenizer, vocab_size, *, autocast, synced_gpus, warn)`` returning a
    ``RolloutEngine`` (``generate`` a ``Batch``; ``sync`` before every on-policy step). The sampled
    distribution must be the trained one: ``rollout/logprob_gap`` says when it is not.
    ``limits(parallel, lora) -> str | None``: what the engine cannot run with, checked with the config."""

    def add(fn):
        from opd_exp.config.rollout import ENGINE_LIMITS
        from opd_exp.config.rollout import RolloutEngine as EngineName

        if not name.isidentifier():
            raise ValueError(f"register_rollout_engine: {name!r} is not an identifier (it becomes rollout.engine={name})")
        ROLLOUT_ENGINES[name] = fn
        if limits is not None:
            ENGINE_LIMITS[name] = limits
        EngineName._add(name)
        return fn

    return add if builder is None else add(builder)


def build_student_engine(cfg: TrainConfig, student, tokenizer, vocab_size: int, *, autocast, synced_gpus: bool, warn) -> RolloutEngine:
    """``rollout.engine``'s registered builder."""
    build = ROLLOUT_ENGINES[cfg.rollout.engine.value]
    return build(cfg, student, tokenizer, vocab_size, autocast=autocast, synced_gpus=synced_gpus, warn=warn)


@register_rollout_engine("vllm")
def _vllm(cfg, student, tokenizer, vocab_size, *, autocast, synced_gpus, warn):
    """A vLLM engine that receives the student's weights after every update."""
    from opd_exp.training.rollout_vllm import VllmRollout

    return VllmRollout.from_config(cfg, student, tokenizer, vocab_size, warn=warn)


def _in_process(cfg, student, tokenizer, vocab_size, *, autocast, synced_gpus, warn):
    """``hf`` samples the live module with ``generate``; ``lean`` (and ``auto``) with our KV-cache loop."""
    return in_process_engine(cfg, student, tokenizer, vocab_size, source="student", autocast=autocast, synced_gpus=synced_gpus)


for _name in ("auto", "hf", "lean"):
    register_rollout_engine(_name, _in_process)


def in_process_engine(
    cfg: TrainConfig, model, tokenizer, vocab_size: int, *, source: str, autocast, synced_gpus: bool = False
) -> RolloutEngine:
    """The in-process sampler of ``rollout.engine``: ``lean`` (also ``auto``, except under FSDP)
    or ``hf`` (also with vllm: the teacher's engine). The teacher's engine (on_policy_fraction < 1)
    follows the same choice."""
    engine = cfg.rollout.engine.value
    if engine == "lean" or (engine == "auto" and cfg.scale.parallel.value != "fsdp"):
        from opd_exp.training.sampler import lean_generate

        return ModuleRollout(model, tokenizer, cfg.rollout, vocab_size, source=source, autocast=autocast, decoder=lean_generate)
    return ModuleRollout(model, tokenizer, cfg.rollout, vocab_size, source=source, autocast=autocast, synced_gpus=synced_gpus)


def run_identity(cfg: TrainConfig, pair, teacher_scorer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the run's pair record, its settings fingerprint): a served teacher adds what identifies it
    (model, root, max_model_len, k, tokenizer hash) to both."""
    record, served = pair_record(pair), teacher_scorer.identity()
    if served:
        record["teacher_server"] = {k.rsplit(".", 1)[-1]: v for k, v in served.items()}
        if getattr(teacher_scorer, "self_tested", True) is False:  # the summary says whose accuracy it shows
            record["teacher_server"]["self_tested"] = False
    return record, {**fingerprint.config_fingerprint(cfg), **served}


def pair_record(pair) -> dict[str, Any]:
    """The prepared pair this run trained: per model its cache hash and the accuracies
    measured when it was built (a prepared pair differs between machines: same recipe,
    teacher 0.940 on one, 0.975 on another). Folders that are not prepared entries: their path."""
    out: dict[str, Any] = {}
    for role in ("teacher", "student"):
        path = getattr(pair, f"{role}_path", None)
        if not path:
            continue
        manifest = Path(path) / files.CACHE_MANIFEST
        try:
            m = json.loads(manifest.read_text())
        except (OSError, ValueError):
            out[role] = {"path": str(path)}
            continue
        info = m.get("info", {})
        out[role] = {"hash": m.get("hash"), **{k: info[k] for k in ("accuracy", "format_rate", "n_check") if k in info}}
    return out


def rollout_source(cfg: TrainConfig, engines: Engines, student, tokenizer, vocab_size: int, *, autocast, phases, task, problems, cursor):
    """Where each step's rollout comes from (``training/producer.py``): the loop's engines, or with
    ``rollout.staleness > 0`` a producer sampling a copy of the student with ``rollout.engine``'s
    in-process decoder, its prompts drawn from a copy of the data ``cursor`` as the trainer draws them."""
    from opd_exp.training.producer import build_rollouts

    train = training_rollout_config(cfg)

    def plan(data_cursor, tok) -> list[str]:  # the next step's prompt rows, prompt-major
        drawn = [problems[i] for i in data_cursor.next(cfg.trainer.batch_size)]
        return [task.render_prompt(p, tok) for p in drawn for _ in range(cfg.rollout.n_samples)]

    spec = (in_process_engine, train, vocab_size, autocast)  # the producer process builds its engine from these
    log = getattr(engines.student, "log", None)  # episodes (a task with an environment): their metrics every step
    if log is not None and cfg.rollout.staleness:
        from opd_exp.config.checks import fail

        fail("rollout.staleness", cfg.rollout.staleness, f"0 with task={cfg.task.name} (its episodes are sampled in the loop for now)")
    source = build_rollouts(cfg, engines, student, tokenizer, vocab_size, phases=phases, plan=plan, cursor=cursor, engine_spec=spec)
    if log is None:
        return source
    from opd_exp.training.episodes import EpisodeSource

    return EpisodeSource(source, log, train_env_tokens=cfg.rollout.env_tokens.value == "trained")
