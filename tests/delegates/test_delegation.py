"""then=: every kind of delegate, graph breaks, dynamic shapes, training."""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

import graphpass
from graphpass.backends import Delegate
from graphpass.models.corpus import build

from helpers import CountingBackend, fresh_inputs, register_temp_backend


@pytest.mark.parametrize("then", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", ["mlp_stack", "tiny_transformer", "moe", "quant_linear", "custom_op", "graph_break"])
def test_named_delegates_match_eager_exactly(name, then):
    model, inputs = build(name)
    compiled = torch.compile(model, backend="graphpass", options={"then": then})
    compiled(*inputs)
    x = fresh_inputs(inputs)
    with torch.no_grad():
        assert torch.equal(compiled(*x), model(*x))  # fp32, the passes only add markers: exact


def test_default_delegate_is_inductor(monkeypatch):
    seen = []
    from graphpass.backends import InductorDelegate

    orig = InductorDelegate.compile

    def spy(self, gm, ex):
        seen.append(self)
        return orig(self, gm, ex)

    monkeypatch.setattr(InductorDelegate, "compile", spy)
    gp = graphpass.backend()
    assert gp.config.then == "inductor"
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=gp)
    x = fresh_inputs(inputs)
    torch.testing.assert_close(compiled(*x), model(*x), rtol=1e-4, atol=1e-5)  # inductor reorders float math
    assert len(seen) == 1


def test_registered_backend_by_name(monkeypatch):
    counter = register_temp_backend(monkeypatch, "my_registered_backend", CountingBackend())
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "my_registered_backend"})
    x = fresh_inputs(inputs)
    assert torch.equal(compiled(*x), model(*x))
    assert counter.calls == 1
    targets = [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.graphpass.trap_enter.default in targets


def test_callable_delegate_and_aot_autograd_object():
    fw_graphs = []

    def fw(gm, ex):
        fw_graphs.append(gm)
        return gm

    model, inputs = build("tiny_transformer")
    compiled = torch.compile(model, backend=graphpass.backend(then=aot_autograd(fw_compiler=fw)))
    x = fresh_inputs(inputs)
    with torch.no_grad():
        assert torch.equal(compiled(*x), model(*x))
    aten_targets = {n.target for g in fw_graphs for n in g.graph.nodes if n.op == "call_function"}
    assert torch.ops.graphpass.trap_enter.default in aten_targets  # survived AOTAutograd
    assert torch.ops.graphpass.trap_exit.default in aten_targets


def test_chaining_graphpass_into_graphpass(counting):
    inner = graphpass.backend(then=counting)
    outer = graphpass.backend(then=inner, traps=["layers.0-1"])
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=outer)
    x = fresh_inputs(inputs)
    assert torch.equal(compiled(*x), model(*x))
    assert counting.calls == 1
    gm = counting.graphs[0]
    enters = [n.args[0] for n in gm.graph.nodes if n.target is torch.ops.graphpass.trap_enter.default]
    assert enters == ["layers.0", "layers.1"]  # the inner instance did not add boundaries twice
    assert set(inner.graphs[0].analysis.traps) == {"layers.0", "layers.1"}  # it saw the outer traps


def test_cudagraphs_delegate_resolves_and_runs_without_cuda():
    # Without a GPU Dynamo's cudagraphs backend falls back to running the graph as is.
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "cudagraphs"})
    x = fresh_inputs(inputs)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), model(*x), rtol=0, atol=0)


def test_graph_breaks_compile_every_subgraph(counting):
    model, inputs = build("graph_break")
    gp = graphpass.backend(then=counting)
    compiled = torch.compile(model, backend=gp)
    x = fresh_inputs(inputs)
    assert torch.equal(compiled(*x), model(*x))
    assert counting.calls >= 2
    labels = [set(g.analysis.traps) for g in gp.graphs]
    assert {"layers.1"} in labels  # layer 1 is split across two graphs, each knows it is layer 1


def test_dynamic_shapes():
    model, _ = build("tiny_transformer")
    counter = CountingBackend()
    compiled = torch.compile(model, backend=graphpass.backend(then=counter), dynamic=True)
    for seq in (3, 7, 12):
        ids = torch.randint(0, 64, (2, seq))
        with torch.no_grad():
            assert torch.equal(compiled(ids), model(ids))
    assert counter.calls == 1  # one symbolic graph for every length


