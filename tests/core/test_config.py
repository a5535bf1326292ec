"""Options: one dict for options= and graphpass.backend(**kwargs), validated before compiling."""

import pytest
import torch

import graphpass
import graphpass.backends
import torch._dynamo.backends.common
from graphpass import ConfigError, GraphpassConfig, GraphpassError, PatternError, PatternMatchError
from graphpass.models.corpus import build

# (options, key the error must name, text the value shows up as)
BAD = [
    ({"thne": "eager"}, "thne", "'eager'"),
    ({"trap": ["layers.*"]}, "trap", "layers"),
    ({"then": "no_such_backend"}, "then", "no_such_backend"),
    ({"then": 3}, "then", "3"),
    ({"then": None}, "then", "None"),
    ({"then": "graphpass"}, "then", "graphpass"),
    ({"traps": "layers.*"}, "traps", "layers.*"),
    ({"traps": 5}, "traps", "5"),
    ({"traps": ["layers.5-2"]}, "traps", "layers.5-2"),
    ({"traps": ["layers.(\\d+"]}, "traps", "layers.(\\\\d+"),
    ({"traps": ["[unclosed"]}, "traps", "[unclosed"),
    ({"traps": ["*layers"]}, "traps", "*layers"),
    ({"traps": [""]}, "traps", "''"),
    ({"traps": [" layers.0"]}, "traps", "layers.0"),
    ({"traps": [7]}, "traps", "7"),
    ({"traps": ["layers.0", "layers.0"]}, "traps", "layers.0"),
    ({"boundaries": "yes"}, "boundaries", "yes"),
    ({"boundaries": 1}, "boundaries", "1"),
    ({"profile_ranges": None}, "profile_ranges", "None"),
    ({"mode": "fastest"}, "mode", "fastest"),
    ({"delegate_options": ["max_autotune"]}, "delegate_options", "max_autotune"),
    ({"delegate_options": {1: True}}, "delegate_options", "1"),
    ({"then": "neuronx_cc"}, None, "torch-neuronx"),
    ({"then": object()}, "then", "object"),
    ({"static_shapes": [16, 32]}, "static_shapes", "16"),
    ({"static_shapes": {"dims": {"ids": 1}}}, "static_shapes.buckets", "None"),
    ({"static_shapes": {"dims": {"ids": 1}, "buckets": [32, 16]}}, "static_shapes.buckets", "32"),
    ({"static_shapes": {"dims": {"ids": 1}, "buckets": [0, 8]}}, "static_shapes.buckets", "0"),
    ({"static_shapes": {"dims": {}, "buckets": [8]}}, "static_shapes.dims", "{}"),
    ({"static_shapes": {"dims": {"ids": -1}, "buckets": [8]}}, "static_shapes.dims.ids", "-1"),
    ({"static_shapes": {"dims": {"ids": 1}, "buckets": [8], "masked": ["mask"]}}, "static_shapes.masked", "mask"),
    ({"static_shapes": {"dims": {"ids": 1}, "buckets": [8], "bucket": [8]}}, "static_shapes.bucket", "8"),
]


@pytest.mark.parametrize("options,key,shown", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_option_via_backend_kwargs(options, key, shown):
    with pytest.raises(GraphpassError) as info:
        graphpass.backend(**options)
    msg = str(info.value)
    if key is not None:
        assert isinstance(info.value, ConfigError)
        assert info.value.key == key and repr(key) in msg
    assert shown in msg


@pytest.mark.parametrize("options,key,shown", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_option_via_torch_compile_options(options, key, shown, counting):
    """The same errors through torch.compile(options=...): raised as the graphpass error itself
    (not wrapped by Dynamo), before the delegate compiles anything and before the model runs."""
    model, inputs = build("mlp_stack")
    if "then" not in options:
        options = {**options, "then": counting}  # a delegate that would notice being called
    compiled = torch.compile(model, backend="graphpass", options=options)
    with pytest.raises(GraphpassError) as info:
        compiled(*inputs)
    assert shown in str(info.value)
    if key is not None:
        assert info.value.key == key
    assert counting.calls == 0


def test_at_least_twenty_distinct_bad_inputs():
    assert len({repr(o) for o, _, _ in BAD}) >= 20


def test_pattern_matching_nothing_raises_before_delegate(counting):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=graphpass.backend(then=counting, traps=["layers.0", "decoder.*"]))
    with pytest.raises(PatternMatchError) as info:
        compiled(*inputs)
    assert info.value.key == "traps" and info.value.value == "decoder.*"
    assert "matches no module" in str(info.value)
    assert counting.calls == 0


def test_pattern_range_outside_model_matches_nothing(counting):
    model, inputs = build("mlp_stack")  # layers 0-2
    compiled = torch.compile(model, backend="graphpass", options={"then": counting, "traps": ["layers.7-9"]})
    with pytest.raises(PatternMatchError):
        compiled(*inputs)


def test_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError, match="did you mean 'traps'"):
        graphpass.backend(trapz=["layers.*"])


