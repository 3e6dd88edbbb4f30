"""The tree's rules, checked (docs/development.md, "The tree"): imports go one way (demos, benches and tools -> app;
never back; benches -> tools, never back; neither -> tests), no two modules import each other (directly or round a
loop), no function under app/ is longer than a
screen, and no module reads or writes another module's private names (a leading underscore: that module's own)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "bench", "tools")
IMPORTABLE = (*PACKAGES, "tests")  # what an import is recorded for: the packages, and the tests they must not import
# A function's body, its docstring left out, fits on one screen.
MAX_FUNCTION_LINES = 60
# Functions over the limit, each to be split (name -> why it is still long). Empty is the goal.
LONG_FUNCTIONS: dict[str, str] = {}


def modules() -> dict[str, set[str]]:
    """Every module of app/, bench/ and tools/ with the project modules it imports (function-level imports too)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            deps = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in IMPORTABLE:
                    deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names if a.name.split(".")[0] in IMPORTABLE}
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


def test_benches_import_tools_never_the_reverse_and_neither_imports_tests():
    # One direction for what both need (provenance, the compose project, the renderers): tools/. A renderer reads a
    # results file, never a bench; a bench or a tool never needs a test module (tests own the drills and checks).
    def wrong(module: str, dep: str) -> bool:
        top = dep.split(".")[0]
        return top == "tests" or (module.startswith("tools") and top == "bench")

    found = {m: sorted(d for d in deps if wrong(m, d)) for m, deps in modules().items() if not m.startswith("app")}
    assert {m: d for m, d in found.items() if d} == {}


def test_no_import_cycle_in_app_bench_or_tools():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


APP_FILES = sorted((ROOT / "app").rglob("*.py"))


def long_functions(source: str) -> dict[str, int]:
    """Each function (method) whose body, its docstring left out, is over MAX_FUNCTION_LINES: name -> lines."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[1] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body[0]
            lines = node.end_lineno - first.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found[node.name] = lines
    return found


@pytest.mark.parametrize("path", APP_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_function_under_app_fits_on_a_screen(path: Path):
    rel = str(path.relative_to(ROOT))
    long = {
        n: k for n, k in long_functions(path.read_text(encoding="utf-8")).items() if f"{rel}:{n}" not in LONG_FUNCTIONS
    }
    assert long == {}, f"{rel}: over {MAX_FUNCTION_LINES} lines: {long}; split each by job"


def test_the_length_rule_finds_a_long_function_and_skips_docstrings():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    doc = '    """' + "\n" * 20 + '    """\n'
    assert long_functions(f"def f():\n{doc}{body}\n") == {}
    assert long_functions(f"def f():\n{doc}{body}\n    x = 0\n") == {"f": MAX_FUNCTION_LINES + 1}


def private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: its functions, classes and constants, its classes' methods and the
    ``self._x`` attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def reaches_into(tree: ast.Module, own: set[str], others: set[str]) -> list[str]:
    """Accesses ``obj._x`` (obj not self, cls or super()) and imports ``from m import _x`` of a private name another
    module of app/ defines and this one does not."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("app"):
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name in others - own]
        elif isinstance(node, ast.Attribute) and node.attr in others - own:
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_under_app_reaches_into_another_modules_privates():
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in APP_FILES}
    defined = {p: private_names(tree) for p, tree in trees.items()}
    problems = {}
    for path, tree in trees.items():
        others = set().union(*(names for q, names in defined.items() if q != path))
        if found := reaches_into(tree, defined[path], others):
            problems[str(path.relative_to(ROOT))] = found
    assert problems == {}, "use (or add) a public name for what another module needs: " + str(problems)


def test_the_privates_rule_finds_an_access_and_an_import():
    tree = ast.parse("from app.x import _hidden\nobj._state = 1\nself._state = 2\n")
    assert reaches_into(tree, set(), {"_hidden", "_state"}) == ["from app.x import _hidden", "line 2: obj._state"]
