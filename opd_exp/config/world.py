"""Hydra schema of the ``model_pair`` and ``task`` config groups (plain dataclasses).

Ranges are checked in ``__post_init__``, which ``OmegaConf.to_object`` runs, so a bad value
fails at start-up with one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float16", "auto")
# Task names the config accepts: the built-ins, then any added with ``opd_exp.tasks.register_task``
# (which appends here; tasks depend on config, never the reverse).
TASKS: list[str] = ["arithmetic", "gsm8k", "chat_arithmetic", "multimodal", "calc_tool"]


def add_task_name(name: str) -> None:
    if name not in TASKS:
        TASKS.append(name)


# The TaskConfig keys each built-in task reads besides COMMON_TASK_KEYS (W&B logs only these; a
# registered task gets every key).
COMMON_TASK_KEYS = ("name", "seed", "n_train", "n_eval", "eval_seed")
_ARITHMETIC_KEYS = ("min_operands", "max_operands", "max_digits", "ops")
TASK_KEYS: dict[str, tuple[str, ...]] = {
    "arithmetic": _ARITHMETIC_KEYS,
    "chat_arithmetic": _ARITHMETIC_KEYS,
    "multimodal": ("min_answers", "max_answers"),
    "gsm8k": ("path", "hub_config", "train_split", "eval_split", "instruction"),
}


from opd_exp.config.checks import check as _check  # noqa: E402 - one message format for every group


@dataclass
class EmbeddedModelConfig:
    """Size and SFT budget of one embedded Qwen2 model (teacher or student)."""

    hidden_size: int = 64  # width of the residual stream
    num_layers: int = 2  # transformer blocks
    num_heads: int = 4  # attention heads (must divide hidden_size)
    num_kv_heads: int = 2  # key/value heads (grouped-query attention; divides num_heads)
    intermediate_size: int = 256  # MLP width
    sft_steps: int = 4000  # optimizer steps of supervised fine-tuning on worked solutions
    batch_size: int = 64  # problems per SFT step
    lr: float = 3e-3  # peak AdamW learning rate (warm-up, then cosine decay to lr/10)

    def check(self, p: str) -> None:
        """Range checks; ``p`` is this config's key (e.g. 'model_pair.embedded.teacher')."""
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, f"{p}.{name}", v, "an integer >= 1")
        _check(
            self.hidden_size % self.num_heads == 0 and (self.hidden_size // self.num_heads) % 2 == 0,
            f"{p}.num_heads",
            self.num_heads,
            f"a divisor of hidden_size={self.hidden_size} leaving an even head size",
        )
        _check(self.num_heads % self.num_kv_heads == 0, f"{p}.num_kv_heads", self.num_kv_heads, f"a divisor of num_heads={self.num_heads}")
        _check(isinstance(self.sft_steps, int) and self.sft_steps >= 0, f"{p}.sft_steps", self.sft_steps, "an integer >= 0")
        _check(isinstance(self.batch_size, int) and self.batch_size >= 1, f"{p}.batch_size", self.batch_size, "an integer >= 1")
        _check(0 < self.lr < 1, f"{p}.lr", self.lr, "a float in (0, 1)")


def _teacher() -> EmbeddedModelConfig:
    return EmbeddedModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, sft_steps=4000, batch_size=64, lr=3e-3
    )


def _student() -> EmbeddedModelConfig:
    return EmbeddedModelConfig(
        hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=192, sft_steps=800, batch_size=64, lr=3e-3
    )


