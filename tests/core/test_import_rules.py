"""The import rules of docs/architecture.md ("Layers" and "Packages and what each may import"), checked
on the source: every ``import`` in ``graphpass/`` and ``backends/``, at module level, inside functions
(lazy imports count: they run too) and under ``if TYPE_CHECKING:`` (a type named across a boundary is
a dependency in meaning: two modules that name each other's types are one module split in two), read
with ``ast``. ``backends`` is installed as ``graphpass.backends``; both spellings are one module.

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
FEATURES = ("offloading", "capturing", "comparing", "static_shapes", "models", "integrations")
# modules of the top level that answer graph and config questions and hold the shared data: they
# never import the passes or the pipeline
SHARED = (
    "analysis",
    "fx_utils",
    "torch_compat",
    "patterns",
    "errors",
    "roots",
    "formatting",
    "atomic_files",
    "config",
    "ops",
    "bucket_context",
    "dynamo_records",
    "trace_events",
    "version",
    "progress",
    "pass_logging",
)
# The layers of the package, bottom to top (docs/architecture.md, "Layers"): a module imports from its own
# layer and the layers below. Names are modules or packages of graphpass ("__init__": the package itself)
# and ``backends``; every module is in exactly one layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundations",
        (
            "errors",
            "version",
            "formatting",
            "atomic_files",
            "progress",
            "tensor_utils",
            "fx_utils",
            "torch_compat",
            "dynamo_records",
            "patterns",
            "roots",
            "bucket_context",
            "trace_events",
            "model_shape",
            "capture_format",
            "ops",
            "pass_logging",
        ),
    ),
    ("delegates", ("backends", "delegation")),
    ("features", ("offloading", "capturing", "comparing", "static_shapes", "models")),
    ("composition", ("config", "analysis", "op_registry")),
    ("passes", ("passes",)),
    ("pipeline", ("pipeline",)),
    ("backend", ("dynamo_backend",)),
    (
        "front door",
        (
            "__init__",
            "__main__",
            "cli",
            "explain_report",
            "tracing",
            "trace_plot",
            "reference",
            "testing",
            "golden",
            "integrations",
        ),
    ),
)
# Every import that runs against LAYERS (a lower module importing a higher one), with its reason; at most
# three, each named in docs/architecture.md ("Layers"); a new one fails
# test_imports_against_the_layers_are_the_documented_few.
UPWARD_IMPORTS = {
    (
        "graphpass.static_shapes.padding_fuzz.run",
        "graphpass",
    ): "the padding fuzzer compiles its programs with graphpass.backend: it tests the full path a user runs",
    (
        "graphpass.delegation",
        "graphpass.pipeline",
    ): "the deprecated alias delegation.with_post_grad_passes (moved to pipeline), for one release",
}
# what a pass may import from a feature package: what it inserts or looks up, and the data it fills
PASS_FEATURE_IMPORTS = {
    "graphpass.capturing.ops",
    "graphpass.offloading.ops",
    "graphpass.offloading.registry",
    "graphpass.offloading.facts",
    "graphpass.offloading.schedule",
    "graphpass.static_shapes.plan",
    "graphpass.static_shapes.padding_safety",
    "graphpass.static_shapes.padding_proof",
    "graphpass.static_shapes.causal_functions",
    "graphpass.static_shapes.topk_mask",
    "graphpass.static_shapes.position_tables",
    "graphpass.capturing.model_capture",  # CaptureSpec, the type of the specs the capture pass reads (TYPE_CHECKING)
}
BACKENDS_MAY_IMPORT = {"graphpass.errors", "graphpass.fx_utils", "graphpass.torch_compat"}
# deprecated aliases, kept for one release: capturing's old compare paths re-export what moved to comparing/
MOVED_TO_COMPARING = (
    "compare_runs",
    "compare_report",
    "compare_tensors",
    "report_format",
    "completeness",
    "shards",
    "compare_engines",
    "engine_families",
    "plots",
)
DEPRECATED_ALIASES = {("graphpass.capturing", "graphpass.comparing")} | {
    (f"graphpass.capturing.{m}", f"graphpass.comparing.{m}") for m in MOVED_TO_COMPARING
}


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
            return real + name[len(alias) :]
    return name


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
    """Module -> the modules of ours it imports (module level, inside functions, under TYPE_CHECKING)."""
    mods = _modules(root, tops)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
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


def layer_of(module: str) -> int | None:
    """The index in LAYERS of ``module``'s layer (None: in no layer)."""
    if module.split(".")[0] == "backends":
        rel = module
    else:
        rel = "__init__" if module == "graphpass" else module.removeprefix("graphpass.")
    for i, (_, names) in enumerate(LAYERS):
        if any(rel == n or rel.startswith(n + ".") for n in names):
            return i
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports against LAYERS: (importer, imported) where the imported module's layer is higher."""
    return sorted(
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if layer_of(m) is not None and layer_of(t) is not None and layer_of(t) > layer_of(m)
    )


