"""The graphpass exception hierarchy: everything graphpass raises on bad input is a GraphpassError."""

from __future__ import annotations

from typing import Any

__all__ = [
    "GraphpassError",
    "ConfigError",
    "PatternError",
    "PatternMatchError",
    "DelegateError",
    "DelegateUnavailableError",
    "DelegateRegistrationError",
    "OwnershipError",
    "CaptureError",
    "OffloadError",
    "PassError",
    "DynamicShapesDisabledError",
    "surface",
]


class GraphpassError(Exception):
    """Root of every error graphpass raises for bad input or an impossible request."""


class ConfigError(GraphpassError, ValueError):
    """An option has an unknown key, a wrong type or a bad value. ``key`` and ``value`` name it."""

    def __init__(self, key: str, value: Any, problem: str) -> None:
        self.key = key
        self.value = value
        self.problem = problem
        super().__init__(f"graphpass option {key!r}={_short(value)}: {problem}")


class PatternError(ConfigError):
    """A module pattern is malformed: invalid regex, reversed range, empty."""


class PatternMatchError(PatternError):
    """A module pattern is well formed but matches no module of the model."""


class DelegateError(GraphpassError):
    """The delegate compiler named by ``then=`` is unknown or refused the graph."""


class DelegateUnavailableError(DelegateError):
    """The delegate exists as an adapter but what it needs is not installed."""


class DelegateRegistrationError(DelegateError, ValueError):
    """A delegate cannot be added to the delegate table (``graphpass.backends.register_delegate``): its name
    is taken or reserved, or its entry is malformed (a factory that is not callable, flags that are not bool)."""


class OwnershipError(GraphpassError):
    """The graph's tensors cannot be attributed to modules the way an option requires."""


class CaptureError(GraphpassError):
    """Tensor capture cannot be set up or written as asked (directory, names, timing)."""


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# error class -> its surfaced twin. Module-level on purpose: a cache of classes derived from
# graphpass's own (a fixed, small set), the same for every model and thread; a race builds one twin twice.
_SURFACED: dict[type, type] = {}


def surface(err: GraphpassError) -> BaseException:
    """Return ``err`` in a form Dynamo re-raises unchanged instead of wrapping it.

    Dynamo wraps any exception a backend raises in ``BackendCompilerFailed`` except its own
    ``ShortenTraceback`` family. The returned object is an instance of a subclass of both the
    original error class and ``ShortenTraceback``, so ``except ConfigError`` still catches it
    and the user sees the graphpass message, not a wrapper.
    """
    try:
        from torch._dynamo.exc import ShortenTraceback
    except Exception:  # pragma: no cover - torch without that class: raise as is
        return err
    cls = type(err)
    if issubclass(cls, ShortenTraceback):
        return err
    surfaced_cls = _SURFACED.get(cls)
    if surfaced_cls is None:
        surfaced_cls = type(cls.__name__, (cls, ShortenTraceback), {"__module__": cls.__module__})
        _SURFACED[cls] = surfaced_cls
    new = surfaced_cls.__new__(surfaced_cls)
    new.__dict__.update(err.__dict__)
    new.args = err.args
    new.first_useful_frame = None
    new.__cause__ = err.__cause__
    return new.with_traceback(err.__traceback__)


class OffloadError(GraphpassError):
    """Offload cannot be set up or run as asked: storage, checkpoint files, budget, uncompiled calls."""


class PassError(GraphpassError):
    """A graph pass failed unexpectedly (a bug in graphpass, or a graph it does not understand).

    ``pass_name`` and ``graph`` name where; the original exception is the ``__cause__``. Also raised
    when a pass leaves a graph that is not well formed (a node used before it is defined).
    """

    def __init__(self, pass_name: str, graph: str, problem: str) -> None:
        self.pass_name = pass_name
        self.graph = graph
        self.problem = problem
        super().__init__(f"graphpass pass {pass_name!r} on {graph}: {problem}")


class DynamicShapesDisabledError(GraphpassError):
    """``static_shapes`` cannot bucket because Dynamo will never trace the marked dim as a symbol:
    ``torch._dynamo.config.automatic_dynamic_shapes`` (``setting``) is off (``import torch_xla``
    turns it off process-wide; ``torch.compile(dynamic=False)`` turns it off for its calls), so every
    length would compile a static graph of its own. ``input`` and ``dim`` name the marked dim."""

    setting = "torch._dynamo.config.automatic_dynamic_shapes"

    def __init__(self, input: str, dim: int, problem: str) -> None:
        self.input = input
        self.dim = dim
        super().__init__(problem)
