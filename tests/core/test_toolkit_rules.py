"""One answer per question (docs/architecture.md, "The toolkit is the only answer").

The scan walks the source of ``graphpass/`` and ``backends/`` (the AST: docstrings and comments do
not count) and refuses the raw spellings of five questions outside the module that answers them:

* what a tensor is (DTensor, its local shard and mesh, wrapper subclasses): ``tensor_utils.py``;
* which FSDP2 parameter groups a ``fully_shard`` module has (``fsdp_param_groups``): ``tensor_utils.py``;
* which fake mode / shape env a value belongs to (torch's ``detect_fake_mode``): ``tensor_utils.py``;
* an op's name, namespace, overload, schema: ``fx_utils.py`` (``op_name``, ``schema_position``);
* DTensor / wrapper-subclass dispatch rules of graphpass's ops: registered by the ops modules
  (``ops.py``) where the ops are defined, never by a pass.

Files are matched by name (``tensor_utils.py``, ``fx_utils.py``, ``ops.py``), not by folder, so the
rules hold wherever a module moves. Run ``python tests/core/test_toolkit_rules.py [ROOT]`` for the list.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

TENSOR_TOOLKIT = {"tensor_utils.py"}
OP_TOOLKIT = {"fx_utils.py"}
OPS_MODULES = {"ops.py"}

# attribute -> (question, the modules allowed to read it)
_ATTRS = {
    "_local_tensor": ("DTensor", TENSOR_TOOLKIT),
    "device_mesh": ("DTensor", TENSOR_TOOLKIT),
    "to_local": ("DTensor", TENSOR_TOOLKIT),
    "_spec": ("DTensor", TENSOR_TOOLKIT),
    "__tensor_flatten__": ("wrapper subclass", TENSOR_TOOLKIT),
    "fake_mode": ("fake mode", TENSOR_TOOLKIT),
    "shape_env": ("fake mode", TENSOR_TOOLKIT),
    "_schema": ("op naming", OP_TOOLKIT),
    "namespace": ("op naming", OP_TOOLKIT),
    "overloadpacket": ("op naming", OP_TOOLKIT),
    "_qualified_op_name": ("op naming", OP_TOOLKIT),
    "_overloadname": ("op naming", OP_TOOLKIT),
    "_custom_op_handlers": ("dispatch rule", TENSOR_TOOLKIT),
    "_op_dispatcher": ("dispatch rule", TENSOR_TOOLKIT),
    "_get_fsdp_state": ("FSDP2 groups", TENSOR_TOOLKIT),
    "_fsdp_param_group": ("FSDP2 groups", TENSOR_TOOLKIT),
    "_fsdp_param_groups": ("FSDP2 groups", TENSOR_TOOLKIT),
}
# names (imported or used) -> (question, allowed modules)
_NAMES = {
    "DTensor": ("DTensor", TENSOR_TOOLKIT),
    "is_traceable_wrapper_subclass": ("wrapper subclass", TENSOR_TOOLKIT),
    "detect_fake_mode": ("fake mode", TENSOR_TOOLKIT),
    "FakeTensorMode": ("fake mode", TENSOR_TOOLKIT),
    "TracingContext": ("fake mode", TENSOR_TOOLKIT),
}
# calls that register dispatch rules for graphpass's ops
_RULE_CALLS = {"register_dtensor_handlers", "register_torch_dispatch", "let_wrappers_through", "let_dtensors_through"}
_PASS_BASES = {"GraphPass", "CustomGraphPass"}


def _called_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _is_target(value: ast.AST) -> bool:
    """``target`` or ``<x>.target``: an FX node's target."""
    return (isinstance(value, ast.Name) and value.id == "target") or (
        isinstance(value, ast.Attribute) and value.attr == "target"
    )


