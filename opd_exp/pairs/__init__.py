"""Model pairs: a teacher, a student and their shared tokenizer, loaded like hub models.

``load.py`` resolves a ``model_pair`` config to two folders (hub ids, local folders, or the
embedded pair under ``embedded/``, which the project builds and caches itself), runs the
pre-flight checks and loads both models. Pairs depend on tasks (the embedded pair is trained
on the arithmetic task), never the reverse.
"""

from opd_exp.pairs.load import LoadedPair, PreflightResult, load_pair, preflight, resolve_pair

__all__ = ["LoadedPair", "PreflightResult", "load_pair", "preflight", "resolve_pair"]
