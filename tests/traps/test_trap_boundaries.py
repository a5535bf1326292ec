"""Trap boundaries: default detection, patterns, manual traps, survival through AOT and inductor."""

import threading

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.models.corpus import build

from helpers import fresh_inputs

ENTER = torch.ops.graphpass.trap_enter.default
EXIT = torch.ops.graphpass.trap_exit.default


def compile_eager(model, inputs, **options):
    gp = graphpass.backend(then="eager", **options)
    compiled = torch.compile(model, backend=gp)
    with torch.no_grad():
        compiled(*inputs)
    return gp, compiled


def boundary_labels(gm):
    from graphpass.ops import is_boundary, is_enter

    return [("enter" if is_enter(n) else "exit", n.args[0]) for n in gm.graph.nodes if is_boundary(n)]


def test_default_traps_are_the_repeated_blocks():
    gp, _ = compile_eager(*build("tiny_transformer"))
    g = gp.graphs[0]
    assert g.analysis.trap_container == "layers"
    assert list(g.analysis.traps) == ["layers.0", "layers.1"]
    assert boundary_labels(g.gm) == [
        ("enter", "layers.0"),
        ("exit", "layers.0"),
        ("enter", "layers.1"),
        ("exit", "layers.1"),
    ]


def test_default_prefers_the_container_with_most_parameters():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))
            self.big = nn.ModuleList(nn.Linear(4, 64) if i % 2 == 0 else nn.Linear(64, 4) for i in range(2))

        def forward(self, x):
            for m in self.small:
                x = m(x)
            for m in self.big:
                x = m(x)
            return x

    gp, _ = compile_eager(Two(), (torch.randn(2, 4),))
    assert list(gp.graphs[0].analysis.traps) == ["big.0", "big.1"]


def test_moe_traps_are_layers_not_experts():
    gp, _ = compile_eager(*build("moe"))
    assert list(gp.graphs[0].analysis.traps) == ["layers.0", "layers.1"]


def test_sequential_root_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    gp, _ = compile_eager(model, (torch.randn(2, 4),))
    assert list(gp.graphs[0].analysis.traps) == ["0", "1", "2"]


def test_trap_patterns_override_default():
    gp, _ = compile_eager(*build("tiny_transformer"), traps=[".*attn", "lm_head"])
    a = gp.graphs[0].analysis
    assert list(a.traps) == ["layers.0.attn", "layers.1.attn", "lm_head"]
    assert a.tensor_for("layers.0.attn.qkv.weight").traps == ["layers.0.attn"]
    assert a.tensor_for("layers.0.mlp.down.weight").traps == []
    assert a.tensor_for("embed.weight").traps == ["lm_head"]  # tied: read by lm_head's op


def test_range_pattern_and_outermost_match():
    gp, _ = compile_eager(*build("mlp_stack"), traps=["layers.1-2", "layers.1.fc1"])
    assert list(gp.graphs[0].analysis.traps) == ["layers.1", "layers.2"]


def test_empty_trap_list_makes_no_traps():
    gp, _ = compile_eager(*build("mlp_stack"), traps=[])
    assert gp.graphs[0].analysis.traps == {} and boundary_labels(gp.graphs[0].gm) == []


def test_boundaries_off_keeps_the_analysis():
    gp, _ = compile_eager(*build("mlp_stack"), boundaries=False)
    assert len(gp.graphs[0].analysis.traps) == 3 and boundary_labels(gp.graphs[0].gm) == []


