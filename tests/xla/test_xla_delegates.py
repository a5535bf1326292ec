"""graphpass through torch_xla's real `openxla` Dynamo backend (XLA on the CPU): the Neuron path
(NeuronDelegate, split at trap boundaries) and then="openxla" itself, traps on every call."""

import copy

import pytest

torch_xla = pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: the XLA leg (make test-xla) runs these"
)

import torch  # noqa: E402

import graphpass  # noqa: E402
from graphpass.backends import NamedDelegate, NeuronDelegate, XlaDelegate  # noqa: E402
from graphpass.models.corpus import build  # noqa: E402

from helpers import fresh_inputs  # noqa: E402

# quant_linear is left out: its weights are a tensor subclass (a `.scale` field) that `.to(xla)` drops
MODELS = ["mlp_stack", "tiny_transformer", "moe"]


def _run_three_calls(compiled, model, inputs, device):
    """Three calls on fresh inputs: the trap events of each, checked against eager on the CPU.
    XLA's CPU compiler fuses and reorders fp32 math: state tolerance, not bit equality."""
    seen = []
    for seed in (1, 2, 3):
        x = fresh_inputs(inputs, seed=seed)
        with graphpass.trace_traps() as events, torch.no_grad():
            out = compiled(*(t.to(device) for t in x))
            assert out.device.type == "xla"
            torch.testing.assert_close(out.cpu(), model(*x), rtol=1e-5, atol=1e-5)
        seen.append(list(events))
    return seen


@pytest.mark.parametrize("name", MODELS)
def test_neuron_path_over_openxla_runs_traps_on_every_call(name, xla_device):
    """NeuronDelegate handed torch_xla's real backend: each piece between trap boundaries is one XLA
    computation; the boundaries run on the host between them on every call, not only while tracing."""
    model, inputs = build(name)
    model.eval()
    on_xla = copy.deepcopy(model).to(xla_device)
    gp = graphpass.backend(then=NeuronDelegate(registered_name="openxla", module=None))
    seen = _run_three_calls(torch.compile(on_xla, backend=gp), model, inputs, xla_device)
    assert seen[0] and seen[0] == seen[1] == seen[2]
    assert ("enter", "layers.0") in seen[0] and ("exit", "layers.1") in seen[0]


@pytest.mark.parametrize("then", ["openxla", "openxla_eval", "function"])
def test_then_openxla_keeps_the_host_ops(then, xla_device):
    """then="openxla" (or torch's backend function itself) is split at graphpass's ops like Neuron's
    path, so the traps run on every call."""
    if then == "function":
        from torch._dynamo.backends.torchxla import openxla as then
    model, inputs = build("tiny_transformer")
    model.eval()
    on_xla = copy.deepcopy(model).to(xla_device)
    gp = graphpass.backend(then=then)
    seen = _run_three_calls(torch.compile(on_xla, backend=gp), model, inputs, xla_device)
    assert seen[0] and seen[0] == seen[1] == seen[2]


def test_unsplit_openxla_really_drops_host_ops_after_tracing(xla_device):
    """Why the split matters (guards the tests above): the whole graph, boundaries inside, handed to
    torch_xla's bridge as a host-code delegate runs the boundaries while it records and never again."""
    whole = NamedDelegate("openxla")
    assert whole.host_code is True and XlaDelegate.host_code is False
    model, inputs = build("tiny_transformer")
    model.eval()
    on_xla = copy.deepcopy(model).to(xla_device)
    seen = _run_three_calls(torch.compile(on_xla, backend=graphpass.backend(then=whole)), model, inputs, xla_device)
    assert seen[0] and not seen[1] and not seen[2]


def test_training_through_the_neuron_path_over_openxla(xla_device):
    """Gradients through the split graph (forward and backward pieces on XLA) equal eager's on the CPU.
    (mlp_stack: `.to(xla)` replaces parameters by new ones, which unties tiny_transformer's tied
    embedding and lm_head, so that model's gradients differ from the tied CPU model's, with or without
    graphpass.)"""
    model, inputs = build("mlp_stack")
    ref = copy.deepcopy(model)
    on_xla = model.to(xla_device)
    x = fresh_inputs(inputs)
    compiled = torch.compile(
        on_xla, backend=graphpass.backend(then=NeuronDelegate(registered_name="openxla", module=None))
    )
    compiled(*(t.to(xla_device) for t in x)).sum().backward()
    ref(*x).sum().backward()
    for (n, p), r in zip(on_xla.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), r.grad, rtol=1e-4, atol=1e-5, msg=n)
