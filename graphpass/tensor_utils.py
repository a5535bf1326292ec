"""The tensor toolkit: every question about what a tensor *is* (rather than where it sits in a
graph, :mod:`graphpass.fx_utils`), answered once.

* DTensor: :func:`is_dtensor`, :func:`local_tensor` (this rank's shard), :func:`dtensor_mesh`,
  :func:`dtensor_placements`, :func:`with_spec_of`, :func:`dtensor_class`;
* wrapper subclasses (torchao's ``Int8Tensor``): :func:`is_wrapper_subclass`, :func:`subclass_fields`,
  :func:`wrapper_fields`, :func:`flatten_wrappers` / :func:`unflatten_wrappers`,
  :func:`wrapper_inner_tensors`;
* fake tensors: :func:`fake_mode_of`, :func:`shape_env_of` (torch's ``detect_fake_mode``);
* DTensor dispatch rules for graphpass's own ops: :func:`register_dtensor_handlers`, called by the
  ops modules where the ops are defined, never by a pass;
* FSDP2 (``fully_shard``): :func:`fsdp_param_groups`, the parameter groups of one module's state.

Nothing else in graphpass reads ``_local_tensor``, ``device_mesh``, ``__tensor_flatten__``,
``is_traceable_wrapper_subclass``, a tensor's ``fake_mode`` / ``shape_env`` or DTensor's
``_custom_op_handlers`` or an FSDP state's param groups: ``tests/test_toolkit_rules.py`` holds that.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

# --------------------------------------------------------------------------------------------
# DTensor
# --------------------------------------------------------------------------------------------


def is_dtensor(t: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (tested without importing torch.distributed)."""
    return isinstance(t, torch.Tensor) and hasattr(t, "_local_tensor") and hasattr(t, "_spec")


def dtensor_class() -> type | None:
    """DTensor, when torch.distributed.tensor is in use (imported); None otherwise."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def local_tensor(t: Any) -> Any:
    """This rank's shard of a DTensor (its ``_local_tensor``); any other value unchanged."""
    return t._local_tensor if is_dtensor(t) else t


def dtensor_mesh(t: Any) -> Any:
    """The DeviceMesh of a DTensor; None for any other value."""
    return t.device_mesh if is_dtensor(t) else None


def dtensor_placements(t: Any) -> tuple:
    """The placements of a DTensor (``Shard(0)``, ``Replicate()``, ...); ``()`` for any other value."""
    return tuple(t.placements) if is_dtensor(t) else ()


