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
import dataclasses
import json
from typing import Any, List, Sequence

import torch

from ..bucket_context import current_bucket
from ..tensor_utils import dtensor_mesh, is_dtensor, local_tensor, register_dtensor_handlers

_LIB = torch.library.Library("graphpass", "FRAGMENT")
_LIB.define(
    "capture(str name, Tensor t, Tensor[] owner, str owner_fqn='', bool manual=False, str key='', str layout='') -> ()"
)
# Traced from the forward hook a ModelCapture puts on each module it selects: ``t`` is the output
# leaf at pytree key path ``key`` of that module's return value. The capture pass reads these
# markers (which module, which key, in output order) and removes them; run as an op, it does nothing.
_LIB.define("output_key(str key, Tensor t) -> ()")


def _nothing(*args, **kwargs) -> None:
    return None


# Stack of TensorRegistry objects activated by ModelCapture.setup_tensor_capture in this context.
ACTIVE_CAPTURES: contextvars.ContextVar[tuple] = contextvars.ContextVar("graphpass_captures", default=())


def capture(
    name: str,
    t: torch.Tensor,
    owner: List[torch.Tensor],
    owner_fqn: str = "",
    manual: bool = False,
    key: str = "",
    layout: str = "",
) -> None:
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
    bucket = current_bucket()
    if bucket is not None:
        registry.bucket = bucket
    if manual:
        registry.register_manual_tensor(name, value, layout=layout)
    else:
        registry.register_module_tensor(name, value, key, layout=layout)


_LIB.impl("capture", capture, "CompositeExplicitAutograd")
torch.library.register_fake("graphpass::capture", _nothing, lib=_LIB)
_LIB.impl("output_key", _nothing, "CompositeExplicitAutograd")
torch.library.register_fake("graphpass::output_key", _nothing, lib=_LIB)
OUTPUT_KEY = torch.ops.graphpass.output_key.default
OUTPUT_KEY_TARGETS = (OUTPUT_KEY, torch.ops.graphpass.output_key)  # Dynamo records the packet
torch.fx.node.has_side_effect(OUTPUT_KEY)  # kept until the capture pass reads and removes it

CAPTURE = torch.ops.graphpass.capture.default
torch.fx.node.has_side_effect(CAPTURE)
_CAPTURE_TARGETS = (CAPTURE, torch.ops.graphpass.capture)


# --- DTensor: the ops see the local shard, and the capture op the DTensor's layout -------------

_CAPTURE_ARGS = ("name", "t", "owner", "owner_fqn", "manual", "key", "layout")


def dtensor_layout(t: Any) -> str:
    """JSON: how the DTensor ``t``'s local shard sits in the global tensor (placements, mesh shape
    and dim names, global shape, this rank's mesh coordinate and the shard's global offset)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.utils._python_dispatch import _disable_current_modes

    mesh = dtensor_mesh(t)
    # Under AOTAutograd's tracing (fake and functional modes) torch reads the offset out of an index
    # tensor (``int(offsets[0])``), a data-dependent value there: compute it with the modes off.
    with _disable_current_modes():
        _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    return json.dumps(
        {
            "placements": [placement_name(p) for p in t.placements],
            "mesh_shape": [int(n) for n in mesh.shape],
            "mesh_dim_names": list(mesh.mesh_dim_names or ()),
            "global_shape": [int(n) for n in t.shape],
            "global_offset": [int(n) for n in offset],
            "coordinate": [int(c) for c in (mesh.get_coordinate() or [])],
        }
    )


def placement_name(p: Any) -> str:
    """``Shard(0)``, ``Replicate()``, ``Partial(sum)``: how compare reads a placement back."""
    if p.is_shard():
        return f"Shard({p.dim})"
    if p.is_replicate():
        return "Replicate()"
    return f"Partial({getattr(p, 'reduce_op', 'sum')})"


def _dtensor_capture(op_call: Any, args: tuple, kwargs: dict) -> None:
    """DTensor's handler for the capture op: call it on the local shards, with the value's layout.
    Under an AOTAutograd delegate it runs once, while the DTensor graph is traced to local tensors:
    the traced op holds the local shard and this rank's layout as a constant string."""
    given = dict(zip(_CAPTURE_ARGS, ("", None, [], "", False, "", "")))
    given.update(zip(_CAPTURE_ARGS, args), **kwargs)
    t = given["t"]
    if is_dtensor(t):
        given["layout"], given["t"] = dtensor_layout(t), local_tensor(t)
    given["owner"] = [local_tensor(o) for o in given.get("owner", [])]
    return op_call(*(given[k] for k in _CAPTURE_ARGS))


