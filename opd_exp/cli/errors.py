"""Hydra's and OmegaConf's multi-line errors as the one line ``opd-train`` prints: what was wrong, the
value given, and what is allowed."""

from __future__ import annotations

from opd_exp.runtime.errors import ConfigError, first_line
from opd_exp.runtime.guards import Diverged
from opd_exp.runtime.secrets import redact_line


def one_line(ex: BaseException) -> str:
    """The error as the one line ``opd-train`` prints, credentials redacted: a line that quotes
    a value (``teacher.url=...``, an override) lands in terminals and CI logs."""
    return redact_line(_one_line(ex))


def _one_line(ex: BaseException) -> str:
    """Hydra/OmegaConf errors span lines (search paths, options, object types): one line."""
    import re

    from hydra.errors import MissingConfigException
    from omegaconf.errors import MissingMandatoryValue

    if isinstance(ex, (ConfigError, Diverged)):  # ours: already one line
        return first_line(ex, 2000)
    if isinstance(ex, MissingConfigException) and ex.options:
        missing = (ex.missing_cfg_file or "").strip("/")
        group, _, option = missing.rpartition("/")
        if group:
            return f"{group}={option}: no such option; allowed: {', '.join(sorted(ex.options))}"
    text = str(ex)
    # a group file without `# @package _global_`: its keys land under `<group>.`
    m = re.search(r"In '(?P<group>[\w/.-]+)/(?P<name>[\w.-]+)'.*Key '(?P<key>[\w-]+)' not in '\w+'", text, re.DOTALL)
    if m and m["group"].rsplit("/", 1)[-1] == m["key"]:
        return (
            f"{m['group']}={m['name']}: the file {m['group']}/{m['name']}.yaml sets its keys under '{m['key']}.' (its first line "
            f"is not `# @package _global_`); allowed: a first line `# @package _global_` (as in conf/experiment/*.yaml)"
        )
    # `+variant=x` where conf/train.yaml already lists the group (as null)
    m = re.search(r"Multiple values for (?P<g>[\w/.-]+)\. To override a value use 'override (?P=g): (?P<o>[^']+)'", text)
    if m:
        g, o = m["g"], m["o"]
        return (
            f"+{g}={o}: {g} is already in the defaults list (conf/train.yaml); allowed: {g}={o} without '+' on the command "
            f"line (in a config file's defaults: `override /{g}: {o}`)"
        )
    if isinstance(ex, MissingMandatoryValue) or "has missing mandatory value" in text:
        key = getattr(ex, "full_key", None) or text.rsplit(":", 1)[-1].strip()
        return f"{key}: has no value (removed with `~{key}`?); allowed: a value, or an option of the {key} group (e.g. `{key}=<option>`)"
    if "LexerNoViableAltException" in text or "token recognition error" in text:
        bad = next((c for c in text if ord(c) > 127), None)
        if bad is not None:
            return (
                f"{first_line(ex, 200)}: the override holds the non-ASCII character {bad!r}, which Hydra reads only inside "
                f"quotes; allowed: a quoted value, e.g. 'key=\"{bad}...\"' (the shell's quotes around Hydra's)"
            )
    parts = []
    for e in (ex, ex.__cause__):
        if e is None:
            continue
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        keep = [
            ln
            for ln in lines
            if not ln.startswith(("full_key:", "object_type", "reference_type", "Config search path", "provider=", "Set the environment"))
        ]
        key = getattr(e, "full_key", None)
        text = "; ".join(keep[:3])
        parts.append(f"{key}: {text}" if key and key not in text else text)
    return " -- ".join(p for p in parts if p) or type(ex).__name__


def yaml_line(ex: BaseException) -> str:
    """A YAML syntax error in a config file: where, and what the parser expected."""
    mark = getattr(ex, "problem_mark", None) or getattr(ex, "context_mark", None)
    where = f"{mark.name}:{mark.line + 1}" if mark is not None else "a config file"
    problem = " ".join(str(getattr(ex, "problem", "") or first_line(ex)).split())
    return f"{where} is not valid YAML ({problem}); allowed: a YAML file (quote values with ':', '[', '{{' or '#' in them)"


def argv_problem(argv: list[str]) -> str | None:
    """Flag combinations Hydra refuses with a traceback."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    shown = [a for a in argv if a in ("--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")]
    if multirun and shown:
        return (
            f"-m and {shown[0]}: Hydra prints the config of one job, not of a multirun; allowed: {shown[0]} without -m "
            f"(with one value per swept key), or -m without {shown[0]} (each job's config is saved in its .hydra/config.yaml)"
        )
    return None


def io_error(ex: OSError) -> ConfigError:
    """A disk or permission problem as one line (a full disk during a checkpoint save included);
    one inside the model cache names OPD_EXP_CACHE, not the run folder."""
    import shutil

    from opd_exp.pairs.embedded import cache

    if isinstance(ex, shutil.Error):  # copytree's list of (src, dst, why): the first failure
        failed, why = cache.copy_failure(ex)
        return ConfigError(
            cache.problem_line(failed, why)
            if cache.in_cache(failed)
            else f"cannot copy {failed}: {why}; allowed: a writable folder with free space"
        )
    named = [p for p in (getattr(ex, "filename", None), getattr(ex, "filename2", None)) if p]
    inside = next((p for p in named if cache.in_cache(p)), None)
    if inside is not None:
        return ConfigError(cache.problem_line(inside, ex.strerror or first_line(ex)))
    where = f" ({ex.filename})" if getattr(ex, "filename", None) else ""
    return ConfigError(
        f"cannot write the run folder or read an input{where}: {ex.strerror or first_line(ex)}; "
        f"allowed: a writable hydra.run.dir with free space, and readable inputs"
    )
