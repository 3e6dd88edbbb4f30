"""The tree's rules, checked: imports go one way (demos, benches and tools -> app; never back), no two modules import
each other (directly or round a loop), and no module under app/ grows past a screenful of screens (400 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "bench", "tools")
MAX_LINES = 400


def modules() -> dict[str, set[str]]:
    """Every module of app/, bench/ and tools/ with the project modules it imports (function-level imports too)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            deps = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                    deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
            found[name] = deps
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    return {m: {resolve(d) for d in deps if resolve(d) and resolve(d) != m} for m, deps in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, found = {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_app_never_imports_its_benches_or_tools():
    back = {m: sorted(d for d in deps if not d.startswith("app")) for m, deps in import_graph().items()}
    assert {m: d for m, d in back.items() if m.startswith("app") and d} == {}


def test_no_import_cycle_in_app_bench_or_tools():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("path", sorted((ROOT / "app").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_under_app_is_over_400_lines(path: Path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by job"
