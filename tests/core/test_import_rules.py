"""The import rules of docs/architecture.md ("Packages and what each may import"), checked on the
source: every ``import`` in ``graphpass/`` and ``backends/``, at module level and inside functions
(lazy imports count: they run too), read with ``ast``. Imports under ``if TYPE_CHECKING:`` never run
and are left out. ``backends`` is installed as ``graphpass.backends``; both spellings are one module.

An edge goes to the module named (``from pkg import name`` goes to ``pkg.name`` when that is a
module, else to ``pkg``); the implicit import of a module's parent packages is not an edge (every
module would otherwise sit in a circle with ``graphpass/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALIASES = {"graphpass.backends": "backends"}
FEATURES = ("offloading", "capturing", "static_shapes", "models", "integrations")
# modules of the top level that answer graph and config questions and hold the shared data: they
# never import the passes or the pipeline
SHARED = ("analysis", "fx_utils", "torch_compat", "patterns", "errors", "roots", "formatting", "atomic_files",
          "config", "ops", "bucket_context", "dynamo_records", "trace_events", "version", "progress")
# what a pass may import from a feature package: what it inserts or looks up, and the data it fills
PASS_FEATURE_IMPORTS = {
    "graphpass.capturing.ops", "graphpass.offloading.ops", "graphpass.offloading.registry",
    "graphpass.offloading.facts", "graphpass.offloading.schedule", "graphpass.static_shapes.plan", "graphpass.static_shapes.padding_safety",
    "graphpass.static_shapes.padding_proof",
    "graphpass.static_shapes.causal_functions", "graphpass.static_shapes.topk_mask",
    "graphpass.static_shapes.position_tables",
}
BACKENDS_MAY_IMPORT = {"graphpass.errors", "graphpass.fx_utils", "graphpass.torch_compat"}


def _modules(root: Path, tops=("graphpass", "backends")) -> dict[str, tuple[Path, bool]]:
    mods = {}
    for top in tops:
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _canonical(name: str) -> str:
    for alias, real in ALIASES.items():
        if name == alias or name.startswith(alias + "."):
            return real + name[len(alias):]
    return name


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def _targets(node: ast.AST, package: str, mods: dict, tops: tuple) -> list[str]:
    """The modules of ours one import statement names."""
    if isinstance(node, ast.Import):
        names = [_canonical(a.name) for a in node.names]
        return [_nearest(n, mods) for n in names if n.split(".")[0] in tops and _nearest(n, mods)]
    if node.level:
        base = package.split(".")
        base = base[: len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    module = _canonical(module)
    if module.split(".")[0] not in tops:
        return []
    found = []
    for alias in node.names:
        full = f"{module}.{alias.name}"
        target = full if full in mods else _nearest(module, mods)
        if target:
            found.append(target)
    return found


def _nearest(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT, tops=("graphpass", "backends")) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (module level and inside functions)."""
    mods = _modules(root, tops)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if is_pkg else name.rpartition(".")[0]
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                graph[name].update(_targets(node, package, mods, tops))
        graph[name].discard(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """The import circles: each strongly connected component of more than one module (Tarjan),
    sorted, with one cycle through its first module (``a -> b -> ... -> a``)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[list[str], list[str]]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (~100)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append((sorted(component), _cycle_in(sorted(component), graph)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through the component's first module (breadth first: a shortest one)."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w not in parent:
                parent[w] = v
                todo.append(w)
    return component  # pragma: no cover - a component always holds a cycle through each member


def _area(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "backends":
        return "backends"
    return parts[1] if len(parts) > 1 and (parts[1] in FEATURES or parts[1] == "passes") else "top"


def _describe(found: list[tuple[list[str], list[str]]]) -> str:
    return "\n".join(f"{len(members)} modules ({', '.join(members)}); one cycle: " + " -> ".join(cycle)
                     for members, cycle in found)


# ---------------------------------------------------------------------------------------------- rules


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_no_import_circles(graph):
    found = circles(graph)
    print(f"import circles among graphpass/ and backends/: {len(found)}")
    assert not found, "import circles:\n" + _describe(found)


def test_shared_modules_and_features_never_import_passes_or_the_pipeline(graph):
    bad = [(m, t) for m, ts in graph.items() for t in ts
           if (t.startswith("graphpass.passes") or t == "graphpass.pipeline")
           and (_area(m) in FEATURES or _area(m) == "backends" or m.removeprefix("graphpass.") in SHARED)]
    assert not bad, bad


def test_no_feature_package_imports_another(graph):
    bad = [(m, t) for m, ts in graph.items() for t in ts
           if _area(m) in FEATURES and _area(t) in FEATURES and _area(m) != _area(t)]
    assert not bad, bad


def test_passes_import_from_features_only_what_they_insert_look_up_or_fill(graph):
    bad = [(m, t) for m, ts in graph.items() if _area(m) == "passes" for t in ts
           if _area(t) in FEATURES and t not in PASS_FEATURE_IMPORTS]
    assert not bad, bad


def test_backends_import_only_errors_and_the_toolkit(graph):
    bad = [(m, t) for m, ts in graph.items() if _area(m) == "backends" for t in ts
           if _area(t) != "backends" and t not in BACKENDS_MAY_IMPORT]
    assert not bad, bad


def test_the_scan_finds_circles_lazy_imports_included_and_type_checking_left_out(tmp_path):
    """The checks above can fail: a fake package with one circle through a function-level import,
    one through ``from . import name`` and a TYPE_CHECKING import that must not count."""
    pkg = tmp_path / "graphpass"
    (pkg / "feat").mkdir(parents=True)
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from graphpass import c\n")
    (pkg / "c.py").write_text("import graphpass.a\n")
    (pkg / "feat" / "__init__.py").write_text("")
    (pkg / "feat" / "x.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import y\n")
    (pkg / "feat" / "y.py").write_text("from .x import z\n")
    found = circles(import_graph(tmp_path))
    assert found == [(["graphpass.a", "graphpass.b", "graphpass.c"],
                      ["graphpass.a", "graphpass.b", "graphpass.c", "graphpass.a"])], _describe(found)