def _describe(found: list[tuple[list[str], list[str]]]) -> str:
    return "\n".join(
        f"{len(members)} modules ({', '.join(members)}); one cycle: " + " -> ".join(cycle) for members, cycle in found
    )


# ---------------------------------------------------------------------------------------------- rules


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_no_import_circles(graph):
    found = circles(graph)
    print(f"import circles among graphpass/ and backends/: {len(found)}")
    assert not found, "import circles:\n" + _describe(found)


def test_shared_modules_and_features_never_import_passes_or_the_pipeline(graph):
    bad = [
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if (t.startswith("graphpass.passes") or t == "graphpass.pipeline")
        and (_area(m) in FEATURES or _area(m) == "backends" or m.removeprefix("graphpass.") in SHARED)
    ]
    assert not bad, bad


def test_no_feature_package_imports_another(graph):
    bad = [
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if _area(m) in FEATURES and _area(t) in FEATURES and _area(m) != _area(t) and (m, t) not in DEPRECATED_ALIASES
    ]
    assert not bad, bad


def test_passes_import_from_features_only_what_they_insert_look_up_or_fill(graph):
    bad = [
        (m, t)
        for m, ts in graph.items()
        if _area(m) == "passes"
        for t in ts
        if _area(t) in FEATURES and t not in PASS_FEATURE_IMPORTS
    ]
    assert not bad, bad


def test_backends_import_only_errors_and_the_toolkit(graph):
    bad = [
        (m, t)
        for m, ts in graph.items()
        if _area(m) == "backends"
        for t in ts
        if _area(t) != "backends" and t not in BACKENDS_MAY_IMPORT
    ]
    assert not bad, bad


def test_every_module_sits_in_one_layer(graph):
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS (place each, docs/architecture.md 'Layers'): {unplaced}"
    names = [n for _, ns in LAYERS for n in ns]
    assert len(names) == len(set(names)), "a name in two layers"


def test_the_backend_is_above_every_feature(graph):
    """No feature package imports the backend, the pipeline or the passes: the backend runs the features."""
    features = LAYERS[[name for name, _ in LAYERS].index("features")][1]
    top = ("graphpass.dynamo_backend", "graphpass.pipeline", "graphpass.passes")
    bad = [
        (m, t)
        for m, ts in graph.items()
        if _area(m) in features
        for t in ts
        if any(t == x or t.startswith(x + ".") for x in top)
    ]
    assert not bad, bad


def test_imports_against_the_layers_are_the_documented_few(graph):
    """At most three imports run against LAYERS, each in UPWARD_IMPORTS with its reason and named in
    docs/architecture.md; the list is exact (an entry whose import is gone fails too)."""
    found = upward_imports(graph)
    print(f"imports against the layers: {len(found)}")
    assert len(UPWARD_IMPORTS) <= 3
    assert set(found) == set(UPWARD_IMPORTS), (
        "imports against the layers not in UPWARD_IMPORTS (move the code to its layer): "
        f"{sorted(set(found) - set(UPWARD_IMPORTS))}; listed but gone: {sorted(set(UPWARD_IMPORTS) - set(found))}"
    )
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for importer, imported in UPWARD_IMPORTS:
        short = [name.removeprefix("graphpass.") or "graphpass" for name in (importer, imported)]
        assert f"`{short[0]}` -> `{short[1]}`" in doc, f"docs/architecture.md does not name {short[0]} -> {short[1]}"
    layers = doc[doc.index("## Layers") :]
    for name, _ in LAYERS:
        assert f"**{name}**" in layers, f"docs/architecture.md 'Layers' does not describe the layer {name!r}"


def test_the_scan_finds_circles_lazy_and_type_checking_imports_included(tmp_path):
    """The checks above can fail: a fake package with one circle through a function-level import and
    ``from . import name``, and one through a TYPE_CHECKING import, which counts too."""
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
    assert found == [
        (["graphpass.a", "graphpass.b", "graphpass.c"], ["graphpass.a", "graphpass.b", "graphpass.c", "graphpass.a"]),
        (["graphpass.feat.x", "graphpass.feat.y"], ["graphpass.feat.x", "graphpass.feat.y", "graphpass.feat.x"]),
    ], _describe(found)


def test_the_layer_check_finds_an_import_from_above():
    """A feature's lazy import of the backend, and a TYPE_CHECKING import of the pipeline, are both upward."""
    graph = {
        "graphpass.static_shapes.plan": {"graphpass.dynamo_backend", "graphpass.errors"},
        "graphpass.roots": {"graphpass.pipeline"},
        "graphpass.dynamo_backend": {"graphpass.static_shapes.plan"},
        "graphpass.errors": set(),
        "graphpass.pipeline": set(),
    }
    assert upward_imports(graph) == [
        ("graphpass.roots", "graphpass.pipeline"),
        ("graphpass.static_shapes.plan", "graphpass.dynamo_backend"),
    ]
