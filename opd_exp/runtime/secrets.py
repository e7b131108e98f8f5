"""Credentials never reach a run folder or W&B: redaction by key name and by environment value."""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "<redacted>"
# config keys and environment variables whose values are credentials
# ("token" alone: hf_token, HF_TOKEN, access_token; not max_new_tokens, tokenizer, pad_token_id)
SECRET_NAME = re.compile(r"(api[_-]?key|(?<![a-z])token(?![a-z]|_id)|secret|password|passwd|credential)", re.IGNORECASE)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of credential-like environment variables (WANDB_API_KEY, HF_TOKEN, ...)."""
    env = os.environ if environ is None else environ
    return sorted({v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 8}, key=len, reverse=True)


def scrub(obj: Any, secrets: Iterable[str] | None = None) -> Any:
    """A copy of ``obj`` (dicts, lists, strings) with credentials replaced by ``<redacted>``:
    values under a credential-like key, and any occurrence of a credential-like env value."""
    secrets = list(secret_values() if secrets is None else secrets)

    def clean(x, key: str = ""):
        if isinstance(x, Mapping):
            return {k: (REDACTED if SECRET_NAME.search(str(k)) and v not in (None, "") else clean(v, str(k))) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(clean(v) for v in x)
        if isinstance(x, str):
            for s in secrets:
                x = x.replace(s, REDACTED)
            name, sep, value = x.partition("=")  # an override `logger.api_key=...`
            if sep and SECRET_NAME.search(name) and value:
                return f"{name}={REDACTED}"
        return x

    return clean(obj)


def plain_config(cfg: Any) -> Any:
    """A (nested) config dataclass as JSON-able dicts and lists; enums by value."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: plain_config(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    if isinstance(cfg, (list, tuple)):
        return [plain_config(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {k: plain_config(v) for k, v in cfg.items()}
    return cfg
