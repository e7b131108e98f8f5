"""User-facing errors: one line that names the key, the value given and what is allowed."""


class ConfigError(ValueError):
    """A configuration or input the user can fix; entry points print only the message and exit 2."""