def with_spec_of(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``like``'s mesh, placements, global shape and stride (no
    collective, no check: ``local`` must be this rank's shard of such a tensor)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=local.requires_grad)


def register_dtensor_handlers(handlers: dict) -> None:
    """Register ``op -> handler(op_call, args, kwargs)`` with DTensor's dispatcher: graphpass ops
    with DTensor arguments have no sharding strategy, so each ops module says, where it defines its
    ops, how they take the local shards. Imports torch.distributed.tensor (a no-op on a torch built
    without distributed).

    Uses ``DTensor._op_dispatcher._custom_op_handlers``, the private table torch's own
    ``loss_parallel`` uses. Idempotent; the table is DTensor's (process-wide by nature), keyed by
    our own ops.
    """
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # noqa: BLE001 - torch built without distributed
        return
    table = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if isinstance(table, dict):
        for op, handler in handlers.items():
            table.setdefault(op, handler)


# --------------------------------------------------------------------------------------------
# Wrapper subclasses
# --------------------------------------------------------------------------------------------


def _is_traceable_subclass(t: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t)


def is_wrapper_subclass(t: Any) -> bool:
    """A traceable wrapper tensor subclass holding plain inner tensors (torchao's ``Int8Tensor``);
    False for a DTensor, which graphpass reads as its local shard (:func:`local_tensor`)."""
    return not is_dtensor(t) and _is_traceable_subclass(t)


def subclass_fields(t: Any) -> list[tuple[str, Any]]:
    """``(name, inner value)`` of any traceable tensor subclass, one level, in
    ``__tensor_flatten__`` order (a DTensor's local shard included); ``[]`` for a plain tensor, a
    non-tensor, or a subclass that cannot flatten itself."""
    if not _is_traceable_subclass(t):
        return []
    try:
        names, _ = t.__tensor_flatten__()
    except Exception:  # noqa: BLE001 - a subclass that cannot flatten now: no inner tensors we know of
        return []
    return [(n, getattr(t, n, None)) for n in names]


def wrapper_fields(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, inner tensor)`` of a wrapper subclass, one level, in ``__tensor_flatten__`` order."""
    names, _ = t.__tensor_flatten__()
    return [(n, getattr(t, n)) for n in names if isinstance(getattr(t, n, None), torch.Tensor)]


def flatten_wrappers(ts: list) -> tuple[list, list]:
    """``ts`` with every wrapper subclass replaced by its inner tensors (one level), and what
    :func:`unflatten_wrappers` needs to build the wrappers again around other inner tensors."""
    flat: list = []
    metas: list = []
    for t in ts:
        if is_wrapper_subclass(t):
            names, ctx = t.__tensor_flatten__()
            inner = [getattr(t, n) for n in names]
            metas.append((type(t), names, ctx, t.shape, t.stride()))
            flat.extend(inner)
        else:
            metas.append(None)
            flat.append(t)
    return flat, metas


def unflatten_wrappers(flat: list, metas: list) -> list:
    """Inverse of :func:`flatten_wrappers`: wrappers of the same type, metadata and outer shape
    around the tensors of ``flat`` (``__tensor_unflatten__``), plain entries as they are."""
    out: list = []
    pos = 0
    for meta in metas:
        if meta is None:
            out.append(flat[pos])
            pos += 1
            continue
        cls, names, ctx, shape, stride = meta
        out.append(cls.__tensor_unflatten__(dict(zip(names, flat[pos : pos + len(names)])), ctx, shape, stride))
        pos += len(names)
    return out


def wrapper_inner_tensors(t: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The plain tensors a traceable wrapper subclass holds (torchao's ``Int8Tensor``: ``qdata``,
    ``scale``, ``zero_point``), from ``__tensor_flatten__``, nested wrappers flattened as ``a.b``;
    ``[]`` for a plain tensor or a DTensor (a DTensor is its local shard, read by :func:`local_tensor`)."""
    if not is_wrapper_subclass(t):
        return []
    out: list[tuple[str, torch.Tensor]] = []
    for name in t.__tensor_flatten__()[0]:
        value = getattr(t, name)
        if not isinstance(value, torch.Tensor):
            continue  # an optional inner tensor left None
        out.extend(wrapper_inner_tensors(value, f"{prefix}{name}.") or [(prefix + name, value)])
    return out


# --------------------------------------------------------------------------------------------
# Fake tensors
# --------------------------------------------------------------------------------------------


def fake_mode_of(values: Any = None) -> Any:
    """The FakeTensorMode ``values`` (any nesting of tensors) were made under, by torch's
    ``torch._guards.detect_fake_mode``: an active fake mode, else the fake tensors' own; None when
    there is neither. Dynamo's tracing context is set aside for the look-up: it would answer with
    the compile's fake mode even for a graph traced under a mode of its own (the allocation audit's
    ``make_fx`` trace inside a compile)."""
    from torch._guards import detect_fake_mode, tracing

    with tracing(None):
        return detect_fake_mode(values)


def static_fake_mode() -> Any:
    """A new FakeTensorMode without a shape environment (every size static) that also takes real tensors (a
    graph's parameters and buffers) as inputs: for running a graph on fake tensors of chosen sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def shape_env_of(values: Any = None) -> Any:
    """The ShapeEnv that owns ``values``' symbolic sizes: their fake mode's (:func:`fake_mode_of`),
    else the one a symbolic size of theirs names; None for values with neither."""
    mode = fake_mode_of(values)
    if mode is not None and mode.shape_env is not None:
        return mode.shape_env
    for t in torch.utils._pytree.tree_leaves(values):
        if isinstance(t, torch.Tensor):
            for s in t.shape:
                if isinstance(s, torch.SymInt):
                    return s.node.shape_env
    return None


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------


def fsdp_param_groups(module: Any) -> list:
    """The ``FSDPParamGroup`` objects of ``module``'s ``fully_shard`` state (empty when it has none):
    ``_fsdp_param_groups`` on newer torch, one ``_fsdp_param_group`` on older releases."""
    get_state = getattr(module, "_get_fsdp_state", None)
    state = get_state() if callable(get_state) else None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def traced_user_stack() -> list:
    """While Dynamo traces: the user's frames at the point being traced (``FrameSummary`` objects, innermost
    last; the inlined calls included), read from Dynamo's tracing context. Empty when not tracing."""
    from torch._guards import TracingContext

    if TracingContext.try_get() is None:
        return []
    return list(TracingContext.extract_stack())