def _dtensor_output_key(op_call: Any, args: tuple, kwargs: dict) -> None:
    return None  # a marker: only its place in the traced graph matters


# registered with the ops, where they are defined (never by a pass)
register_dtensor_handlers({CAPTURE: _dtensor_capture, OUTPUT_KEY: _dtensor_output_key})


def is_capture(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _CAPTURE_TARGETS


def is_output_key(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in OUTPUT_KEY_TARGETS


def output_key_path(out: Any, path: Sequence[Any]) -> str:
    """``torch.utils._pytree.keystr`` of ``path`` into ``out``, except that a field of a dataclass
    flattened as a mapping (transformers' ``ModelOutput``) reads ``.field`` (``GetAttrKey``), not
    ``['field']``; the empty path (the output is one tensor) is ``"output"``."""
    from torch.utils._pytree import GetAttrKey, MappingKey, keystr

    keys, parents = [], [out]
    for k in path[:-1]:  # containers only: no tensor is bound to a local (Dynamo names nodes after locals)
        parents.append(k.get(parents[-1]))
    for k, parent in zip(path, parents):
        if isinstance(k, MappingKey) and isinstance(k.key, str) and dataclasses.is_dataclass(parent):
            keys.append(GetAttrKey(k.key))
        else:
            keys.append(k)
    return keystr(keys) if keys else "output"


def mark_output_keys(module: torch.nn.Module, args: Any, out: Any) -> None:
    """A forward hook: an ``output_key`` marker for every tensor leaf of ``out`` (output order)."""
    from torch.utils._pytree import tree_flatten_with_path

    for pair in tree_flatten_with_path(out)[0]:
        if isinstance(pair[1], torch.Tensor):
            torch.ops.graphpass.output_key(output_key_path(out, pair[0]), pair[1])


def capture_eager_outputs(module: torch.nn.Module, out: Any) -> None:
    """A selected module's outputs, when its call ran outside any compiled graph (Dynamo broke the
    graph at the call because the module's forward breaks, or ran the caller eagerly): no capture
    node saw them, so the global forward hook hands every tensor leaf of ``out`` (under its key
    path, as the capture nodes name them) to the innermost active, enabled registry whose model
    holds ``module`` and selects it. A module call traced into a graph never comes here (the hook
    is traced: ``output_key`` markers), so a value is captured once."""
    from torch.utils._pytree import tree_flatten_with_path

    for reg in reversed(ACTIVE_CAPTURES.get()):
        if not reg.enabled:
            continue
        name = reg.module_name(module)
        if not name or not reg.accepts(name):
            continue
        for path, t in tree_flatten_with_path(out)[0]:
            if isinstance(t, torch.Tensor):
                layout = ""
                if is_dtensor(t):  # a DTensor: its local shard
                    layout, t = dtensor_layout(t), local_tensor(t)
                reg.register_module_tensor(name, t.detach().clone(), output_key_path(out, path), layout=layout)
        return


def capture_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """Capture ``t`` under ``name`` from inside model code (works compiled and eager); returns ``t``."""
    torch.ops.graphpass.capture(name, t, [], "", True)
    return t