@dataclass
class EmbeddedPairConfig:
    """How the embedded pair is built; every field except ``threads`` is part of the cache key."""

    teacher: EmbeddedModelConfig = field(default_factory=_teacher)  # trained to high accuracy
    student: EmbeddedModelConfig = field(default_factory=_student)  # short warm-up: format, not skill
    n_sft: int = 50000  # distinct-draw SFT problems (disjoint from the task's eval set)
    n_check: int = 200  # eval problems on which preparation measures accuracy (manifest)
    seed: int = 0  # seed of initial weights, SFT data and batch order
    # share of the teacher's SFT draws that start from a slipped solution prefix and show its
    # correction (opd_exp/pairs/embedded/recovery.py); 0: none (in the key only when > 0)
    recovery: float = 0.0
    # operators the SFT data is drawn with (a subset of '+-*'; arithmetic only): an expert teacher
    # of a multi-teacher run, trained on its domain while the run's task (its eval set excluded
    # as always) draws every operator; null: the task's own (in the key only when set)
    sft_ops: str | None = None
    # share of the student's SFT draws asked with privileged context in the prompt (the worked
    # solution or the final answer, as teacher.privileged asks it; opd_exp/pairs/embedded/privileged.py):
    # a student that can be its own teacher; 0: none (in the key only when > 0)
    privileged: float = 0.0
    threads: int = 0  # torch CPU threads during preparation (0 = auto: few, never more than idle cores); not in the key

    def __post_init__(self) -> None:
        self.teacher.check("model_pair.embedded.teacher")
        self.student.check("model_pair.embedded.student")
        _check(isinstance(self.n_sft, int) and self.n_sft >= 1, "model_pair.embedded.n_sft", self.n_sft, "an integer >= 1")
        _check(isinstance(self.n_check, int) and self.n_check >= 0, "model_pair.embedded.n_check", self.n_check, "an integer >= 0")
        _check(0.0 <= self.recovery < 1.0, "model_pair.embedded.recovery", self.recovery, "a share in [0, 1)")
        _check(0.0 <= self.privileged < 1.0, "model_pair.embedded.privileged", self.privileged, "a share in [0, 1)")
        _check(
            self.sft_ops is None or (isinstance(self.sft_ops, str) and self.sft_ops and set(self.sft_ops) <= set("+-*")),
            "model_pair.embedded.sft_ops",
            self.sft_ops,
            "null (the task's operators) or a non-empty subset of '+-*', e.g. '+-'",
        )
        _check(
            isinstance(self.threads, int) and self.threads >= 0, "model_pair.embedded.threads", self.threads, "an integer >= 0 (0 = auto)"
        )


@dataclass
class SmolLM2PairConfig:
    """How the SmolLM2 pair (``smollm2:teacher`` / ``smollm2:student``) is built; part of the cache key."""

    keep_every: int = 3  # the student keeps decoder layers 0, k, 2k, ... and the last (k=3: 11 of 30)

    def __post_init__(self) -> None:
        _check(
            isinstance(self.keep_every, int) and self.keep_every >= 1,
            "model_pair.smollm2.keep_every",
            self.keep_every,
            "an integer >= 1 (1 = keep every layer)",
        )


@dataclass
class ModelPairConfig:
    """Which teacher distils into which student, and how they are loaded."""

    name: str = "embedded"  # label for logs and W&B
    student: str = "embedded:student"  # hub id, local folder, "embedded:student" or "smollm2:student"
    teacher: str = "embedded:teacher"  # hub id, local folder, "embedded:teacher" or "smollm2:teacher"
    tokenizer: str | None = None  # hub id or folder of the shared tokenizer; default: the student's
    dtype: str = "float32"  # weights dtype: float32 | bfloat16 | float16 | auto (as saved)
    trust_remote_code: bool = False  # allow models whose code lives in their repo (auto_map)
    embedded: EmbeddedPairConfig = field(default_factory=EmbeddedPairConfig)  # the embedded pair's recipe (cache key)
    smollm2: SmolLM2PairConfig = field(default_factory=SmolLM2PairConfig)  # the SmolLM2 pair's pruning recipe (cache key)
    # the lab's pairs: the conf/task option they are built for (task=multimodal); a task whose keys
    # differ from that option's is refused (it would train a new, meaningless pair). null: any task
    for_task: str | None = None

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "model_pair.dtype", self.dtype, " | ".join(DTYPES))
        for key in ("student", "teacher"):
            v = getattr(self, key)
            # "???" is OmegaConf's "must be set" marker (conf/model_pair/local.yaml).
            _check(
                isinstance(v, str) and v.strip() not in ("", "???"),
                f"model_pair.{key}",
                v,
                "a hub id, a local folder, 'embedded:student' / 'embedded:teacher' or 'smollm2:student' / 'smollm2:teacher' (set it on the command line)",
            )


