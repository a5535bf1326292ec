"""The delegate table (backends/registry.py): adding a delegate is one registration, then="<its name>"
compiles through it (whole, or split at the host's nodes when the entry says it runs no host code), and
a bad registration says what is wrong."""

import pytest
import torch

import graphpass
from graphpass.backends import Delegate, delegate_names, register_delegate, resolve_delegate, unregister_delegate
from graphpass.errors import ConfigError, DelegateError, DelegateRegistrationError
from graphpass.models.corpus import build

from helpers import fresh_inputs


class Recording(Delegate):
    """A delegate that runs the graph it is given as it is and records it, with what it was made with."""

    made: list = []

    def __init__(self, name, mode, options):
        self.name, self.mode, self.options = name, mode, options
        self.graphs = []
        Recording.made.append(self)

    def compile(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


@pytest.fixture
def recording():
    """``recording`` (host code, takes options) and ``recording_device`` (no host code): one registration each."""
    Recording.made = []
    register_delegate("recording", Recording, takes_options=True, host_code=True)
    register_delegate(("recording_device", "recording_dev"), Recording, takes_options=False, host_code=False)
    yield Recording.made
    unregister_delegate("recording")
    unregister_delegate("recording_dev")
    assert "recording" not in delegate_names() and "recording_device" not in delegate_names()


def _graphpass_ops(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "graphpass" in str(n.target)]


def test_a_registered_delegate_compiles_a_model_by_its_name(recording):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=graphpass.backend(then="recording", delegate_options={"level": 2}))
    x = fresh_inputs(inputs)
    with graphpass.trace_traps() as events, torch.no_grad():
        out = compiled(*x)
        ref = model(*x)
    assert torch.equal(out, ref)
    delegate = recording[-1]
    assert delegate.name == "recording" and delegate.options == {"level": 2} and delegate.host_code
    assert len(delegate.graphs) == 1 and _graphpass_ops(delegate.graphs[0])  # the whole graph, traps in it
    assert ("enter", "layers.0") in events


def test_a_delegate_registered_without_host_code_gets_the_graph_split(recording):
    """The entry decides: Recording's own class says host_code=True, the registration says False."""
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=graphpass.backend(then="recording_dev"))
    x = fresh_inputs(inputs)
    with graphpass.trace_traps() as events, torch.no_grad():
        out = compiled(*x)
        ref = model(*x)
    assert torch.equal(out, ref)
    delegate = recording[-1]
    assert delegate.name == "recording_dev" and delegate.host_code is False
    assert len(delegate.graphs) >= 2 and not any(_graphpass_ops(gm) for gm in delegate.graphs)
    assert ("enter", "layers.0") in events and ("exit", "layers.1") in events  # run on the host


def test_the_entry_says_whether_options_are_taken(recording):
    with pytest.raises(
        ConfigError,
        match=r"'delegate_options\.level'=1: the registered backend 'recording_dev' "
        r"takes no options=",
    ):
        graphpass.backend(then="recording_dev", delegate_options={"level": 1})
    assert resolve_delegate("recording", mode="max-autotune").mode == "max-autotune"


def test_the_decorator_form_registers_the_factory():
    @register_delegate("decorated", takes_options=False, host_code=True)
    def make(name, mode, options):
        return Recording(name, mode, options)

    try:
        assert isinstance(resolve_delegate("decorated"), Recording) and make("x", None, {}).name == "x"
    finally:
        unregister_delegate("decorated")


def test_unknown_names_list_the_valid_ones(recording):
    with pytest.raises(ConfigError) as info:
        graphpass.backend(then="no_such_delegate")
    msg = str(info.value)
    assert "unknown delegate backend" in msg
    for name in ("eager", "aot_eager", "inductor", "neuronx_cc", "openxla", "recording", "recording_device"):
        assert name in msg


@pytest.mark.parametrize("names", ["inductor", "neuron", "openxla_eval", ("fresh", "openxla")])
def test_a_taken_name_is_refused(names):
    before = delegate_names()
    with pytest.raises(DelegateRegistrationError, match="already registered"):
        register_delegate(names, Recording, takes_options=True, host_code=True)
    assert delegate_names() == before  # nothing half-registered


@pytest.mark.parametrize(
    "names,factory,flags,match",
    [
        ("graphpass", Recording, {}, "reserved"),
        ("", Recording, {}, "non-empty string"),
        (" padded", Recording, {}, "non-empty string"),
        ((), Recording, {}, "a name or a tuple of names"),
        (("twice", "twice"), Recording, {}, "given twice"),
        ("bad_factory", "not callable", {}, "must be callable"),
        ("bad_flag", Recording, {"host_code": "yes"}, "host_code .* must be True or False"),
        ("bad_flag", Recording, {"takes_options": 1}, "takes_options .* must be True or False"),
    ],
)
def test_a_bad_entry_is_refused(names, factory, flags, match):
    before = delegate_names()
    kwargs = {"takes_options": True, "host_code": True, **flags}
    with pytest.raises(DelegateRegistrationError, match=match):
        register_delegate(names, factory, **kwargs)
    assert delegate_names() == before
    assert issubclass(DelegateRegistrationError, graphpass.DelegateError)


def test_a_factory_that_makes_no_delegate_is_refused_when_configured():
    register_delegate(
        "not_a_delegate", lambda name, mode, options: lambda gm, ex: gm.forward, takes_options=False, host_code=True
    )
    try:
        with pytest.raises(DelegateError, match="returned function, not a graphpass.backends.Delegate"):
            graphpass.backend(then="not_a_delegate")
    finally:
        unregister_delegate("not_a_delegate")


def test_unregistering_an_unknown_name_is_refused():
    with pytest.raises(DelegateRegistrationError, match="no delegate is registered as 'never'"):
        unregister_delegate("never")
