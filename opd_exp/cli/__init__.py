"""Entry points: ``opd-train`` (train.py), ``opd-prepare`` (prepare.py), ``opd-compare`` (compare.py)."""
