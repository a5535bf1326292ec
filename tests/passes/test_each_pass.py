"""Each pass of ``graphpass.pipeline.PIPELINE`` alone (tests/passes_harness.py): on a graph Dynamo
made from a small model, the pass runs after the passes it requires; the test checks what it
inserted or removed, the graph's code before and after, and that the transformed graph computes
what the untouched one does on fresh random inputs (exactly: no pass changes the math).

``test_every_pipeline_pass_has_a_test_here`` keeps this file in step with the pipeline.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.models.corpus import build
from graphpass.pipeline import PIPELINE

from passes_harness import dynamo_graph, required_passes, pipeline_pass, run_one_pass

LAYERS = ["layers.0", "layers.1", "layers.2"]  # the corpus MLP stack's repeated blocks


@pytest.fixture
def mlp_stack_graph():
    model, inputs = build("mlp_stack")
    return dynamo_graph(model, *inputs)


class Positions(nn.Module):
    """Symbolic-size factories (``arange``, ``ones``) next to a weight, for the static-shape passes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) * 2 + torch.arange(x.shape[0]).unsqueeze(-1) + torch.ones(x.shape[0], 1)


STATIC = {"static_shapes": {"dims": {"x": 0}, "buckets": [8, 16]}}


@pytest.fixture
def positions_graph():
    return dynamo_graph(Positions(), torch.randn(6, 3), dynamic=True)


def test_every_pipeline_pass_has_a_test_here():
    names = [name for name in dir(sys.modules[__name__]) if name.startswith("test_")]
    untested = [p.name for p in PIPELINE if not any(n.startswith(f"test_{p.name}_") for n in names)]
    assert not untested, f"passes without a test here: {untested}"


def test_required_passes_follow_requires_transitively_in_pipeline_order():
    names = [p.name for p in required_passes(pipeline_pass("insert_offload_schedule"))]
    assert names == ["analyze_ownership", "assign_traps", "insert_trap_boundaries"]
    assert required_passes(pipeline_pass("analyze_ownership")) == []


def test_analyze_ownership_fills_the_tensor_table_and_inserts_nothing(mlp_stack_graph):
    run = run_one_pass(mlp_stack_graph, "analyze_ownership")
    run.check_unchanged()
    fqns = {t.fqn: t.kind for t in run.ctx.analysis.tensors.values()}
    assert fqns["x"] == "input"
    assert fqns["layers.1.fc2.weight"] == "parameter" and fqns["head.bias"] == "parameter"
    assert len(fqns) == 1 + 2 + 3 * 4 + 2  # x, proj_in, three blocks of two Linears, head
    run.check_outputs()


def test_assign_traps_fills_the_traps_and_inserts_nothing(mlp_stack_graph):
    run = run_one_pass(mlp_stack_graph, "assign_traps")
    run.check_unchanged()
    analysis = run.ctx.analysis
    assert list(analysis.traps) == LAYERS and analysis.trap_container == "layers"
    assert set(analysis.node_trap.values()) == set(LAYERS)
    run.check_outputs()


def test_insert_trap_boundaries_inserts_one_enter_and_one_exit_per_trap(mlp_stack_graph):
    run = run_one_pass(mlp_stack_graph, "insert_trap_boundaries")
    assert run.changed
    assert run.inserted == {"trap_enter": 3, "trap_exit": 3} and not run.removed
    assert "trap_enter" not in run.before
    for label in LAYERS:  # each trap's enter comes before its exit, in layer order
        assert run.after.index(f"trap_enter.default('{label}'") < run.after.index(f"trap_exit.default('{label}'")
    assert run.after.index("trap_exit.default('layers.0'") < run.after.index("trap_enter.default('layers.1'")
    run.check_outputs()


def test_insert_trap_boundaries_leaves_a_graph_without_traps_alone():
    graph = dynamo_graph(nn.Linear(4, 4), torch.randn(2, 4))
    run = run_one_pass(graph, "insert_trap_boundaries")
    assert not run.ctx.analysis.traps
    assert not run.changed and run.after == run.before