@pytest.mark.parametrize("then", ["aot_eager", "eager"])
@pytest.mark.parametrize("name", ["tiny_transformer", "moe", "custom_op", "graph_break"])
def test_training_gradients_equal_eager(name, then):
    model, inputs = build(name)
    x = fresh_inputs(inputs)
    ref_model, _ = build(name)
    ref_model.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="graphpass", options={"then": then})
    compiled(*x).square().mean().backward()
    ref_model(*x).square().mean().backward()
    for (n, p), (_, r) in zip(model.named_parameters(), ref_model.named_parameters()):
        if r.grad is None:
            assert p.grad is None, n
            continue
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_mode_is_passed_to_inductor(monkeypatch):
    from graphpass.backends import InductorDelegate, resolve_delegate

    d = resolve_delegate("inductor", mode="max-autotune-no-cudagraphs")
    assert isinstance(d, InductorDelegate) and d.mode == "max-autotune-no-cudagraphs"
    captured = {}

    def fake_compile_fx(gm, ex, config_patches=None):
        captured.update(config_patches or {})
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    model, inputs = build("mlp_stack")
    torch.compile(model, backend="graphpass", mode="max-autotune-no-cudagraphs")(*inputs)
    assert captured.get("max_autotune") is True


# ------------------------------------------------------------------ a delegate Dynamo would fall back from


def untraceable(gm, example_inputs):
    """A delegate failing as AOTAutograd does on a data-dependent op (``.item()`` under fake tensors):
    Dynamo takes this exception from a backend as "run the frame eagerly", not as an error."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)


def test_a_fallback_that_would_drop_offload_loads_is_refused_before_anything_runs():
    model, inputs = build("mlp_stack")
    model.eval().requires_grad_(False)
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu"))
    compiled = torch.compile(model, backend=graphpass.backend(then=untraceable))
    with torch.no_grad(), pytest.raises(graphpass.DelegateError) as info:
        compiled(*fresh_inputs(inputs))
    msg = str(info.value)
    assert "delegate 'untraceable' could not trace graph 0" in msg
    assert "load" in msg and "evict" in msg and "DataDependentOutputException" in msg and "then='eager'" in msg
    assert graphpass.memory_stats(compiled).bytes_loaded == 0  # refused at compile: no load ran


def test_a_fallback_that_would_drop_captures_is_refused(tmp_path):
    model, inputs = build("tiny_transformer")
    compiled = torch.compile(model, backend=graphpass.backend(then=untraceable))
    capture = graphpass.ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path)
    capture.enable()
    with pytest.raises(graphpass.DelegateError, match=r"capture.*DataDependent"), capture.step(is_prefill=True):
        compiled(*fresh_inputs(inputs))
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing half-written


def test_a_fallback_of_a_graph_with_only_trap_boundaries_is_left_to_dynamo_and_logged(caplog):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=graphpass.backend(then=untraceable))
    x = fresh_inputs(inputs)
    with caplog.at_level("WARNING", logger="graphpass.delegation"), torch.no_grad():
        got = compiled(*x)
        assert torch.equal(got, model(*x))  # Dynamo ran the frame eagerly: nothing numerical was lost
    assert any(
        "delegate 'untraceable' could not trace graph 0" in r.getMessage() and "trap" in r.getMessage()
        for r in caplog.records
    )


# ------------------------------------------------------------------ a delegate that fails (issue 22 item 17)


def exploding_backend(gm, example_inputs):
    raise RuntimeError("the compiler crashed")


def forgetful_backend(gm, example_inputs):
    return None  # forgot `return gm.forward`


@pytest.mark.parametrize(
    "then, match",
    [
        (
            exploding_backend,
            r"delegate 'exploding_backend' failed to compile graph 0: RuntimeError: the compiler crashed",
        ),
        (forgetful_backend, r"delegate 'forgetful_backend' returned None instead of a callable when compiling graph 0"),
    ],
)
def test_a_delegate_that_raises_or_returns_none_is_a_delegate_error_naming_it(then, match):
    """Before: Dynamo's generic BackendCompilerFailed naming graphpass, not the delegate (and for
    None, an error about calling None)."""
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=graphpass.backend(then=then))
    with torch.no_grad(), pytest.raises(graphpass.DelegateError, match=match):
        compiled(*fresh_inputs(inputs))


class _PiecesReturningNone(Delegate):
    name = "pieces_returning_none"
    host_code = False  # the graph is split at graphpass's nodes, each piece compiled on its first call

    def compile(self, gm, example_inputs):
        return None


def test_a_delegate_without_host_code_returning_none_for_a_piece_is_a_delegate_error():
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=graphpass.backend(then=_PiecesReturningNone()))
    with (
        torch.no_grad(),
        pytest.raises(
            graphpass.DelegateError,
            match=r"delegate 'pieces_returning_none' returned None "
            r"instead of a callable when compiling a piece",
        ),
    ):
        compiled(*fresh_inputs(inputs))
