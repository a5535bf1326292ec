"""The capture op: ``graphpass::capture(name, t, owner, owner_fqn, manual)`` hands a value to the
capture registry active in the current context that belongs to the model the value came from.
With no active, enabled registry that wants it, it returns at once: nothing is cloned, nothing
allocated. Registered when this module is imported.

Why ``owner``: Dynamo runs one compiled graph for every instance of a model class whose guards
pass (with ``inline_inbuilt_nn_modules`` the parameters are graph inputs, and nothing pins the
module's identity): a draft model of the target's class, or layer 2 running the graph traced from
layer 0's frame. The capture pass therefore passes, with each module capture, one or two weight
placeholders of the graph (``owner``) and the FQN the first one had when the graph was traced
(``owner_fqn``). At run time those placeholders are the weights of the instance actually running,
so the op routes the value to the active registry whose model holds them, and re-derives the
module's name from where that model holds the first one (``layers.0.fc2`` traced, ``layers.2.fc2``
running). A value no active registry's model holds goes nowhere. ``owner == []`` (inline
``capture_tensor``; a graph without any weight) keeps routing by name.
"""

from __future__ import annotations

import contextvars
from typing import List

import torch

from ..ops import CURRENT_BUCKET

_LIB = torch.library.Library("graphpass", "FRAGMENT")
_LIB.define("capture(str name, Tensor t, Tensor[] owner, str owner_fqn='', bool manual=False) -> ()")


def _nothing(*args, **kwargs) -> None:
    return None


# Stack of TensorRegistry objects activated by ModelCapture.setup_tensor_capture in this context.
ACTIVE_CAPTURES: contextvars.ContextVar[tuple] = contextvars.ContextVar("graphpass_captures", default=())


def capture(name: str, t: torch.Tensor, owner: List[torch.Tensor], owner_fqn: str = "",
            manual: bool = False) -> None:
    active = ACTIVE_CAPTURES.get()
    if not active:
        return
    if manual:
        registry = active[-1]
    elif not owner:
        # No weight in the graph to tell instances apart: the innermost active registry that asked
        # for this module by name.
        registry = next((reg for reg in reversed(active) if reg.accepts(name)), None)
    else:
        registry = None
        for reg in reversed(active):
            if not reg.enabled:  # off: no lookup, nothing cloned
                continue
            resolved = reg.resolve(name, owner, owner_fqn)
            if resolved is not None and reg.accepts(resolved):
                registry, name = reg, resolved
                break
    if registry is None or not registry.enabled:
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
    torch.ops.graphpass.capture(name, t, [], "", True)
    return t