class Manual(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.decoder = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        with graphpass.trap_block("encoder_stage"):
            x = self.encoder(x)
            x = self.decoder(x)
        return self.head(x)


def test_trap_block_marks_a_manual_trap():
    model = Manual()
    x = torch.randn(3, 8)
    gp, compiled = compile_eager(model, (x,), traps=["head"])
    a = gp.graphs[0].analysis
    trap = a.traps["encoder_stage"]
    assert trap.manual
    owned = sorted(a.tensors[t].fqn for t in trap.tensors)
    assert owned == [
        "decoder.bias",
        "decoder.weight",
        "encoder.0.bias",
        "encoder.0.weight",
        "encoder.2.bias",
        "encoder.2.weight",
    ]
    assert list(a.traps) == ["encoder_stage", "head"]
    with graphpass.trace_traps() as events, torch.no_grad():
        assert torch.equal(compiled(x), model(x))
    assert events[:2] == [("enter", "encoder_stage"), ("exit", "encoder_stage")]


def test_trap_block_runs_eagerly_too():
    model = Manual()
    with graphpass.trace_traps() as events:
        model(torch.randn(2, 8))
    assert events == [("enter", "encoder_stage"), ("exit", "encoder_stage")]


def test_offload_block_is_a_deprecated_alias_of_trap_block():
    with pytest.warns(DeprecationWarning, match="use graphpass.trap_block"):
        block = graphpass.offload_block("encoder")
    assert isinstance(block, graphpass.trap_block) and block.name == "encoder"
    with graphpass.trace_traps() as events, block:
        pass
    assert events == [("enter", "encoder"), ("exit", "encoder")]


def test_public_surface_is_what_users_call():
    import graphpass.capturing
    import graphpass.dynamo_backend
    import graphpass.pipeline

    assert len(graphpass.__all__) <= 25, graphpass.__all__
    for internal in (
        "PIPELINE",
        "CompiledGraph",
        "GraphpassBackend",
        "TensorRegistry",
        "OffloadState",
        "offload_block",
    ):
        assert internal not in graphpass.__all__, internal
    # internals stay importable from their modules
    assert (
        graphpass.pipeline.PIPELINE and graphpass.dynamo_backend.GraphpassBackend and graphpass.capturing.TensorRegistry
    )


def test_boundary_ops_pass_opcheck():
    for op in (ENTER, EXIT):
        torch.library.opcheck(op, ("layers.0", [torch.randn(3, requires_grad=True)]))
        torch.library.opcheck(op, ("layers.0", []))


def test_trace_traps_is_per_thread():
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=graphpass.backend(then="eager"))
    compiled(*inputs)
    results = {}

    def run(key, n):
        with graphpass.trace_traps() as events:
            for _ in range(n):
                compiled(*inputs)
        results[key] = events

    threads = [threading.Thread(target=run, args=(k, n)) for k, n in (("a", 1), ("b", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results["a"]) == 6 and len(results["b"]) == 18


@pytest.mark.inductor
def test_boundaries_execute_under_inductor_and_show_in_profiler():
    model, inputs = build("tiny_transformer")
    gp = graphpass.backend()  # default delegate: inductor
    compiled = torch.compile(model, backend=gp)
    compiled(*inputs)
    x = fresh_inputs(inputs)
    with (
        graphpass.trace_traps() as events,
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        with torch.no_grad():
            out = compiled(*x)
    torch.testing.assert_close(out, model(*x), rtol=1e-4, atol=1e-5)  # inductor reorders float math
    assert events == [("enter", "layers.0"), ("exit", "layers.0"), ("enter", "layers.1"), ("exit", "layers.1")]
    names = [e.name for e in prof.events()]
    assert "graphpass.trap/layers.0" in names and "graphpass.trap/layers.1" in names
    # and the ops are really in inductor's generated code
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(model, backend=graphpass.backend()), *x)
    assert any("graphpass.trap_enter" in c for c in codes)


def test_profiler_ranges_can_be_turned_off():
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager", profile_ranges=False))
    compiled(*inputs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(*inputs)
    assert not any(e.name.startswith("graphpass.trap/") for e in prof.events())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.compile(model, backend=graphpass.backend(then="aot_eager"))(*inputs)
    assert any(e.name == "graphpass.trap/layers.2" for e in prof.events())


class _BreakingBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.fc1(x).relu()
        torch._dynamo.graph_break()
        return self.fc2(x) + x


class _BreakingBlocks(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_BreakingBlock() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_a_graph_dynamo_shares_between_blocks_names_the_block_that_runs():
    """A break inside the block makes Dynamo trace the block's own frame and run that graph for the
    next blocks of the class. Before: their boundaries carried the traced block's label (the run
    entered blocks.0, blocks.0, blocks.1, blocks.0, blocks.1, blocks.0). Now each boundary names
    the block whose weight it was given at run time."""
    model = _BreakingBlocks()
    gp = graphpass.backend(then="eager")
    compiled = torch.compile(model, backend=gp)
    x = torch.randn(2, 8)
    with graphpass.trace_traps() as events:
        out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    traced = {label for g in gp.graphs for label in g.analysis.traps}
    assert traced != {"blocks.0", "blocks.1", "blocks.2"}  # Dynamo did share a graph between blocks
    entered = [label for kind, label in events if kind == "enter"]
    exited = [label for kind, label in events if kind == "exit"]
    assert entered == exited == ["blocks.0", "blocks.0", "blocks.1", "blocks.1", "blocks.2", "blocks.2"]