def test_insert_offload_schedule_inserts_a_load_and_an_eviction_per_streamed_trap():
    model, inputs = build("mlp_stack")
    plain, _ = build("mlp_stack")  # the same weights (same seed), not offloaded: the reference
    graphpass.offload(model, graphpass.OffloadConfig(include_patterns=["layers.*"], device="cpu", storage="cpu"))
    run = run_one_pass(dynamo_graph(model, *inputs), "insert_offload_schedule")
    assert run.changed
    assert run.inserted == {"load_start": 3, "load_wait": 3, "evict": 3}
    assert run.removed == {"offload_guard": 6}  # the offloaded Linears' pre-hook guards
    assert "offload_guard" in run.before and "offload_guard" not in run.after
    groups = run.ctx.analysis.offload.groups
    assert [g.label for g in groups] == LAYERS
    assert groups[1].fqns == ["layers.1.fc1.weight", "layers.1.fc1.bias", "layers.1.fc2.weight", "layers.1.fc2.bias"]
    # prefetch_distance=1: layers.1's load starts before layers.0 is entered, layers.2's after layers.0's exit
    after = run.after
    assert after.index("load_start.default([l_self_modules_layers_modules_1") < after.index(
        "trap_enter.default('layers.0'"
    )
    assert after.index("trap_exit.default('layers.0'") < after.index(
        "load_start.default([l_self_modules_layers_modules_2"
    )
    # the graph's data inputs mean the same: the offloaded graph equals the plain model in eager
    run.check_outputs(expected=lambda inputs: plain(*run.data_inputs(inputs)))


def test_insert_capture_nodes_inserts_a_capture_per_selected_output_and_removes_the_markers(tmp_path):
    model, inputs = build("mlp_stack")
    capture = graphpass.ModelCapture(model, modules=["layers.0", "head"], capture_dir=tmp_path)  # alive while traced
    run = run_one_pass(dynamo_graph(model, *inputs), "insert_capture_nodes")
    assert len(run.ctx.captures) == 1 and capture is not None
    assert run.changed
    assert run.inserted == {"capture": 2}
    assert run.removed["output_key"] > 0 and "output_key" not in run.after  # the forward hook's markers
    captures = [n for n in run.gm.graph.nodes if n.op == "call_function" and "capture" in str(n.target)]
    assert [c.args[0] for c in captures] == ["layers.0", "head"]
    assert captures[1].args[1] is next(n for n in run.gm.graph.nodes if n.op == "output").args[0][0]
    run.check_outputs()


def test_insert_capture_nodes_does_not_run_without_a_capture(mlp_stack_graph):
    run = run_one_pass(mlp_stack_graph, "insert_capture_nodes")
    assert not run.changed and run.after == run.before


def test_plan_static_shapes_fills_the_bucket_plan_and_inserts_nothing(positions_graph):
    run = run_one_pass(positions_graph, "plan_static_shapes", **STATIC)
    run.check_unchanged()
    plan = run.ctx.analysis.bucket_plan
    assert plan.active and not plan.refused
    ((index, ((dim, sym),)),) = plan.pad.items()  # x, padded along dim 0 by the size symbol
    assert dim == 0 and run.ctx.gm.graph.find_nodes(op="placeholder")[index].name == "l_x_"
    assert run.ctx.static_bounds == {sym: 16}  # the largest bucket, for slice_static_buffers
    run.check_outputs()


def test_plan_static_shapes_refuses_a_padded_dim_a_softmax_mixes():
    class Mixes(nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=0)

    run = run_one_pass(
        dynamo_graph(Mixes(), torch.randn(6, 3), dynamic=True),
        "plan_static_shapes",
        static_shapes={"dims": {"x": 0}, "buckets": [8]},
    )
    run.check_unchanged()
    assert not run.ctx.analysis.bucket_plan.active and "softmax" in run.ctx.analysis.bucket_plan.refused[0]


def test_slice_static_buffers_replaces_symbolic_factories_by_slices_of_max_size_buffers(positions_graph):
    run = run_one_pass(positions_graph, "slice_static_buffers", **STATIC)
    assert run.changed
    assert run.inserted == {"get_attr": 2}
    assert "torch.arange(" in run.before and "torch.ones(" in run.before
    assert "torch.arange(" not in run.after and "torch.ones(" not in run.after
    assert run.after.count("torch.narrow(_graphpass_static_") == 2
    assert [tuple(b.shape) for n, b in run.gm.named_buffers() if n.startswith("_graphpass_static_")] == [(16,), (16, 1)]
    run.check_outputs()
    weights = positions_graph.example_inputs[:2]
    for size in (1, 11, 16):  # other sizes up to the largest bucket: the same values as fresh factories
        run.check_outputs(inputs=[*weights, size, torch.randn(size, 3)])


def test_the_harness_catches_a_graph_that_computes_something_else(mlp_stack_graph):
    """check_outputs can fail: a graph whose gelu became a relu no longer matches the original."""
    run = run_one_pass(mlp_stack_graph, "insert_trap_boundaries")
    for node in run.gm.graph.nodes:
        if node.op == "call_function" and node.target is torch._C._nn.gelu:
            node.target = torch.relu
    run.gm.recompile()
    with pytest.raises(AssertionError, match="insert_trap_boundaries, output 0"):
        run.check_outputs()
