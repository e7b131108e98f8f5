"""One owner for metric names (opd_exp/metric_names.py): every ``group/name`` literal the package
writes is declared there, every key a run logs is declared, and every declared name is in the docs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import opd_exp
from helpers.tiny import AddTask, small_config
from opd_exp.metric_names import EVAL, FAMILIES, METRICS, STEP, declared

ROOT = Path(opd_exp.__file__).resolve().parent
GROUPS = "jsd|kl|exact|advantages|student|teacher|overlap|rollout|response|perf|grad|guard|ppo|estimator|positions|cost|reward|eval|self|align|episode|tools"
LITERAL = re.compile(rf'"((?:{GROUPS})/[a-z_@0-9/]+)"')


def test_every_metric_literal_in_the_package_is_declared():
    undeclared = {}
    for path in ROOT.rglob("*.py"):
        if path.name == "metric_names.py":
            continue
        for name in LITERAL.findall(path.read_text()):
            if not name.endswith("/") and not declared(name):
                undeclared.setdefault(name, str(path.relative_to(ROOT)))
    assert not undeclared, f"declare these in opd_exp/metric_names.py: {undeclared}"


def test_every_logged_key_is_declared(tiny_pair, tmp_path):
    from opd_exp.training.trainer import Trainer

    cfg = small_config(
        estimator={"name": "sampled", "baseline": "exact"},
        loss={"name": "ppo", "ppo_epochs": 2},
        trainer={"max_steps": 2},
        eval={"every": 1},
    )
    Trainer(cfg, tmp_path, pair=tiny_pair, task=AddTask()).run()
    keys = {k for line in (tmp_path / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)} - {"step"}
    assert keys and not [k for k in keys if not declared(k)]


def test_every_declared_name_is_in_the_docs():
    docs = (ROOT.parent / "docs" / "training.md").read_text()
    missing = [n for n in {**STEP, **EVAL} if f"`{n}`" not in docs]
    assert not missing, missing
    assert set(METRICS) == set(STEP) | set(EVAL) | set(FAMILIES)