def test_reversed_range_is_pattern_error():
    with pytest.raises(PatternError, match="reversed range '5-2'"):
        graphpass.backend(traps=["layers.5-2"])


def test_options_and_kwargs_take_the_same_keys():
    assert set(GraphpassConfig.keys()) == {
        "then",
        "traps",
        "boundaries",
        "profile_ranges",
        "mode",
        "delegate_options",
        "static_shapes",
    }
    a = GraphpassConfig.from_options({"then": "eager", "traps": ["layers.0-3"]})
    b = graphpass.backend(then="eager", traps=["layers.0-3"]).config
    assert a == b
    assert [p.text for p in a.traps] == ["layers.0-3"]


def test_options_given_twice_conflict():
    gp = graphpass.backend(then="eager")
    with pytest.raises(ConfigError, match="given twice"):
        gp.config_for({"then": "aot_eager"})


def test_error_hierarchy():
    for cls in (
        ConfigError,
        PatternError,
        PatternMatchError,
        graphpass.DelegateError,
        graphpass.DelegateUnavailableError,
        graphpass.OwnershipError,
    ):
        assert issubclass(cls, GraphpassError)


def test_unknown_inductor_delegate_option_is_refused_at_once():
    """Used to be accepted by graphpass.backend() and fail later as BackendCompilerFailed."""
    with pytest.raises(ConfigError, match=r"'delegate_options.max_autotun'.*did you mean 'max_autotune'"):
        graphpass.backend(then="inductor", delegate_options={"max_autotun": True})
    graphpass.backend(then="inductor", delegate_options={"max_autotune": False, "triton.cudagraphs": False})


def _no_options_backend(gm, example_inputs):
    return gm.forward


def _options_backend(gm, example_inputs, options=None):
    return gm.forward


class _OwnDelegate(graphpass.backends.Delegate):
    name = "own"

    def compile(self, gm, example_inputs):
        return gm.forward


@pytest.mark.parametrize(
    "then",
    [
        "eager",
        "aot_eager",
        "cudagraphs",
        _no_options_backend,
        torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda gm, ex: gm),
        _OwnDelegate(),
    ],
    ids=["eager", "aot_eager", "cudagraphs", "function", "aot_autograd", "own_delegate"],
)
def test_delegate_options_for_a_delegate_that_takes_none_are_refused_at_once(then):
    """Issue 22 item 18: eager / aot_eager (and aot_autograd objects) logged "ignoring extra kwargs"
    at compile time and dropped them, a Delegate instance never saw them, a callable without an
    ``options`` parameter failed with a TypeError only after the pipeline ran."""
    with pytest.raises(
        ConfigError,
        match=r"'delegate_options\.anything'=1: .*(takes no options=|Delegate instance).*"
        r"\(given: anything, other\)",
    ):
        graphpass.backend(then=then, delegate_options={"anything": 1, "other": 2})
    graphpass.backend(then=then)  # without options: fine


def test_delegate_options_for_a_delegate_that_takes_them_are_kept(monkeypatch):
    from helpers import register_temp_backend

    register_temp_backend(monkeypatch, "with_options_backend", _options_backend)
    for then in ("with_options_backend", _options_backend, graphpass.backend(then="eager")):
        assert graphpass.backend(then=then, delegate_options={"anything": 1}).config.delegate_options == {"anything": 1}
