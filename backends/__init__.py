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

graphpass's own delegates (inductor, Neuron, torch_xla) are entries of one table (:mod:`.registry`): names,
factory, whether they take options, whether they run host code. Adding one is one call,
:func:`register_delegate`; a name outside the table is looked up in Dynamo's registry.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch

from graphpass.errors import ConfigError, DelegateError

from .base import Delegate, call_registered
from .neuron import NEURON_NAMES, NeuronDelegate
from .registry import (
    DelegateEntry,
    delegate_entry,
    delegate_names,
    entry_for_function,
    make_delegate,
    register_delegate,
    unregister_delegate,
)
from .xla import XLA_NAMES, XlaDelegate, xla_name_of  # noqa: F401 (xla_name_of: importable here as before)

__all__ = [
    "Delegate",
    "InductorDelegate",
    "NamedDelegate",
    "CallableDelegate",
    "NeuronDelegate",
    "XlaDelegate",
    "DelegateEntry",
    "register_delegate",
    "unregister_delegate",
    "delegate_names",
    "resolve_delegate",
    "check_delegate_spec",
    "why_no_options",
]


class InductorDelegate(Delegate):
    name = "inductor"

    def __init__(
        self,
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
        post_grad: Callable[[torch.fx.GraphModule], Any] | None = None,
    ) -> None:
        self.mode = mode
        self.options = dict(options or {})
        # graph -> the post_grad_custom_post_pass for it (or None); the backend (graphpass.dynamo_backend) supplies
        # graphpass.pipeline.inductor_post_grad_pass (pipeline.with_post_grad_passes): no delegate imports the pipeline
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


# The table of graphpass's own delegates (backends/registry.py); names it does not hold are Dynamo's.
register_delegate(
    "inductor",
    lambda name, mode, options: InductorDelegate(mode=mode, options=options),
    takes_options=True,
    host_code=True,
)
register_delegate(
    NEURON_NAMES, lambda name, mode, options: NeuronDelegate(options=options), takes_options=True, host_code=False
)
register_delegate(XLA_NAMES, XlaDelegate, takes_options=False, host_code=False, by_function=True)


def _entry_of(spec: Any) -> tuple[str, DelegateEntry] | None:
    """``(name, entry)`` of the table for a name, or for the function Dynamo registers under one; else None."""
    if isinstance(spec, str):
        entry = delegate_entry(spec)
        return None if entry is None else (spec, entry)
    if callable(spec) and not isinstance(spec, Delegate):
        return entry_for_function(spec)
    return None


def check_delegate_spec(spec: Any) -> None:
    """Validate ``then=`` without compiling anything: unknown names and unusable adapters raise."""
    if isinstance(spec, Delegate):
        spec.check()
        return
    found = _entry_of(spec)
    if found is not None:
        make_delegate(found[1], found[0]).check()
        return
    if isinstance(spec, str):
        if spec == "graphpass":
            raise ConfigError("then", spec, "graphpass cannot delegate to itself by name; pass graphpass.backend(...)")
        if _registered(spec):
            return
        from torch._dynamo.backends.registry import list_backends

        raise ConfigError(
            "then",
            spec,
            f"unknown delegate backend (registered: {', '.join(sorted(list_backends(exclude_tags=())))}; "
            f"adapters: {', '.join(delegate_names())})",
        )
    if not callable(spec):
        raise ConfigError("then", spec, f"expected a backend name or callable, not {type(spec).__name__}")


def why_no_options(spec: Any) -> str | None:
    """Why the delegate ``then=spec`` would ignore ``delegate_options`` (None where it takes them).

    A delegate of the table takes them as its entry says (inductor and Neuron do). A registered backend
    or a callable takes them through an explicit ``options`` parameter. A bare ``**kwargs`` counts as taking
    them, except in torch's own backends (``eager``, ``aot_eager``, ``aot_autograd(...)`` objects), which log
    "ignoring extra kwargs" and drop them. A :class:`Delegate` instance is used as given: it gets none.
    ``spec`` is checked."""
    if isinstance(spec, Delegate):
        return f"then= is a Delegate instance ({spec!r}), which is used as given: pass its options to its constructor"
    if isinstance(spec, str):
        fn, what = None, f"the registered backend {spec!r}"
    else:
        fn, what = spec, f"the backend callable {getattr(spec, '__name__', type(spec).__name__)!r}"
    found = _entry_of(spec)
    if found is not None:
        takes = found[1].takes_options
    else:
        if fn is None:
            from torch._dynamo.backends.registry import lookup_backend

            fn = lookup_backend(spec)
        takes = _takes_options(fn)
    if takes:
        return None
    return (
        f"{what} takes no options= argument, so delegate_options would be ignored; remove them or use then='inductor'"
    )


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
    """The delegate ``then=spec`` names: a :class:`Delegate` as given, the table's delegate for its names
    (and for the functions of its ``by_function`` entries, which get no mode, like any callable), Dynamo's
    registered backend by name, or the callable."""
    check_delegate_spec(spec)
    if isinstance(spec, Delegate):
        return spec
    found = _entry_of(spec)
    if found is not None:
        name, entry = found
        return make_delegate(entry, name, mode=mode if isinstance(spec, str) else None, options=options)
    if isinstance(spec, str):
        return NamedDelegate(spec, mode=mode, options=options)
    if callable(spec):
        return CallableDelegate(spec, options=options)
    raise DelegateError(f"cannot delegate to {spec!r}")  # pragma: no cover - check_delegate_spec refused it
