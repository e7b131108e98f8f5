"""The models of ``teachers.map``: each entry's teacher found (a conf/model_pair option's teacher,
prepared with that option's recipe and task, or a ``path`` as ``model_pair.teacher`` takes it),
loaded frozen and checked against the run's pair (the same tokenizer; enough output rows). With
``teacher.align=bytes`` each teacher keeps its own tokenizer (loaded from its folder; the pair's own
teacher's is the pair's), scored on its own tokens and aligned by byte offsets
(``training/teacher_align.py``), and its embedding must cover that tokenizer.

The trainer is handed ``load_map_teacher`` by the entry point (``cli/compose.build_inputs``):
loading models is this package's concern, routing and scoring the trainer's
(``training/teacher_set.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from opd_exp.pairs.load import _load_model, _load_tokenizer, preflight, resolve_pair
from opd_exp.runtime import fingerprint
from opd_exp.runtime.errors import ConfigError


def load_map_teacher(key: str, src, cfg, pair) -> tuple[Any, dict[str, Any], Any]:
    """(the frozen model, its record: source, folder, content hash, its own tokenizer or None) of the
    map entry ``key``: the tokenizer where ``teacher.align=bytes``, else None (the pair's). A teacher
    whose folder is the pair's own teacher is that loaded module (and tokenizer), not a second copy."""
    where = resolve_source(key, src, cfg)
    record = {"source": f"pair:{src.pair}" if src.pair else src.path, "path": where, "sha256": content(where)}
    own = cfg.teacher.align == "bytes"
    if where == getattr(pair, "teacher_path", None):
        tokenizer = (getattr(pair, "teacher_tokenizer", None) or pair.tokenizer) if own else None
        return pair.teacher, record, tokenizer
    tokenizer = _load_tokenizer(key, where, cfg.model_pair.trust_remote_code) if own else None
    return load_teacher(key, where, cfg, pair, tokenizer), record, tokenizer


def resolve_source(key: str, src, cfg) -> str:
    """The folder (or hub id) of a map entry's teacher: a ``pair`` option's teacher, prepared with
    its recipe and task (``for_task``), or ``path`` with the run's pair recipe and task."""
    if src.pair is not None:
        pair_cfg, task_cfg = pair_option_configs(key, src.pair, cfg.task)
        value = pair_cfg.teacher
    else:
        pair_cfg, task_cfg, value = cfg.model_pair, cfg.task, src.path
    where = f"{key}.{'pair' if src.pair is not None else 'path'}"
    try:  # the teacher alone: the student slot names it too, so nothing else is prepared
        return resolve_pair(dataclasses.replace(pair_cfg, student=value, teacher=value), task_cfg)[1]
    except ConfigError as ex:
        raise ConfigError(str(ex).replace("model_pair.student", where).replace("model_pair.teacher", where)) from None


def pair_option_configs(key: str, option: str, run_task):
    """(ModelPairConfig, TaskConfig) of a conf/model_pair option: the task is its ``for_task``
    option's, else the run's."""
    from omegaconf import OmegaConf

    from opd_exp.config.folders import CONF_DIR
    from opd_exp.config.teachers import pair_option
    from opd_exp.config.world import as_pair_config, as_task_config

    pair_cfg = as_pair_config(OmegaConf.load(pair_option(key, option)))
    if not pair_cfg.for_task:
        return pair_cfg, run_task
    path = CONF_DIR / "task" / f"{pair_cfg.for_task}.yaml"
    if not path.is_file():
        raise ConfigError(f"{key}.pair={option!r}: its for_task={pair_cfg.for_task!r} has no conf/task/ file; allowed: a task option")
    return pair_cfg, as_task_config(OmegaConf.load(path))


def load_teacher(key: str, where: str, cfg, pair, tokenizer=None):
    """A map teacher's model (frozen), checked against the pair's tokenizer where the pair was
    loaded from folders (``preflight``), and against its vocabulary always (``tokenizer``: its own,
    with teacher.align=bytes, whose length its output rows must cover instead)."""
    student_path = getattr(pair, "student_path", None)
    try:
        if student_path:
            preflight(
                dataclasses.replace(cfg.model_pair, student=student_path, teacher=where),
                student_path=student_path,
                teacher_path=where,
                teacher_align=cfg.teacher.align,
            )
        model = _load_model("model_pair.teacher", where, cfg.model_pair, "cpu")
    except ConfigError as ex:
        raise ConfigError(str(ex).replace("model_pair.teacher", key)) from None
    rows = model.get_output_embeddings().weight.shape[0]
    need, whose = (int(pair.vocab_size), "the pair's") if tokenizer is None else (len(tokenizer), "its own")
    if rows < need:
        allowed = "a teacher that shares the pair's tokenizer" if tokenizer is None else f"a model whose vocab_size is >= {need}"
        raise ConfigError(f"{key}: {where!r} has {rows} output rows but {whose} tokenizer has {need} tokens; allowed: {allowed}")
    return model.eval().requires_grad_(False)


def content(where: str) -> str:
    """SHA-256 of a local teacher folder's files, or a hub id itself (its identity)."""
    return fingerprint.teacher_content(where) if Path(where).is_dir() else where
