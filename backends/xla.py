"""torch_xla adapter (``then="openxla"``, and ``"openxla_eval"``).

torch registers Dynamo backends named ``"openxla"`` (AOTAutograd, then XLA) and ``"openxla_eval"``
(inference only) that hand the graph to torch_xla's Dynamo bridge. The bridge runs the graph once on
lazy XLA tensors to record an XLA computation and from then on replays only that computation: Python
in the graph, graphpass's trap boundaries, offload loads and evictions and captures included, runs
while the graph is being recorded and never again, silently. So this delegate declares
``host_code = False``, like Neuron's: graphpass splits the rewritten graph at its own ops, hands each
piece between them to the XLA backend, and runs its ops on the host between the pieces on every call.

When ``torch_xla`` is not importable the adapter raises :class:`DelegateUnavailableError` at
configuration time, before anything is traced or compiled, saying what to install.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from graphpass.errors import DelegateUnavailableError

from .base import Delegate, call_registered

XLA_NAMES = ("openxla", "openxla_eval")

INSTALL_HINT = (
    "then={name!r} hands graphs to torch_xla's Dynamo bridge, which comes with the torch-xla package, "
    "built for one torch release (torch-xla 2.9.0 pairs with torch 2.9.0): pip install torch-xla==<your torch "
    "version>, and run with PJRT_DEVICE=CPU (or TPU/CUDA) set. "
)


class XlaDelegate(Delegate):
    """One of torch's XLA Dynamo backends, given the pieces between graphpass's ops."""

    host_code = False

    def __init__(
        self, name: str = "openxla", mode: str | None = None, options: Mapping[str, Any] | None = None
    ) -> None:
        self.name = name
        self.mode = mode
        self.options = dict(options or {})

    def __repr__(self) -> str:
        return f"XlaDelegate({self.name!r})"

    def check(self) -> None:
        try:
            import torch_xla  # noqa: F401  (the bridge the backend imports when it compiles)
        except ImportError as exc:
            raise DelegateUnavailableError(
                INSTALL_HINT.format(name=self.name) + f"Importing 'torch_xla' failed: {exc}"
            ) from None

    def compile(self, gm, example_inputs) -> Callable:
        return call_registered(self.name, gm, example_inputs, self.options, self.mode)


def xla_name_of(fn: Any) -> str | None:
    """The registered XLA backend name of a backend callable (``then=torch._dynamo.backends.torchxla.openxla``),
    or None: the same bridge, reached without its name, must be split the same way."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, _lazy_import

    _lazy_import()
    return next((name for name in XLA_NAMES if _COMPILER_FNS.get(name) is fn), None)