@dataclass
class TaskConfig:
    """Which problems the student learns on and is evaluated on."""

    name: str = "arithmetic"  # arithmetic (embedded, synthetic) | gsm8k | chat_arithmetic (questions through the chat template) | multimodal (embedded, several answers per prompt) | calc_tool (embedded, episodes with a calculator) | a registered task (docs/extending.md)
    seed: int = 0  # draws the training problems (arithmetic) / their order
    n_train: int = 20000  # training problems (gsm8k: 0 = all available)
    n_eval: int = 200  # eval problems, fixed and disjoint from train (gsm8k: 0 = all)
    eval_seed: int = 1234  # draws the fixed eval set (arithmetic; gsm8k single-file split)
    # arithmetic knobs (difficulty)
    min_operands: int = 2  # fewest numbers per expression (>= 2)
    max_operands: int = 3  # most numbers per expression
    max_digits: int = 2  # operands have 1..max_digits digits
    ops: str = "+-"  # operators drawn from, a subset of "+-*"
    # multimodal knobs: how many valid answers a prompt has
    min_answers: int = 2  # fewest valid answers per prompt (>= 1)
    max_answers: int = 6  # most valid answers per prompt
    # gsm8k
    path: str | None = None  # local .jsonl/.parquet file or folder, hub id (needs `datasets`), or "embedded:gsm8k_mini"
    hub_config: str = "main"  # dataset config name on the hub (openai/gsm8k has "main" and "socratic")
    train_split: str = "train"  # split (or file stem) with training problems
    eval_split: str = "test"  # split (or file stem) with eval problems
    instruction: str = ""  # appended to every gsm8k question (e.g. how to state the answer)

    def __post_init__(self) -> None:
        _check(self.name in TASKS, "task.name", self.name, " | ".join(TASKS))
        _check(isinstance(self.n_train, int) and self.n_train >= 0, "task.n_train", self.n_train, "an integer >= 0")
        _check(isinstance(self.n_eval, int) and self.n_eval >= 0, "task.n_eval", self.n_eval, "an integer >= 0")
        if self.name in ("arithmetic", "chat_arithmetic"):
            _check(self.n_train >= 1, "task.n_train", self.n_train, f"an integer >= 1 for {self.name}")
            _check(self.n_eval >= 1, "task.n_eval", self.n_eval, f"an integer >= 1 for {self.name}")
            _check(isinstance(self.min_operands, int) and self.min_operands >= 2, "task.min_operands", self.min_operands, "an integer >= 2")
            _check(
                isinstance(self.max_operands, int) and self.min_operands <= self.max_operands <= 8,
                "task.max_operands",
                self.max_operands,
                f"an integer in [min_operands={self.min_operands}, 8]",
            )
            _check(
                isinstance(self.max_digits, int) and 1 <= self.max_digits <= 6, "task.max_digits", self.max_digits, "an integer in [1, 6]"
            )
            _check(
                isinstance(self.ops, str) and len(self.ops) > 0 and set(self.ops) <= set("+-*"),
                "task.ops",
                self.ops,
                "a non-empty subset of '+-*', e.g. '+-'",
            )
        if self.name == "multimodal":
            _check(self.n_train >= 1, "task.n_train", self.n_train, "an integer >= 1 for multimodal")
            _check(self.n_eval >= 1, "task.n_eval", self.n_eval, "an integer >= 1 for multimodal")
            _check(isinstance(self.min_answers, int) and self.min_answers >= 1, "task.min_answers", self.min_answers, "an integer >= 1")
            _check(
                isinstance(self.max_answers, int) and self.min_answers <= self.max_answers <= 10,
                "task.max_answers",
                self.max_answers,
                f"an integer in [min_answers={self.min_answers}, 10]",
            )
        if self.name == "gsm8k":
            _check(
                bool(self.path),
                "task.path",
                self.path,
                "a local .jsonl/.parquet file or folder, a hub id like 'openai/gsm8k', or 'embedded:gsm8k_mini'",
            )


def as_pair_config(cfg: Any) -> ModelPairConfig:
    """A validated ``ModelPairConfig`` from a dataclass, DictConfig or dict."""
    if isinstance(cfg, ModelPairConfig):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelPairConfig), cfg))


def as_task_config(cfg: Any) -> TaskConfig:
    """A validated ``TaskConfig`` from a dataclass, DictConfig, dict or None (the default)."""
    if cfg is None:
        return TaskConfig()
    if isinstance(cfg, TaskConfig):
        return cfg
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TaskConfig), cfg))
