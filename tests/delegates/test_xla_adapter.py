"""The torch_xla adapter on the main leg (no torch_xla needed): then="openxla" is split at graphpass's ops
like Neuron, so the host ops run on every call; a clear error when torch_xla is absent. The real XLA
compiler runs in tests/xla/ (make test-xla)."""

import importlib.util
import sys
import types

import pytest
import torch

import graphpass
from graphpass.backends import XlaDelegate, resolve_delegate
from graphpass.models.corpus import build

from helpers import StrictAtenBackend, fresh_inputs, register_temp_backend

no_torch_xla = pytest.mark.skipif(
    importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here"
)


@no_torch_xla
@pytest.mark.parametrize("name", ["openxla", "openxla_eval"])
def test_absent_torch_xla_says_what_to_install(name):
    with pytest.raises(graphpass.DelegateUnavailableError) as info:
        graphpass.backend(then=name)
    msg = str(info.value)
    assert "pip install torch-xla" in msg and name in msg and "PJRT_DEVICE" in msg


@no_torch_xla
def test_absent_torch_xla_through_torch_compile_options():
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "openxla"})
    with pytest.raises(graphpass.DelegateUnavailableError):
        compiled(*inputs)


@pytest.fixture
def xla_standin(monkeypatch):
    """A (fake) torch_xla module and the strict static-shape stand-in registered as "openxla" behind
    AOTAutograd, as torch registers the real one: it accepts aten ops only (torch_xla's bridge runs
    any other op only while it records the graph). Returns the stand-in."""
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setitem(sys.modules, "torch_xla", types.ModuleType("torch_xla"))
    strict = StrictAtenBackend()
    register_temp_backend(monkeypatch, "openxla", aot_autograd(fw_compiler=strict))
    return strict


def test_then_openxla_resolves_to_the_split_adapter(xla_standin):
    from torch._dynamo.backends.registry import lookup_backend

    for spec in ("openxla", lookup_backend("openxla")):  # by name, and torch's backend function itself
        delegate = resolve_delegate(spec)
        assert isinstance(delegate, XlaDelegate) and delegate.host_code is False and delegate.name == "openxla"
    assert resolve_delegate("openxla_eval").name == "openxla_eval"


@pytest.mark.parametrize("name", ["mlp_stack", "tiny_transformer"])
def test_then_openxla_gets_pieces_free_of_graphpass_ops_and_traps_run_every_call(xla_standin, name):
    model, inputs = build(name)
    compiled = torch.compile(model, backend="graphpass", options={"then": "openxla"})
    seen = []
    for seed in (1, 2, 3):
        x = fresh_inputs(inputs, seed=seed)
        with graphpass.trace_traps() as events, torch.no_grad():
            assert torch.equal(compiled(*x), model(*x))
        seen.append(list(events))
    assert seen[0] and seen[0] == seen[1] == seen[2]  # the host ops ran on every call, not only while tracing
    assert len(xla_standin.graphs) >= 2
    for gm in xla_standin.graphs:
        assert not any("graphpass" in str(n.target) for n in gm.graph.nodes)
