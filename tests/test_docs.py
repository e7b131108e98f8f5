"""The README is a front door and the docs hold together: the README's test command is the one
CI runs, its GPU status is on the first screen, every relative link and anchor in the README and
docs/ resolves, the migration table lives in one place, and the dataset row the README shows is
one the GSM8K reader accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

from opd_exp.tasks.base import verify
from opd_exp.tasks.gsm8k import row_to_problem

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PENDING: set[str] = set()  # doc files a link may name before they are written


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_readme_test_command_is_the_one_ci_runs():
    commands = [line.strip() for block in code_blocks(README.read_text(), "bash") for line in block.splitlines()]
    assert "python -m pytest -q -n 2 --dist loadfile" in commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert "python -m pytest -q -n 2 --dist loadfile" in ci
    assert "pip install torch==2.13.0" in commands and 'pip install -e ".[dev]"' in commands and "opd-train" in commands


def test_readme_is_short_and_states_the_gpu_status_on_its_first_screen():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, len(lines)
    first = next(i for i, line in enumerate(lines) if line.startswith("## GPU status"))
    assert first < 60, first
    assert "## Recipes" in lines


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in [README, *DOCS]:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if rel not in PENDING:
                    broken.append(f"{doc.name}: {target} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_migration_table_lives_in_one_place():
    holders = [p.relative_to(ROOT).as_posix() for p in [README, *DOCS] if "| their setting | ours |" in p.read_text()]
    assert holders == ["docs/migration.md"], holders


def test_the_readme_dataset_row_is_one_the_reader_accepts():
    (block,) = code_blocks(README.read_text(), "json")
    rows = [json.loads(line) for line in block.splitlines() if line.strip()]
    assert len(rows) == 1
    problem = row_to_problem(rows[0], "README row")
    assert problem.answer == "72"
    assert verify("48/2 = 24, 48 + 24 = 72\n#### 72", problem.answer)
    assert not verify("#### 72 #### 71", problem.answer)
