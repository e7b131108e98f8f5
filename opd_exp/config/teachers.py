"""``teachers.*``: several teachers (multi-teacher OPD, MOPD), each prompt routed to the one
that knows its domain (docs/training.md, "Several teachers").

``teachers.map`` is empty by default: the pair's teacher (``model_pair.teacher``, reached as the
``teacher`` group says) scores every token, exactly as before the group existed. With entries,
each names a teacher and what it covers under ``teachers.route``:

* ``route: operator`` (tasks arithmetic, chat_arithmetic): a prompt's operators. A teacher takes
  the prompts whose operators it all covers (``covers: ['+', '-']``); where several do, the one
  that covers fewest operators (the most specialised), then the first listed.
* ``route: field:<name>``: a per-prompt column, the problem's attribute ``<name>`` (a registered
  task whose problems carry one, e.g. ``domain``); a teacher covers the values it lists.
* ``route: null``: one teacher, which takes every prompt.

A teacher whose ``covers`` is empty takes every prompt no other one covers (one such at most).
Checked here, before any model loads: the route's name, the names, the covers, and with
``route=operator`` that every operator mix the task can draw has a teacher.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from opd_exp.runtime.errors import ConfigError

OPERATOR = "operator"
FIELD = "field:"
OPERATORS = "+-*"
# tasks whose problems are arithmetic expressions (``route=operator`` reads their operators)
OPERATOR_TASKS = ("arithmetic", "chat_arithmetic")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# teacher/<name>/... sits beside these per-token metrics: a teacher may not take their names
RESERVED_NAMES = ("entropy", "logprob_mean")


@dataclass
class TeacherSource:
    """One teacher of ``teachers.map`` (exactly one of ``pair`` and ``path``)."""

    # a conf/model_pair option (or a .yaml file of one) whose teacher this is, prepared with that
    # option's recipe and, where it sets for_task, for that conf/task option: e.g. embedded_chain
    pair: str | None = None
    # or the model as model_pair.teacher takes it: a local folder, a hub id, 'embedded:teacher' (the
    # run's own pair recipe and task), 'embedded:student', 'smollm2:teacher'
    path: str | None = None
    # what it teaches under teachers.route: operators ('+', '-', '*') for route=operator, the
    # column's values for route=field:<name>; empty: every prompt no other teacher covers
    covers: list[str] = field(default_factory=list)
    # teacher=served: http://HOST:PORT of this teacher's server (teacher.* sets the rest for all;
    # the pair or path above is loaded here too, for the self-test and the teacher's eval accuracy)
    url: str | None = None
    # teacher=served: the model name its server serves (vLLM --served-model-name)
    model: str = "teacher"


@dataclass
class TeachersConfig:
    """Several teachers, and the rule that picks each prompt's (see the module docstring)."""

    # operator | field:<name> | null (one teacher takes every prompt)
    route: str | None = None
    # name -> a TeacherSource's keys ({path: ..., covers: [...]}); empty: the pair's teacher alone,
    # as without this group. Untyped for Hydra (a typed dict of dataclasses cannot take new entries
    # from the command line): checked and turned into TeacherSource here
    map: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.map = {name: _source(f"teachers.map.{name}", raw) for name, raw in self.map.items()}
        route = self.route
        if route is not None and route != OPERATOR and not (route.startswith(FIELD) and _NAME.match(route[len(FIELD) :])):
            _fail("teachers.route", route, f"{OPERATOR}, {FIELD}<name> (a per-prompt column, e.g. {FIELD}domain), or null")
        if not self.map:
            if route is not None:
                _fail("teachers.route", route, "null with an empty teachers.map (no teachers to route to)")
            return
        if route is None and len(self.map) > 1:
            _fail("teachers.route", None, f"{OPERATOR} or {FIELD}<name> with {len(self.map)} teachers (which prompt goes where)")
        for name, src in self.map.items():
            key = f"teachers.map.{name}"
            if not _NAME.match(name) or name in RESERVED_NAMES:
                _fail(key, name, f"a lower-case identifier like 'addsub', other than {', '.join(RESERVED_NAMES)}")
            if (src.pair is None) == (src.path is None):
                _fail(f"{key}.pair", src.pair, f"exactly one of {key}.pair (a model_pair option) and {key}.path (a model)")
            if route is None and src.covers:
                _fail(f"{key}.covers", list(src.covers), "[] with teachers.route=null (the one teacher takes every prompt)")
            if route == OPERATOR:
                bad = [c for c in src.covers if c not in OPERATORS]
                if bad:
                    _fail(f"{key}.covers", list(src.covers), f"operators among {list(OPERATORS)}")
            if len(set(src.covers)) != len(src.covers):
                _fail(f"{key}.covers", list(src.covers), "each value once")
        catch_all = [n for n, s in self.map.items() if not s.covers]
        if route is not None and len(catch_all) > 1:
            _fail(f"teachers.map.{catch_all[1]}.covers", [], f"a non-empty list: teachers.map.{catch_all[0]} already takes the rest")
        seen: dict[frozenset, str] = {}
        for name, src in self.map.items():
            if src.covers and (other := seen.setdefault(frozenset(src.covers), name)) != name:
                _fail(f"teachers.map.{name}.covers", list(src.covers), f"another set than teachers.map.{other}.covers (same teacher twice)")

    @property
    def active(self) -> bool:
        return bool(self.map)


