"""The one range check of every config group, and its one message format:
``<key>=<value> is not allowed; allowed: <what is>``."""

from __future__ import annotations

import math
from typing import Any

from opd_exp.runtime.errors import ConfigError


def fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r} is not allowed; allowed: {allowed}")


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        fail(key, value, allowed)


def finite(x: Any) -> bool:
    """A real number (an int or float, not a bool) that is neither inf nor NaN."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
