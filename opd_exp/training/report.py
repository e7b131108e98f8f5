"""What a run reports: its metric sinks (``metrics.jsonl`` and W&B, on rank 0), and its summary:
the eval metrics before and after training, and its one-line form (the last line ``opd-train``
prints: ``opd-train | tail -1`` is the result)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opd_exp.config.schema import LoggerName, TrainConfig
from opd_exp.sinks import JsonlSink, MultiSink, Sink

# summarised before -> after, with the trained divergence's own eval key
SUMMARY_KEYS = ("eval/accuracy", "eval/kl_reverse", "eval/kl_forward", "eval/jsd")


def summary(step: int, elapsed_s: float, before: dict, after: dict, own_key: str, teacher_accuracy, pair_record) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": step, "elapsed_s": round(elapsed_s, 1)}
    for key in dict.fromkeys((*SUMMARY_KEYS, own_key)):
        if key in before:
            out[f"{key}_before"] = before[key]
        if key in after:
            out[key] = after[key]
    if teacher_accuracy is not None:
        out["eval/teacher_accuracy"] = teacher_accuracy
    if pair_record:
        out["pair"] = pair_record
    return out


def served_teacher_checked(pair_record: dict | None) -> bool:
    """False when a served teacher was never compared with the in-process copy whose greedy
    answers give ``eval/teacher_accuracy`` (``teacher.self_test=false``)."""
    pair_record = pair_record or {}
    servers = [pair_record.get("teacher_server")] + [
        t.get("server") for t in (pair_record.get("teachers") or {}).values() if isinstance(t, dict)
    ]
    return not any(isinstance(s, dict) and s.get("self_tested") is False for s in servers)


def summary_line(s: dict[str, Any], run_dir: Path) -> str:
    def f(key):
        v = s.get(key)
        return "n/a" if v is None else f"{v:.3f}"

    teacher = f("eval/teacher_accuracy")
    if teacher != "n/a" and not served_teacher_checked(s.get("pair")):
        teacher += ", the in-process copy's: teacher.self_test=false, not the server's"
    return (
        f"opd-train: student eval accuracy {f('eval/accuracy_before')} -> {f('eval/accuracy')} "
        f"(teacher {teacher}); eval reverse KL {f('eval/kl_reverse_before')} -> "
        f"{f('eval/kl_reverse')}; {s['steps']} steps in {s['elapsed_s']:.0f} s; run folder {run_dir}"
    )


def run_sinks(cfg: TrainConfig, run_dir: Path, *, main: bool, extra, resume_step: int | None, warn) -> Sink:
    """``metrics.jsonl`` (continued from ``resume_step``), W&B under ``logger=wandb`` unless one
    was passed in ``extra`` (opd-train starts it early), and ``extra``; nothing on other ranks."""
    if not main:
        return MultiSink([])
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step=resume_step, warn=warn)]
    extra = list(extra or [])
    if cfg.logger.name is LoggerName.wandb and not any(getattr(s, "is_wandb", False) for s in extra):
        from opd_exp.sinks.tracking import WandbSink

        sinks.append(WandbSink.from_config(cfg, run_dir))
    return MultiSink(sinks + extra)