def pick(covers: list[list[str]], label: frozenset) -> int | None:
    """The teacher of a prompt with route values ``label`` (its operators, or its column's value):
    among those covering all of it, the one covering fewest, then the first listed; else the
    catch-all (empty covers); None: no teacher."""
    found = [(len(c), i) for i, c in enumerate(covers) if c and label <= set(c)]
    if found:
        return min(found)[1]
    return next((i for i, c in enumerate(covers) if not c), None)


def operator_mixes(ops: str, max_operands: int) -> list[frozenset]:
    """Every set of operators a problem of the arithmetic task can hold (``ops`` drawn per
    position, up to ``max_operands - 1`` operators)."""
    distinct = sorted(set(ops), key=OPERATORS.index)
    return [frozenset(c) for n in range(1, min(len(distinct), max_operands - 1) + 1) for c in itertools.combinations(distinct, n)]


def validate_teachers(cfg) -> None:
    """The map's combinations with the rest of a ``TrainConfig`` (one line each, before any model loads)."""
    te = cfg.teachers
    if not te.active:
        return
    n = len(te.map)
    if te.route == OPERATOR:
        task = cfg.task
        if task.name not in OPERATOR_TASKS:
            _fail("teachers.route", OPERATOR, f"{FIELD}<name> with task={task.name} (operator reads {', '.join(OPERATOR_TASKS)} prompts)")
        covers = [list(s.covers) for s in te.map.values()]
        for mix in operator_mixes(task.ops, task.max_operands):
            if pick(covers, mix) is None:
                shown = "".join(sorted(mix, key=OPERATORS.index))
                _fail(
                    "teachers.route",
                    OPERATOR,
                    f"teachers that cover every problem the task draws (none covers one with operators {shown!r}: task.ops="
                    f"{task.ops!r}, up to task.max_operands={task.max_operands} operands); add a teacher with covers={list(shown)}, "
                    "a catch-all teacher (covers=[]), or task.max_operands=2",
                )
    served = cfg.teacher.served
    for name, src in te.map.items():
        key = f"teachers.map.{name}"
        if served and src.url is None:
            _fail(f"{key}.url", None, "http://HOST:PORT of this teacher's vLLM server with teacher=served (opd-serve-teacher prints it)")
        if not served and src.url is not None:
            _fail(f"{key}.url", src.url, "null with teacher=in_process (or teacher=served)")
        if src.url is not None and not (src.url.startswith(("http://", "https://")) and src.url.split("://", 1)[1].strip("/")):
            _fail(f"{key}.url", src.url, "http://HOST:PORT (the server opd-serve-teacher prints)")
        if src.pair is not None:
            pair_option(key, src.pair)
    if served and cfg.teacher.url is not None:
        _fail("teacher.url", cfg.teacher.url, "null with teachers.map (each teacher's server is teachers.map.<name>.url)")
    if n > 1:
        ro = cfg.rollout
        if ro.on_policy_fraction < 1.0:
            _fail(
                "rollout.on_policy_fraction",
                ro.on_policy_fraction,
                f"1.0 with {n} teachers (teachers.map): a teacher-sampled step would need one teacher to sample every prompt",
            )


def pair_option(key: str, option: str) -> Path:
    """The YAML file of a ``pair`` source: a conf/model_pair option, or a .yaml file; one line if neither."""
    from opd_exp.config.folders import CONF_DIR

    folder = CONF_DIR / "model_pair"
    path = Path(option).expanduser() if option.endswith((".yaml", ".yml")) else folder / f"{option}.yaml"
    if not path.is_file():
        options = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        _fail(f"{key}.pair", option, f"a conf/model_pair option ({options}) or the path of a model_pair .yaml file")
    return path


def _source(key: str, raw: Any) -> TeacherSource:
    """A map entry (a mapping of TeacherSource's keys) as a TeacherSource; one line for an unknown key or a wrong type."""
    if isinstance(raw, TeacherSource):
        return raw
    if not isinstance(raw, Mapping):
        _fail(key, raw, "a mapping like {path: 'embedded:teacher', covers: ['+', '-']}")
    names = [f.name for f in fields(TeacherSource)]
    for k in raw:
        if k not in names:
            raise ConfigError(f"{key}.{k}: unknown key; allowed: {', '.join(names)}")
    covers = raw.get("covers", [])
    if not isinstance(covers, (list, tuple)) or not all(isinstance(c, (str, int)) and not isinstance(c, bool) for c in covers):
        _fail(f"{key}.covers", covers, "a list of values, e.g. ['+', '-'] ([] takes every prompt no other teacher covers)")
    for k in ("pair", "path", "url"):
        if raw.get(k) is not None and not (isinstance(raw[k], str) and raw[k].strip()):
            _fail(f"{key}.{k}", raw[k], "null or a non-empty string")
    if not isinstance(raw.get("model", "teacher"), str):
        _fail(f"{key}.model", raw["model"], "a string (vLLM --served-model-name)")
    return TeacherSource(**{**raw, "covers": [str(c) for c in covers]})


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r} is not allowed; allowed: {allowed}")
