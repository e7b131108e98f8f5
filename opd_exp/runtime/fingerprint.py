"""What a run folder was trained with: the config fingerprint stored in every checkpoint,
the check made on resume, and the folder's history of sessions.

A run folder resumed with other settings would be silently wrong (steps 1..N trained with one
config, the rest with another, and `.hydra/` rewritten by the new session). So every
checkpoint's loop state holds ``config``: the flattened settings that shape the trained
weights and the metrics. On resume they are compared with the new config; a difference stops
the run with one line naming the keys, unless ``checkpoint.extend=true`` asks for it on purpose.
Either way each session is appended to ``<run>/history.yaml`` (its overrides, the step it
started from, what changed), which Hydra never overwrites.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from opd_exp.runtime.secrets import plain_config, scrub, scrub_text

HISTORY = "history.yaml"

# Keys that change neither the trained weights nor the logged numbers' meaning: where the
# run happens, how it reports, how often it checkpoints. Everything else is fingerprinted.
IGNORED_PREFIXES = ("logger.",)
IGNORED = frozenset(
    {
        "name",
        "trainer.progress",
        "scale.num_threads",
        "scale.device",
        "scale.teacher_device",
        "checkpoint.extend",
        "checkpoint.every",
        "checkpoint.keep",
        "trainer.log_every",
        "eval.every",
        "eval.batch_size",
        "model_pair.embedded.threads",
        "model_pair.for_task",  # a check of the task the pair goes with, not part of either
        # a served teacher: where it runs and how it is reached (its identity is SERVED_IDENTITY)
        "teacher.url",
        "teacher.timeout_s",
        "teacher.retries",
        "teacher.backoff_s",
        "teacher.rows_per_request",
        "teacher.max_in_flight",
        "teacher.overlap",
        "teacher.self_test",
        "teacher.self_test_atol",
    }
)
# What a served teacher reports about itself once connected (``ServedTeacher.identity``): the
# trainer adds it to the fingerprint, so a resume against another teacher is refused there;
# the check before the models load (``check_run_folder``) cannot know it yet.
SERVED_IDENTITY = "teacher.server."
# What the teachers of teachers.map are once loaded (each one's content hash, a served one's identity),
# added by the trainer (training/teacher_set.py): compared on resume, as SERVED_IDENTITY.
TEACHERS_LOADED = "teachers.loaded."
# Settings that decide what the eval measures (which problems, how they are decoded, the
# teacher and its tokenizer): an extension that changes one is evaluated afresh on the new set.
EVAL_SET = ("task.", "model_pair.", "teacher.", "teachers.", "eval.size", "rollout.max_new_tokens", "rollout.max_prompt_tokens")


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"a.b": value}`` (lists kept as values)."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


# A local teacher folder's content (``teacher_content``): replacing the weights in the same folder
# is another teacher, which a resume must not take in silence.
TEACHER_CONTENT = "model_pair.teacher_sha256"
_FILE_HASHES: dict[tuple, str] = {}  # (path, size, mtime, inode) -> SHA-256: each file hashed once per process


def teacher_content(spec: Any) -> str | None:
    """SHA-256 over a local teacher folder's files (relative names and bytes; dot-files such as
    ``.cache/`` left out), or None for a hub id or a prepared pair (``embedded:``, ``smollm2:``),
    whose identity is its id or its recipe."""
    from opd_exp.runtime.files import sha256_file

    folder = Path(spec).expanduser() if isinstance(spec, str) and spec else None
    if folder is None or not folder.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        rel = f.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not f.is_file():
            continue
        st = f.stat()
        key = (str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in _FILE_HASHES:
            _FILE_HASHES[key] = sha256_file(f)
        h.update(f"{rel.as_posix()} {_FILE_HASHES[key]}\n".encode())
    return h.hexdigest()


def config_fingerprint(cfg: Any) -> dict[str, Any]:
    """The settings of ``cfg`` (a TrainConfig) that shape the run, flattened and JSON-able; a
    local teacher folder also by its content (``TEACHER_CONTENT``)."""
    flat = flatten(scrub(plain_config(cfg)))
    if (content := teacher_content(flat.get("model_pair.teacher"))) is not None:
        flat[TEACHER_CONTENT] = content
    if flat.get("teacher.name", "in_process") == "in_process":  # the default: fingerprints as before the group existed
        flat = {k: v for k, v in flat.items() if not k.startswith("teacher.")}
    flat = {k: v for k, v in flat.items() if not (k.startswith("teachers.map.") and k.endswith(".url"))}  # where, as teacher.url
    return {k: v for k, v in sorted(flat.items()) if k not in IGNORED and not k.startswith(IGNORED_PREFIXES)}


def short_hash(values: dict[str, Any], n: int = 8) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:n]


def differences(stored: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, tuple[Any, Any]]:
    """{key: (stored value, current value)} for every key that differs (missing = None).

    ``defaults`` (``schema_defaults``): a setting added to the schema after the checkpoint was
    written is not a difference while it holds its default, since a new knob's default is what
    the code did before the knob existed."""
    keys = sorted(set(stored) | set(current))
    defaults = defaults or {}
    return {
        k: (stored.get(k), current.get(k))
        for k in keys
        if stored.get(k) != current.get(k)
        and not (k not in stored and k in defaults and current.get(k) == defaults[k])
        and not (k == TEACHER_CONTENT and k not in stored)  # a checkpoint from before the teacher's hash was kept
    }


def schema_defaults(cfg: Any) -> dict[str, Any]:
    """The fingerprint of ``cfg``'s schema at its declared defaults (``type(cfg)()``)."""
    return config_fingerprint(type(cfg)())


