"""The package tree shows the data flow: no import cycle between modules or between the
top-level packages, and the math imports nothing of ours."""

from __future__ import annotations

import ast
from pathlib import Path

import opd_exp

ROOT = Path(opd_exp.__file__).resolve().parent


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from runtime_nodes(node)


def imports() -> dict[str, set[str]]:
    """Every module -> the opd_exp modules it imports (top level or inside functions)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in runtime_nodes(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = (
                    name.split(".")[: -node.level]
                    if path.name != "__init__.py"
                    else name.split(".")[: len(name.split(".")) - node.level + 1]
                )
                mod = ".".join(base + ([node.module] if node.module else []))
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    top = lambda m: ".".join(m.split(".")[:2])
    out: dict[str, set[str]] = {}
    for n, deps in graph.items():
        out.setdefault(top(n), set()).update(top(d) for d in deps if top(d) != top(n))
    return out


def test_no_import_cycle_between_modules():
    assert find_cycle(imports()) is None


def test_no_import_cycle_between_top_level_packages():
    graph = package_graph(imports())
    assert find_cycle(graph) is None, graph


def test_the_math_imports_nothing_of_ours_but_itself():
    for name, deps in imports().items():
        if name.startswith("opd_exp.divergences"):
            assert all(d.startswith("opd_exp.divergences") for d in deps), (name, deps)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
