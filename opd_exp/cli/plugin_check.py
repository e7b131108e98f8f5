"""A registered divergence that is not one of ours passes ``check_divergence`` before it trains:
``opd-train`` runs the check once per version of the plugin's source (the pass is cached under
the opd-exp cache root) and refuses a failing one with the check's one line."""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

from opd_exp.runtime.errors import ConfigError, first_line


def _source_hash(cls: type, params: dict) -> str | None:
    """SHA-256 of the plugin's source files (every class of its MRO outside opd_exp), the
    checks' own source and the parameters; None when a source file cannot be read."""
    from opd_exp.divergences import check

    h = hashlib.sha256(json.dumps({"class": f"{cls.__module__}.{cls.__qualname__}", "params": params}, sort_keys=True).encode())
    files = {Path(check.__file__)}
    for c in cls.__mro__:
        if c.__module__.split(".")[0] not in ("opd_exp", "builtins", "abc"):
            try:
                files.add(Path(inspect.getsourcefile(c)))
            except (TypeError, OSError):
                return None
    for f in sorted(files):
        try:
            h.update(f.read_bytes())
        except (OSError, TypeError):
            return None
    return h.hexdigest()


def check_plugin_divergence(name: str, params: dict) -> None:
    """Run ``check_divergence`` on a registered divergence that is not one of ours (its class
    lives outside ``opd_exp``) at these parameters; refuse it in one line when a check fails.
    A pass is cached under the opd-exp cache root by a hash of the plugin's source, so a
    start costs the ~1 s check once per version of the file."""
    from opd_exp.divergences import DivergenceCheckError, check_divergence, divergence_class

    cls = divergence_class(name)
    if cls.__module__.split(".")[0] == "opd_exp":
        return
    digest = _source_hash(cls, params)
    marker = None
    if digest is not None:
        from opd_exp.pairs.embedded.cache import cache_root

        marker = cache_root() / "divergence-checks" / f"{digest[:32]}.ok"
        if marker.is_file():
            return
    try:
        check_divergence(cls(**params))
    except DivergenceCheckError as ex:
        raise ConfigError(
            f"divergence={name} ({cls.__module__}.{cls.__qualname__}) fails check_divergence: {first_line(ex)}; "
            f"allowed: a divergence whose costs and values pass check_divergence (docs/extending.md)"
        ) from None
    except Exception as ex:  # the plugin's own code raised
        raise ConfigError(
            f"divergence={name} ({cls.__module__}.{cls.__qualname__}): check_divergence raised {type(ex).__name__}: "
            f"{first_line(ex)}; allowed: a divergence that passes check_divergence (docs/extending.md)"
        ) from None
    if marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{cls.__module__}.{cls.__qualname__} {json.dumps(params, sort_keys=True)}\n")
        except OSError:
            pass  # a read-only cache: check again next time


def check_plugin_estimator(cfg) -> None:
    """Run ``check_estimator`` on a registered estimator that is not one of ours, at the run's
    divergence and loss; refuse it in one line when its expected gradient is not the divergence's."""
    from opd_exp.training.estimator_check import EstimatorCheckError, check_estimator
    from opd_exp.training.estimators import get_estimator

    est = get_estimator(cfg.estimator.name.value)
    cls = type(est)
    if cls.__module__.split(".")[0] == "opd_exp":
        return
    where = f"estimator={cls.name} ({cls.__module__}.{cls.__qualname__})"
    try:
        check_estimator(cfg)
    except EstimatorCheckError as ex:
        raise ConfigError(
            f"{where} fails check_estimator: {first_line(ex)}; allowed: an estimator whose expected gradient is the divergence's (docs/extending.md)"
        ) from None
    except Exception as ex:  # the plugin's own code raised
        raise ConfigError(
            f"{where}: check_estimator raised {type(ex).__name__}: {first_line(ex)}; allowed: an estimator that passes check_estimator (docs/extending.md)"
        ) from None
