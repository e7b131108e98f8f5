"""Tasks: where prompts and answers come from, and how a completion is verified."""

from __future__ import annotations

from typing import Any

from opd_exp.tasks.base import Problem, Task, extract_answer, render_prompt, verify

__all__ = ["Problem", "Task", "build_task", "extract_answer", "render_prompt", "verify"]


def build_task(task_cfg: Any = None) -> Task:
    """The Task named by ``task_cfg.name`` (a TaskConfig, DictConfig or dict; None = default)."""
    from opd_exp.config.world import as_task_config

    cfg = as_task_config(task_cfg)
    if cfg.name == "arithmetic":
        from opd_exp.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(cfg)
    if cfg.name == "multimodal":
        from opd_exp.tasks.multimodal import MultimodalTask

        return MultimodalTask(cfg)
    from opd_exp.tasks.gsm8k import GSM8KTask  # TaskConfig already rejected unknown names

    return GSM8KTask(cfg)