def describe(diff: dict[str, tuple[Any, Any]], limit: int = 6) -> str:
    items = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()]
    more = f", and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def append_history(run_dir: Path, entry: dict[str, Any]) -> None:
    """One YAML list item per session in ``<run>/history.yaml`` (appended, never rewritten)."""
    import yaml

    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **scrub(entry)}
    # the overrides are a command line: redacted like .hydra/ (token shapes, labels, env values)
    text = scrub_text(yaml.safe_dump([entry], sort_keys=False, default_flow_style=False, width=200))
    with open(Path(run_dir) / HISTORY, "a", encoding="utf-8") as f:
        f.write(text)


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    import yaml

    path = Path(run_dir) / HISTORY
    return list(yaml.safe_load(path.read_text()) or []) if path.is_file() else []


def refusal(run_dir: Path, stored: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None) -> str | None:
    """The one-line refusal of a resume with other settings, or None when they agree."""
    diff = differences(stored, current, defaults)
    if not diff:
        return None
    return (
        f"hydra.run.dir: {run_dir} holds a run made with other settings ({describe(diff)}); "
        f"allowed: the same settings to resume it, checkpoint.extend=true to continue it with these "
        f"(recorded in {HISTORY}), or a new hydra.run.dir"
    )


def eval_set_changes(diff: dict[str, tuple[Any, Any]]) -> list[str]:
    """The keys of ``diff`` that change what the eval measures (``EVAL_SET``)."""
    return [k for k in diff if k.startswith(EVAL_SET)]


def below_step(run_dir: Path, step: int, max_steps: int) -> str | None:
    """The one-line refusal of ``trainer.max_steps`` below the step a run has reached, or None."""
    if step <= max_steps:
        return None
    return (
        f"trainer.max_steps={max_steps} is below step {step}, which the run in {run_dir} has reached (nothing would be "
        f"trained); allowed: trainer.max_steps >= {step} (more steps with checkpoint.extend=true), or a new hydra.run.dir"
    )


def check_run_folder(run_dir: Path, cfg: Any, upgrade: Any = None) -> None:
    """Before anything starts (W&B, models): refuse ``trainer.max_steps`` below the run's step,
    and a resume with other settings unless ``checkpoint.extend`` (reads the newest checkpoint's
    loop state only; the trainer checks the checkpoint it actually loads again). ``upgrade``: renames
    a stored fingerprint's old keys (``config.deprecated.upgrade_flat``)."""
    from opd_exp.runtime import checkpoint
    from opd_exp.runtime.errors import ConfigError

    path = checkpoint.latest(run_dir)
    if path is None:
        return
    try:
        state = json.loads((path / "state.json").read_text())
        stored, step = state.get("config"), int(state.get("step", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return  # damaged: restore sets it aside and says so
    if (line := below_step(Path(run_dir), step, cfg.trainer.max_steps)) is not None:
        raise ConfigError(line)
    if cfg.checkpoint.extend:
        return
    if isinstance(stored, dict):
        stored = {k: v for k, v in (upgrade(stored) if upgrade else stored).items() if not k.startswith((SERVED_IDENTITY, TEACHERS_LOADED))}
    line = refusal(Path(run_dir), stored, config_fingerprint(cfg), schema_defaults(cfg)) if isinstance(stored, dict) else None
    if line:
        raise ConfigError(line)
