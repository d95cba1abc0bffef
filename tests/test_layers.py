"""Imports run one way (docs/ARCHITECTURE.md): kernels <- engine <- jobs.store <- jobs <- dashboard, with
the benchmarks (the lab) on top of them all; and no two modules import each other, however indirectly.

Parsed from the source, not imported: every `import` / `from ... import` in the four packages (at any
depth, lazy ones inside functions included) is checked against what its layer may use. `engine.stats`
is the only piece of the engine the store sees; code outside the store uses its public API
(`from jobs.store import ...`), never its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "engine", "jobs", "dashboard", "benchmarks")

# layer -> (what it may import: exact module names or prefixes ending in '.')
ALLOWED = {
    "kernels": ("kernels.",),
    "engine": ("kernels.", "engine."),
    "jobs.store": ("jobs.store.", "engine.stats"),
    "jobs": ("kernels.", "engine.", "jobs.", "jobs.store"),
    "dashboard": ("dashboard.", "jobs.store"),
    "benchmarks": ("kernels.", "engine.", "jobs.", "jobs.store", "dashboard."),
}


def layer_of(module: str) -> str:
    if module == "jobs.store" or module.startswith("jobs.store."):
        return "jobs.store"
    return module.split(".")[0]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of one of our packages in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant):
            found.append((node.lineno, node.args[0].value))
    return [(line, m) for line, m in found if m.split(".")[0] in PACKAGES]


def allowed(source_layer: str, target: str) -> bool:
    if layer_of(target) == source_layer:
        return True  # within a layer, anything (the store's own modules included)
    rules = ALLOWED[source_layer]
    if target.startswith("jobs.store.") and source_layer != "benchmarks":
        return False  # outside the store (and the lab, which measures its parts): its public API only
    return any(target in (r, r.rstrip(".")) or (r.endswith(".") and target.startswith(r)) for r in rules)


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = layer_of(module_name(path, root))
            for line, target in imported_modules(path):
                if not allowed(source, target):
                    bad.append(f"{path.relative_to(root)}:{line}: {source} imports {target}")
    return bad


def test_imports_run_one_way():
    assert violations() == []


def imported_names(path: Path) -> list[str]:
    """Every dotted name a file imports (lazy imports included): `from a.b import c` gives `a.b.c`
    (a module `a.b.c`, or a name inside `a.b`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return [m for m in found if m.split(".")[0] in PACKAGES]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (lazy imports inside functions included), each import
    taken as the longest module its dotted name starts with."""
    modules = {module_name(p, root): p
               for package in PACKAGES for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for target in imported_names(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted: every import loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                loops.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(loops)


def test_no_import_loops():
    """A package's `__init__` re-exporting its modules is not a loop unless a module imports it back."""
    assert import_loops(import_graph()) == []


def test_a_planted_loop_is_caught(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text("from engine.b import f\n")
    (tmp_path / "engine" / "b.py").write_text("def f():\n    from engine.c import g\n")
    (tmp_path / "engine" / "c.py").write_text("import engine.a\n")
    (tmp_path / "engine" / "d.py").write_text("from engine.a import x\n")
    assert import_loops(import_graph(tmp_path)) == [["engine.a", "engine.b", "engine.c"]]


@pytest.mark.parametrize(("source", "target", "ok"), [
    ("engine", "jobs.store", False), ("engine", "kernels.ops", True), ("kernels", "engine.config", False),
    ("jobs.store", "engine.stats", True), ("jobs.store", "engine.config", False),
    ("jobs", "jobs.store", True), ("jobs", "jobs.store.parts", False), ("jobs", "dashboard.cli", False),
    ("dashboard", "jobs.store", True), ("dashboard", "jobs.store.usersql", False),
    ("dashboard", "engine.config", False), ("dashboard", "jobs.input_contract", False),
])
def test_the_rules_themselves(source, target, ok):
    assert allowed(source, target) is ok


def test_a_planted_upward_import_is_caught(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "engine" / "bad.py").write_text("def f():\n    from jobs.store import Store\n")
    (tmp_path / "jobs" / "cli.py").write_text("import importlib\nimportlib.import_module('dashboard.cli')\n")
    assert violations(tmp_path) == ["engine/bad.py:2: engine imports jobs.store",
                                    "jobs/cli.py:2: jobs imports dashboard.cli"]
