"""User-facing errors: one line that names the key, the value given and what is allowed."""


class ConfigError(ValueError):
    """A configuration or input the user can fix; entry points print only the message and exit 2."""


def first_line(ex: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an exception's message (or its type's name)."""
    lines = [ln.strip() for ln in str(ex).splitlines() if ln.strip()]
    return (lines[0] if lines else type(ex).__name__)[:limit]
