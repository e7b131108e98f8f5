"""Credentials never reach a run folder or W&B: redaction by key name, by environment value, by
token shape, and of the user-info in URLs."""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "<redacted>"
# config keys and environment variables whose values are credentials
# ("token" alone: hf_token, HF_TOKEN, access_token; not max_new_tokens, tokenizer, pad_token_id;
# a name ending in _KEY or _PAT: SERVICE_KEY, GITHUB_PAT; not exclude_keys, LD_LIBRARY_PATH)
SECRET_NAME = re.compile(
    r"(api[_-]?key|(?<![a-z])token(?![a-z]|_id)|secret|password|passwd|credential|[_-](?:key|pat)(?![a-z0-9_]))", re.IGNORECASE
)
# values shaped like a credential wherever they appear: Hugging Face (hf_...), OpenAI-style
# (sk-..., sk-proj-...), GitHub (ghp_/gho_/ghu_/ghs_/ghr_..., github_pat_...), AWS access key
# ids (AKIA/ASIA + 16), Slack (xoxb-, xoxp-, xoxa-, xoxs-, xoxo-)
TOKEN_SHAPE = re.compile(
    r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Z])|xox[bpaso]-[A-Za-z0-9-]{10,})"
)
# a W&B API key is 40 hex digits; so is a git commit id, so this shape is redacted only where
# a commit id has no business (a run's name, tags and group)
WANDB_KEY_SHAPE = re.compile(r"(?<![0-9a-fA-F])[0-9a-f]{40}(?![0-9a-fA-F])")
# where a record sets a run's label (`name: ...`, `name=...`, `logger.tags=[...]`, `group: ...`,
# `project: ...`: a pasted W&B key there is a key),
# also inside Hydra's comma-joined `override_dirname`
_LABEL_VALUE = re.compile(r"(?<![\w.])[+~]*(?:logger\.)?(?:name|group|tags|project|entity)[ \t]*[:=][ \t]*(?:\[[^\]\n]*\]|[^,\s\]]*)")
# the user-info of a URL (teacher.url, teachers.map.<name>.url): `http://user:PASSWORD@host` keeps
# the user, `https://TOKEN@host` (a token as the user name) loses all of it
URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/?#\s'\"]+)@")
# an HTTP credential wherever it is quoted (`Authorization: Bearer <token>`, `Authorization: Basic
# <base64>`, `Bearer <token>`: a header pasted into an override or a note): the scheme stays, the
# credential goes
AUTH_SCHEME = re.compile(
    r"(?P<scheme>(?<![A-Za-z0-9])(?:authorization[ \t]*[:=][ \t]*(?:(?:bearer|basic|digest|token)[ \t]+)?|bearer[ \t]+))"
    r"(?P<cred>[A-Za-z0-9._~+/=-]{8,})",
    re.IGNORECASE,
)
# `key: value` / `key=value` where the key looks like a credential (YAML records, argv)
_SECRET_ASSIGNMENT = re.compile(
    r"(?P<key>[\w.+~/-]*(?:" + SECRET_NAME.pattern + r")[\w.-]*)(?P<sep>\s*[=:]\s*)[^\s,'\"\]}]+", re.IGNORECASE
)


def redact_url(text: str) -> str:
    """``text`` with the password of every URL's user-info redacted (``user:<redacted>@``; a user
    name alone, often a token: ``<redacted>@``)."""

    def clean(m: re.Match) -> str:
        user, colon, _ = m["info"].partition(":")
        return f"{m['scheme']}{user}:{REDACTED}@" if colon and user != REDACTED else f"{m['scheme']}{REDACTED}@"

    return URL_CREDENTIALS.sub(clean, text)


def redact_shapes(text: str) -> str:
    """``text`` with every credential recognised by its shape redacted: token shapes (``hf_...``),
    the user-info of URLs and HTTP credentials (``Bearer <token>``)."""
    text = AUTH_SCHEME.sub(lambda m: f"{m['scheme']}{REDACTED}" if m["cred"] != REDACTED else m[0], text)
    return redact_url(TOKEN_SHAPE.sub(REDACTED, text))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of credential-like environment variables (WANDB_API_KEY, HF_TOKEN, ...)."""
    env = os.environ if environ is None else environ
    # longest first (a secret inside another is replaced after it), then by value: the same order every run
    return sorted({v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 8}, key=lambda v: (-len(v), v))


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
            x = redact_shapes(x)
            name, sep, value = x.partition("=")  # an override `logger.api_key=...`
            if sep and SECRET_NAME.search(name) and value:
                return f"{name}={REDACTED}"
        return x

    return clean(obj)


def redact_label(text: str | None, secrets: Iterable[str] | None = None) -> str | None:
    """A run name, tag or group with credentials removed: by environment value, by token shape,
    and 40-hex W&B keys as well (labels never need a commit id)."""
    if text is None:
        return None
    return WANDB_KEY_SHAPE.sub(REDACTED, scrub(str(text), secrets))


def redact_line(text: str, secrets: Iterable[str] | None = None) -> str:
    """A message line (an error on stderr) with credentials redacted: credential-like environment
    values and token-shaped values only; no ``key: value`` guessing, which would eat the message
    (``logger.api_key: unknown key``)."""
    for value in secret_values() if secrets is None else secrets:
        text = text.replace(value, REDACTED)
    return redact_shapes(text)


def scrub_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """Text of a YAML record or a command line with credentials redacted: values of
    credential-like keys (``api_key: ...``, ``HF_TOKEN=...``), credential-like environment
    values, and token-shaped values."""
    secrets = list(secret_values() if secrets is None else secrets)
    clean = _SECRET_ASSIGNMENT.sub(lambda m: f"{m['key']}{m['sep']}{REDACTED}", text)
    for value in secrets:
        clean = clean.replace(value, REDACTED)
    clean = _LABEL_VALUE.sub(lambda m: WANDB_KEY_SHAPE.sub(REDACTED, m[0]), clean)
    return redact_shapes(clean)


def scrub_file(path) -> bool:
    """Rewrite ``path`` (a YAML record) with credentials redacted, in one rename; True if it changed."""
    from pathlib import Path

    path = Path(path)
    text = path.read_text()
    clean = scrub_text(text)
    if clean == text:
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(clean)
    os.replace(tmp, path)
    return True


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