def _defines_pass(tree: ast.Module) -> bool:
    return any(
        isinstance(n, ast.ClassDef)
        and any((b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")) in _PASS_BASES for b in n.bases)
        for n in ast.walk(tree)
    )


def scan_source(src: str, name: str, where: str = "") -> list[str]:
    """The violations in one module's source; ``name`` is its file name (``ops.py``), ``where`` the
    path printed with each line."""
    where = where or name
    tree = ast.parse(src)
    out: list[str] = []

    def bad(node: ast.AST, question: str, what: str) -> None:
        out.append(f"{where}:{node.lineno}: {question}: {what}")

    top_level = {id(s) for s in tree.body}
    top_calls = {id(n) for s in tree.body if id(s) in top_level and isinstance(s, ast.Expr) for n in ast.walk(s)}
    in_pass_module = _defines_pass(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Call) and _called_name(node.value) == "op_name":
                continue  # op_name(t).namespace: the toolkit's answer
            if node.attr in _ATTRS and name not in _ATTRS[node.attr][1]:
                bad(node, _ATTRS[node.attr][0], f".{node.attr}")
            elif node.attr == "__name__" and _is_target(node.value) and name not in OP_TOOLKIT:
                bad(node, "op naming", "target.__name__ (use fx_utils.op_name)")
        elif isinstance(node, ast.Name) and node.id in _NAMES and name not in _NAMES[node.id][1]:
            bad(node, _NAMES[node.id][0], node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                base = alias.name.rsplit(".", 1)[-1]
                if base in _NAMES and name not in _NAMES[base][1]:
                    bad(node, _NAMES[base][0], f"import {alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in _ATTRS:
            if name not in _ATTRS[node.value][1]:  # getattr(t, "fake_mode", None), hasattr(t, "_local_tensor")
                bad(node, _ATTRS[node.value][0], repr(node.value))
        elif isinstance(node, ast.Call) and _called_name(node) in _RULE_CALLS:
            called = _called_name(node)
            if in_pass_module:
                bad(node, "dispatch rule", f"{called}() in a pass's module: register it with the ops")
            elif called in ("register_dtensor_handlers", "let_dtensors_through") and (
                name not in OPS_MODULES or id(node) not in top_calls
            ):
                bad(node, "dispatch rule", f"{called}() outside an ops module's top level, where the ops are defined")
            elif called == "register_torch_dispatch" and name not in OPS_MODULES:
                bad(node, "dispatch rule", f"{called}() outside an ops module")
    return out


def violations(root: Path = ROOT) -> list[str]:
    found: list[str] = []
    for folder in ("graphpass", "backends"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            found += scan_source(path.read_text(), path.name, str(rel))
    return found


def test_no_raw_spellings_outside_the_toolkit():
    found = violations()
    assert not found, "raw spellings outside the toolkit (tensor_utils / fx_utils / ops modules):\n" + "\n".join(found)


# ------------------------------------------------------------------ the scan catches what it must


@pytest.mark.parametrize(
    "snippet, name, question",
    [
        ("y = t._local_tensor", "writer.py", "DTensor"),
        ("ok = hasattr(t, '_local_tensor')", "ops.py", "DTensor"),
        ("from torch.distributed.tensor import DTensor", "ops.py", "DTensor"),
        ("m = t.device_mesh", "model_capture.py", "DTensor"),
        ("from torch.utils._python_dispatch import is_traceable_wrapper_subclass", "fx_utils.py", "wrapper subclass"),
        ("names, ctx = t.__tensor_flatten__()", "planning.py", "wrapper subclass"),
        ("env = getattr(v, 'fake_mode', None)", "slice_static_buffers.py", "fake mode"),
        ("env = v.fake_mode.shape_env", "plan.py", "fake mode"),
        ("from torch._guards import detect_fake_mode", "dispatcher.py", "fake mode"),
        ("ns = node.target.namespace", "padding_safety.py", "op naming"),
        ("a = op._schema.arguments", "padding_safety.py", "op naming"),
        ("n = t.overloadpacket.__name__", "allocation_audit.py", "op naming"),
        ("n = node.target.__name__", "slice_static_buffers.py", "op naming"),
        ("cls._op_dispatcher._custom_op_handlers[op] = h", "ops.py", "dispatch rule"),
        ("g = getattr(m._get_fsdp_state(), '_fsdp_param_group', None)", "analyze_ownership.py", "FSDP2 groups"),
        ("class P(GraphPass):\n    def run(self, ctx):\n        let_wrappers_through({int})", "p.py", "dispatch rule"),
        ("class P(GraphPass):\n    pass\ndef f():\n    register_dtensor_handlers({})", "p.py", "dispatch rule"),
        ("def f():\n    register_dtensor_handlers({})", "ops.py", "dispatch rule"),
        ("register_dtensor_handlers({})", "runtime.py", "dispatch rule"),
    ],
)
def test_scan_catches_raw_spelling(snippet, name, question):
    found = scan_source(textwrap.dedent(snippet), name)
    assert found and all(f": {question}: " in f for f in found), found
    assert found[0].startswith(f"{name}:"), found  # file:line of each violation


@pytest.mark.parametrize(
    "snippet, name",
    [
        ("y = t._local_tensor", "tensor_utils.py"),
        ("env = detect_fake_mode(v)", "tensor_utils.py"),
        ("ns = target.namespace", "fx_utils.py"),
        ("ns = op_name(node.target).namespace", "analysis.py"),
        ("register_dtensor_handlers({})", "ops.py"),  # at an ops module's top level: where the ops are defined
        ('"""fake_mode and _local_tensor in a docstring."""\n# t._local_tensor in a comment', "writer.py"),
        ("def offload():\n    let_wrappers_through({int})", "install.py"),
    ],
)
def test_scan_allows_the_toolkit(snippet, name):
    assert scan_source(snippet, name) == []


# ------------------------------------------------------------------ the answers themselves


def test_op_name_is_one_answer_for_every_target():
    import operator

    from graphpass.fx_utils import op_library, op_name, schema_position

    add = torch.ops.aten.add.Tensor
    assert tuple(op_name(add)) == ("aten", "add", "Tensor") and str(op_name(add)) == str(add)
    assert tuple(op_name(torch.ops.aten.add)) == ("aten", "add", "")
    assert tuple(op_name(torch.ops.graphpass.capture.default)) == ("graphpass", "capture", "default")
    assert tuple(op_name(torch.softmax)) == (None, "softmax", "")
    assert tuple(op_name(operator.iadd)) == (None, "iadd", "")
    assert tuple(op_name("add_")) == (None, "add_", "")  # a call_method target
    from torch._higher_order_ops.wrap import tag_activation_checkpoint

    assert tuple(op_name(tag_activation_checkpoint)) == ("higher_order", "tag_activation_checkpoint", "")
    assert op_library(add) == "aten" and op_library(torch.softmax) is None and op_library("add_") is None
    assert schema_position(torch.ops.aten.sum.dim_IntList, "dim") == 1
    assert schema_position(torch.ops.aten.sum.dim_IntList, "dtype") == -1  # keyword-only
    assert schema_position(torch.ops.aten.sum.dim_IntList, "nope") is None
    assert schema_position(torch.sum, "dim") is None


def test_find_calls_uses_the_graph_index():
    from graphpass.fx_utils import find_calls

    def f(x):
        return torch.relu(x) + torch.relu(x * 2)

    gm = torch.fx.symbolic_trace(f)
    relus = find_calls(gm.graph, torch.relu)
    assert [n.name for n in relus] == [n.name for n in gm.graph.nodes if n.target is torch.relu] and len(relus) == 2
    assert find_calls(gm.graph, torch.sigmoid) == []


def test_fake_mode_comes_from_detect_fake_mode_and_the_values_own():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from graphpass.tensor_utils import fake_mode_of, shape_env_of

    mode = FakeTensorMode(shape_env=ShapeEnv())
    other = FakeTensorMode()
    x = mode.from_tensor(torch.ones(2))
    assert fake_mode_of(x) is mode and fake_mode_of([None, [x]]) is mode and shape_env_of(x) is mode.shape_env
    assert fake_mode_of(torch.ones(2)) is None and shape_env_of(torch.ones(2)) is None and fake_mode_of(None) is None
    # inside another compile (a tracing context with its own fake mode) a value is still its own mode's
    with torch._guards.tracing(torch._guards.TracingContext(other)):
        assert fake_mode_of(x) is mode and shape_env_of(x) is mode.shape_env


def test_dtensor_questions_on_plain_tensors():
    from graphpass.tensor_utils import (
        dtensor_mesh,
        dtensor_placements,
        is_dtensor,
        is_wrapper_subclass,
        local_tensor,
        subclass_fields,
    )

    t = torch.ones(2)
    assert not is_dtensor(t) and local_tensor(t) is t and dtensor_mesh(t) is None and dtensor_placements(t) == ()
    assert not is_wrapper_subclass(t) and subclass_fields(t) == [] and subclass_fields(3) == []


def test_dispatch_rules_are_registered_when_the_ops_are_defined():
    """A fresh interpreter: importing graphpass (which defines every graphpass op) registers the
    DTensor rule of each op that takes tensors, before any pass or compile has run."""
    pytest.importorskip("torch.distributed.tensor")
    code = textwrap.dedent("""
        import graphpass  # noqa: F401
        from torch.distributed.tensor import DTensor
        table = DTensor._op_dispatcher._custom_op_handlers
        print(sorted(str(op) for op in table if str(op).startswith("graphpass.")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    for op in ("trap_enter", "trap_exit", "capture", "output_key", "load_start", "load_wait", "evict"):
        assert f"'graphpass.{op}.default'" in out, out


if __name__ == "__main__":  # python tests/core/test_toolkit_rules.py [ROOT]: the list, and how many
    found = violations(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print("\n".join(found))
    counts: dict[str, int] = {}
    for f in found:
        counts[f.split(": ")[1]] = counts.get(f.split(": ")[1], 0) + 1
    print(f"{len(found)} violations", counts)
