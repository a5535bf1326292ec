"""Delegate adapters: what graphpass hands the rewritten graph to (installed as ``graphpass.backends``).

``then=`` may be

* ``"inductor"`` (default): :class:`InductorDelegate`, ``compile_fx`` with the mode's config;
* ``"neuronx_cc"`` or ``"neuron"``: :class:`~graphpass.backends.neuron.NeuronDelegate`, AWS Neuron;
* ``"openxla"`` or ``"openxla_eval"`` (by name, or torch's backend function itself):
  :class:`~graphpass.backends.xla.XlaDelegate`, torch_xla, which cannot run host code either;
* any other name registered with Dynamo (``"eager"``, ``"aot_eager"``, ``"cudagraphs"``, entry points);
* a backend callable ``fn(gm, example_inputs) -> callable``: plain functions, ``aot_autograd(...)``
  objects, another graphpass backend;
* a :class:`Delegate` instance.

A delegate with ``host_code = False`` cannot run Python or custom ops inside its graph; graphpass
then splits the graph at trap boundaries and runs the boundaries between the compiled pieces.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch

from graphpass.errors import ConfigError, DelegateError

from .base import Delegate, call_registered
from .neuron import NEURON_NAMES, NeuronDelegate
from .xla import XLA_NAMES, XlaDelegate, xla_name_of

__all__ = [
    "Delegate",
    "InductorDelegate",
    "NamedDelegate",
    "CallableDelegate",
    "NeuronDelegate",
    "XlaDelegate",
    "resolve_delegate",
    "check_delegate_spec",
    "why_no_options",
]


class InductorDelegate(Delegate):
    name = "inductor"

    def __init__(self, mode: str | None = None, options: Mapping[str, Any] | None = None,
                 post_grad: Callable[[torch.fx.GraphModule], Any] | None = None) -> None:
        self.mode = mode
        self.options = dict(options or {})
        # graph -> the post_grad_custom_post_pass for it (or None); graphpass.delegation.call_delegate
        # supplies graphpass.pipeline.inductor_post_grad_pass, so this package never imports the pipeline
        self.post_grad = post_grad

    def compile(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        from graphpass.torch_compat import keep_marked_ops_in_inductor

        keep_marked_ops_in_inductor()  # torch 2.9's inductor would drop the boundaries, captures, evictions
        patches: dict[str, Any] = {}
        if self.mode not in (None, "default"):
            patches.update(torch._inductor.list_mode_options(self.mode))
        patches.update(self.options)
        if "post_grad_custom_post_pass" not in patches and self.post_grad is not None:
            post_grad = self.post_grad(gm)  # the aten-level passes declared beside PIPELINE
            if post_grad is not None:
                patches["post_grad_custom_post_pass"] = post_grad
        return compile_fx(gm, list(example_inputs), config_patches=patches or None)


class NamedDelegate(Delegate):
    """A backend registered with Dynamo under ``name``."""

    def __init__(self, name: str, mode: str | None = None, options: Mapping[str, Any] | None = None) -> None:
        self.name = name
        self.mode = mode
        self.options = dict(options or {})

    def compile(self, gm, example_inputs):
        return call_registered(self.name, gm, example_inputs, self.options, self.mode)


class CallableDelegate(Delegate):
    """Any backend callable, including ``aot_autograd(...)`` objects and other graphpass backends."""

    def __init__(self, fn: Callable, options: Mapping[str, Any] | None = None) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.options = dict(options or {})

    def compile(self, gm, example_inputs):
        if self.options:
            return self.fn(gm, list(example_inputs), options=self.options)
        return self.fn(gm, list(example_inputs))


def _registered(name: str) -> bool:
    from torch._dynamo.backends.registry import _BACKENDS, _lazy_import

    _lazy_import()
    return name in _BACKENDS


def check_delegate_spec(spec: Any) -> None:
    """Validate ``then=`` without compiling anything: unknown names and unusable adapters raise."""
    if isinstance(spec, Delegate):
        spec.check()
        return
    if isinstance(spec, str):
        if spec in NEURON_NAMES:
            NeuronDelegate().check()
            return
        if spec in XLA_NAMES:
            XlaDelegate(spec).check()
            return
        if spec == "graphpass":
            raise ConfigError("then", spec, "graphpass cannot delegate to itself by name; pass graphpass.backend(...)")
        if spec == "inductor" or _registered(spec):
            return
        from torch._dynamo.backends.registry import list_backends

        raise ConfigError(
            "then", spec, f"unknown delegate backend (registered: {', '.join(sorted(list_backends(exclude_tags=())))}; "
            f"adapters: {', '.join(NEURON_NAMES + XLA_NAMES)})"
        )
    if not callable(spec):
        raise ConfigError("then", spec, f"expected a backend name or callable, not {type(spec).__name__}")
    xla = xla_name_of(spec)
    if xla is not None:
        XlaDelegate(xla).check()


def why_no_options(spec: Any) -> str | None:
    """Why the delegate ``then=spec`` would ignore ``delegate_options`` (None where it takes them).

    Inductor and Neuron take them; a registered backend or a callable takes them through an explicit
    ``options`` parameter. A bare ``**kwargs`` counts as taking them, except in torch's own backends
    (``eager``, ``aot_eager``, ``aot_autograd(...)`` objects), which log "ignoring extra kwargs" and
    drop them. A :class:`Delegate` instance is used as given: it gets none. ``spec`` is checked."""
    if isinstance(spec, Delegate):
        return f"then= is a Delegate instance ({spec!r}), which is used as given: pass its options to its constructor"
    if isinstance(spec, str):
        if spec == "inductor" or spec in NEURON_NAMES:
            return None
        from torch._dynamo.backends.registry import lookup_backend

        fn, what = lookup_backend(spec), f"the registered backend {spec!r}"
    else:
        fn, what = spec, f"the backend callable {getattr(spec, '__name__', type(spec).__name__)!r}"
    if _takes_options(fn):
        return None
    return f"{what} takes no options= argument, so delegate_options would be ignored; remove them or use then='inductor'"


def _takes_options(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature: cannot tell
        return True
    named = params.get("options")
    if named is not None and named.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        module = getattr(fn, "__module__", None) or type(fn).__module__ or ""
        return not module.startswith("torch.")
    return False


def resolve_delegate(spec: Any, mode: str | None = None, options: Mapping[str, Any] | None = None) -> Delegate:
    check_delegate_spec(spec)
    if isinstance(spec, Delegate):
        return spec
    if isinstance(spec, str):
        if spec in NEURON_NAMES:
            return NeuronDelegate(options=options)
        if spec in XLA_NAMES:
            return XlaDelegate(spec, mode=mode, options=options)
        if spec == "inductor":
            return InductorDelegate(mode=mode, options=options)
        return NamedDelegate(spec, mode=mode, options=options)
    if callable(spec):
        xla = xla_name_of(spec)
        if xla is not None:  # torch's XLA backend function itself: the same bridge, split the same way
            return XlaDelegate(xla, options=options)
        return CallableDelegate(spec, options=options)
    raise DelegateError(f"cannot delegate to {spec!r}")  # pragma: no cover - check_delegate_spec refused it
