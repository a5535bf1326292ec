"""graphpass.fx_utils: the one place passes ask graph questions (views, writes, frames, sizes, blocks)."""

from __future__ import annotations

import operator

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import graphpass
from graphpass import fx_utils
from graphpass.fx_utils import (
    AliasIndex,
    find_write,
    inner_tensor_fields,
    is_graphpass_node,
    is_view,
    mentions_symbol,
    node_order,
    repeated_blocks,
    returns_alias,
    size_expr,
    source_frame,
    views_of,
    writes_into,
)


def _graph(build):
    """A Dynamo-style graph: placeholders x, y and whatever ``build(g, x, y)`` adds; returns (graph, x, nodes)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    made = build(g, x, y)
    g.output(made[-1])
    return g, x, made


# Every write form the issue lists, as Dynamo records it in a graph (methods, functions, operators).
WRITES = {
    "method add_": lambda g, x, y: [g.call_method("add_", (x, 1))],
    "method copy_": lambda g, x, y: [g.call_method("copy_", (x, y))],
    "method index_put_": lambda g, x, y: [g.call_method("index_put_", (x, (y,), y))],
    "method __iadd__": lambda g, x, y: [g.call_method("__iadd__", (x, y))],
    "function torch.relu_": lambda g, x, y: [g.call_function(torch.relu_, (x,))],
    "out=": lambda g, x, y: [g.call_function(torch.add, (y, 1), {"out": x})],
    "out= tuple": lambda g, x, y: [g.call_function(torch.max, (y, 0), {"out": (x, y)})],
    "operator.iadd (x += 1)": lambda g, x, y: [g.call_function(operator.iadd, (x, 1))],
    "operator.imul": lambda g, x, y: [g.call_function(operator.imul, (x, 2))],
    "setitem (x[i] = v)": lambda g, x, y: [g.call_function(operator.setitem, (x, 0, y))],
    "inplace=True": lambda g, x, y: [g.call_function(F.relu, (x,), {"inplace": True})],
    "aten add_": lambda g, x, y: [g.call_function(torch.ops.aten.add_.Tensor, (x, y))],
    "aten copy_": lambda g, x, y: [g.call_function(torch.ops.aten.copy_.default, (x, y))],
    "aten index_put_": lambda g, x, y: [g.call_function(torch.ops.aten.index_put_.default, (x, [y], y))],
}

READS = {
    "x + 1": lambda g, x, y: [g.call_function(operator.add, (x, 1))],
    "method add": lambda g, x, y: [g.call_method("add", (x, 1))],
    "torch.relu": lambda g, x, y: [g.call_function(torch.relu, (x,))],
    "F.relu inplace=False": lambda g, x, y: [g.call_function(F.relu, (x,), {"inplace": False})],
    "y.copy_(x) reads x": lambda g, x, y: [g.call_method("copy_", (y, x))],
    "aten index_put_ with x as values": lambda g, x, y: [
        g.call_function(torch.ops.aten.index_put_.default, (y, [y], x))
    ],
    "aten add": lambda g, x, y: [g.call_function(torch.ops.aten.add.Tensor, (x, y))],
    "method __init__ is no write": lambda g, x, y: [g.call_method("__init__", (x,))],
}


@pytest.mark.parametrize("form", list(WRITES))
def test_every_write_form_is_a_write(form):
    g, x, (node,) = _graph(WRITES[form])
    assert writes_into(node, x), form
    assert find_write(x) == (node, x)


@pytest.mark.parametrize("form", list(READS))
def test_reads_are_not_writes(form):
    g, x, (node,) = _graph(READS[form])
    assert not writes_into(node, x), form
    assert find_write(x) is None


def test_a_mutating_custom_op_writes_only_what_its_schema_says():
    @torch.library.custom_op("graphpass_test::scale_into", mutates_args=("dst",))
    def scale_into(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src * 2)

    op = torch.ops.graphpass_test.scale_into.default
    g, x, (node,) = _graph(lambda g, x, y: [g.call_function(op, (x, y))])
    y = next(n for n in g.nodes if n.name == "y")
    assert writes_into(node, x)
    assert not writes_into(node, y)


def test_a_custom_op_called_by_its_packet_writes_the_argument_its_schema_marks():
    """``torch.ops.ns.op(handle, data)`` (the packet, as vLLM calls its CPU all-reduce): the written tensor
    is not the first argument."""
    lib = torch.library.Library("graphpass_test_packet", "FRAGMENT")
    lib.define("reduce_into(int handle, Tensor(a!) data, Tensor other) -> ()")
    packet = torch.ops.graphpass_test_packet.reduce_into
    g, x, (node,) = _graph(lambda g, x, y: [g.call_function(packet, (0, x, y))])
    y = next(n for n in g.nodes if n.name == "y")
    assert writes_into(node, x)
    assert not writes_into(node, y)
    assert find_write(x) == (node, x) and find_write(y) is None


@pytest.mark.parametrize("view", ["view", "t", "transpose", "reshape", "flatten", "unsqueeze", "narrow", "detach"])
def test_writes_through_views_are_found(view):
    args = {"view": (-1,), "transpose": (0, 1), "reshape": (-1,), "narrow": (0, 0, 1), "unsqueeze": (0,)}.get(view, ())

    def build(g, x, y):
        v = g.call_method(view, (x, *args))
        w = g.call_method("add_", (v, 1))
        return [v, w]

    g, x, (v, w) = _graph(build)
    assert is_view(v)
    assert views_of(x) == [x, v]
    assert find_write(x) == (w, v)


def test_split_items_and_getitem_are_views():
    def build(g, x, y):
        parts = g.call_method("split", (x, 2))
        first = g.call_function(operator.getitem, (parts, 0))
        w = g.call_function(operator.setitem, (first, 0, 1.0))
        return [parts, first, w]

    g, x, (parts, first, w) = _graph(build)
    assert find_write(x) == (w, first)


def test_alias_index_finds_aliases_by_storage():
    """An aten graph: ``aten.alias`` is a view by schema; storage sharing catches the rest."""

    def f(x):
        a = torch.ops.aten.alias.default(x)
        a.add_(1)
        return x * 2

    gm = make_fx(f)(torch.zeros(4))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    index = AliasIndex(gm.graph)
    assert len(index.aliases(x)) >= 2
    writer, alias = find_write(x, index)
    assert writer.target is torch.ops.aten.add_.Tensor and alias is not x


def test_returns_alias_for_views_and_inplace_aten_ops():
    assert returns_alias(torch.ops.aten.view.default)
    assert returns_alias(torch.ops.aten.add_.Tensor)
    assert returns_alias(torch.ops.aten.add.out)
    assert not returns_alias(torch.ops.aten.add.Tensor)
    assert not returns_alias(torch.ops.aten.cat.default)


def test_source_frame_is_the_users_line_not_torch_or_graphpass():
    seen = {}

    def backend(gm, example_inputs):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        seen["frame"] = source_frame(node)
        return gm.forward

    def user_function(x):
        return torch.sin(x) + 1  # the line the frame must name

    torch.compile(user_function, backend=backend)(torch.randn(3))
    frame = seen["frame"]
    assert frame.file == "test_fx_utils.py"
    assert "torch.sin(x) + 1" in frame.code
    assert str(frame) == f"test_fx_utils.py:{frame.line}"
    g = torch.fx.Graph()
    bare = g.placeholder("x")
    assert source_frame(bare) is None


def test_size_expressions_and_symbols():
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    assert size_expr(3) == 3
    assert size_expr(2 * s0 + 1) == 2 * s0 + 1
    assert mentions_symbol(s0 + 1, frozenset({"s0"}))
    assert not mentions_symbol(4, frozenset({"s0"}))

    seen = {}

    def backend(gm, example_inputs):
        x = next(
            n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(fx_utils.example_of(n), torch.Tensor)
        )
        seen["expr"] = size_expr(fx_utils.example_of(x).shape[0])
        return gm.forward

    x = torch.randn(5, 2)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(lambda t: t * 2, backend=backend)(x)
    assert isinstance(seen["expr"], sympy.Symbol)
    assert mentions_symbol(seen["expr"], frozenset({str(seen["expr"])}))


def test_repeated_blocks_pick_the_container_with_the_most_bytes():
    paths = [
        "embed",
        "layers.0",
        "layers.0.mlp",
        "layers.1",
        "layers.1.mlp",
        "layers.0.experts.0",
        "layers.0.experts.1",
        "heads.0",
        "heads.1",
        "heads.2",
    ]
    weights = [
        (100, ["layers.0.mlp"]),
        (100, ["layers.1.mlp"]),
        (30, ["layers.0.experts.0"]),
        (5, ["heads.2"]),
        (50, ["embed"]),
    ]
    assert repeated_blocks(paths, weights) == ("layers", ["layers.0", "layers.1"])
    # no bytes anywhere: more children win, then the outer container
    assert repeated_blocks(paths, []) == ("heads", ["heads.0", "heads.1", "heads.2"])
    assert repeated_blocks(["embed", "norm"], weights) == (None, [])


def test_trap_assignment_and_the_offload_planner_agree_on_the_repeated_blocks():
    """The default traps and the offload planner's units are the same modules (one rule)."""
    from graphpass.models.corpus import build

    model, inputs = build("tiny_transformer", 0)
    report = graphpass.explain(model, *inputs)
    labels = [t.label for t in report.trap_rows()]
    torch._dynamo.reset()  # explain compiled the class: offload() refuses a model Dynamo already compiled
    plan = graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu")).plan
    assert [u.name for u in plan.units] == labels


def test_inner_tensor_fields_are_public_tensor_attributes():
    w = nn.Parameter(torch.randn(2, 2))
    w.scale = torch.ones(2)
    w._cache = torch.zeros(2)  # private bookkeeping: not a weight
    w.flag = True
    assert [name for name, _ in inner_tensor_fields(w)] == ["scale"]
    assert inner_tensor_fields(torch.randn(2)) == []


def test_node_order_and_graphpass_nodes():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    enter = g.call_function(torch.ops.graphpass.trap_enter.default, ("t", [x]))
    y = g.call_function(torch.relu, (x,))
    g.output(y)
    order = node_order(g)
    assert order[x] < order[enter] < order[y]
    assert is_graphpass_node(enter) and not is_graphpass_node(y)


def test_torch_relative_names_a_file_inside_torch_and_nothing_outside():
    import os

    from graphpass.fx_utils import torch_relative

    assert torch_relative(torch._dynamo.utils.__file__) == os.path.join("_dynamo", "utils.py")
    assert torch_relative(__file__) is None
    assert torch_relative(os.path.dirname(torch.__file__) + "-other/x.py") is None  # a sibling folder's name prefix
