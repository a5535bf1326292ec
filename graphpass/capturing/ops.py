"""The capture op: ``graphpass::capture(name, t, manual)`` hands a value to the capture registry
active in the current context. With no active, enabled registry that wants it, it returns at
once: nothing is cloned, nothing allocated. Registered when this module is imported.
"""

from __future__ import annotations

import contextvars

import torch

from ..ops import CURRENT_BUCKET

_LIB = torch.library.Library("graphpass", "FRAGMENT")
_LIB.define("capture(str name, Tensor t, bool manual=False) -> ()")


def _nothing(*args, **kwargs) -> None:
    return None


# Stack of TensorRegistry objects activated by ModelCapture.setup_tensor_capture in this context.
ACTIVE_CAPTURES: contextvars.ContextVar[tuple] = contextvars.ContextVar("graphpass_captures", default=())


def capture(name: str, t: torch.Tensor, manual: bool = False) -> None:
    active = ACTIVE_CAPTURES.get()
    if not active:
        return
    if manual:
        registry = active[-1]
    else:
        # The innermost active registry that asked for this module. Routing by name, not by a
        # baked-in id: Dynamo may run one compiled graph for several instances of a model class.
        registry = next((reg for reg in reversed(active) if reg.accepts(name)), None)
        if registry is None:
            return
    if not registry.enabled:
        return
    value = t.detach().clone()
    bucket = CURRENT_BUCKET.get()
    if bucket is not None:
        registry.bucket = bucket
    if manual:
        registry.register_manual_tensor(name, value)
    else:
        registry.register_module_tensor(name, value)


_LIB.impl("capture", capture, "CompositeExplicitAutograd")
torch.library.register_fake("graphpass::capture", _nothing, lib=_LIB)

CAPTURE = torch.ops.graphpass.capture.default
torch.fx.node.has_side_effect(CAPTURE)
_CAPTURE_TARGETS = (CAPTURE, torch.ops.graphpass.capture)


def is_capture(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _CAPTURE_TARGETS


def capture_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """Capture ``t`` under ``name`` from inside model code (works compiled and eager); returns ``t``."""
    torch.ops.graphpass.capture(name, t, True)
    return t
