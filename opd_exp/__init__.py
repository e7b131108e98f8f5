"""opd-exp: on-policy distillation experiments."""

__version__ = "0.1.0"
