"""The offload custom ops: ``graphpass::load_start`` / ``load_wait`` / ``evict`` / ``accumulate_grad`` /
``offload_guard`` (semantics in :mod:`graphpass.offloading.runtime`), registered when this module
is imported; every module that inserts or matches these ops imports them from here.
"""

from __future__ import annotations

from typing import List

import torch

from .. import dynamo_records
from ..errors import OffloadError
from ..tensor_utils import (
    flatten_wrappers,
    is_dtensor,
    local_tensor,
    register_dtensor_handlers,
    unflatten_wrappers,
    with_spec_of,
)
from ..ops import record_event
from .facts import check_skipped_frames, runs_eagerly
from .registry import guarded_module_names, lookup

# --------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------

_LIB = torch.library.Library("graphpass", "FRAGMENT")
_LIB.define("load_start(Tensor[] srcs, str group, Device device, Tensor[] after) -> Tensor")
_LIB.define("load_wait(Tensor ticket, Tensor[] srcs, str group, Device device, Tensor[] started) -> Tensor[]")
_LIB.define("evict(Tensor[] loaded, Tensor[] srcs, str group, Tensor[] after) -> Tensor")
_LIB.define("offload_guard(str module) -> ()")
_LIB.define("accumulate_grad(Tensor grad, Tensor handle) -> ()")
_LIB.define("unloaded_reads(Tensor[] weights, str compiled_for) -> ()")


def _records(srcs: List[torch.Tensor], group: str) -> list:
    recs = []
    for i, s in enumerate(srcs):
        rec = lookup(s)
        if rec is None:
            raise OffloadError(
                f"trap {group!r}: input {i} of its load is not a tensor graphpass.offload() manages "
                f"(shape {tuple(s.shape)}). Either the model was re-offloaded or its weights replaced after "
                f"compiling, or Dynamo reused this graph, compiled for a streamed instance of a class, for an "
                f"instance the offload does not stream: offload every instance of that class (include_patterns) "
                f"or none of them"
            )
        recs.append(rec)
    return recs


def _load_start(
    srcs: List[torch.Tensor], group: str, device: torch.device, after: List[torch.Tensor] = ()
) -> torch.Tensor:
    recs = _records(srcs, group)
    runtime = recs[0].runtime
    facts = recs[0].facts
    check_skipped_frames(facts)  # a frame Dynamo skipped may have run since (one counter read when not)
    group = facts.runtime_group(group, recs[0].name)
    ticket = runtime.start(recs, group)
    record_event("load", group)
    # The ticket is a tensor on the compute device (a host tensor in the graph would keep CUDA
    # graphs off it) whose number rides on the Python object: reading a device value back would
    # synchronize, and cannot be captured.
    out = torch.empty((), dtype=torch.int64, device=device)
    out._graphpass_ticket = ticket
    # a call that raises between the start and the wait drops its ticket: the load goes with it
    # (a weak reference whose callback is a bare deque append; the runtime drops the load at its
    # next start or stats read: OffloadRuntime.watch_ticket)
    runtime.watch_ticket(out, ticket)
    return out


def _load_start_fake(srcs, group, device, after=()):
    return torch.empty((), dtype=torch.int64, device=device)


def _load_wait(
    ticket: torch.Tensor, srcs: List[torch.Tensor], group: str, device: torch.device, started: List[torch.Tensor] = ()
) -> List[torch.Tensor]:
    # the start looked every input up; the wait needs the runtime only (its first input's)
    rec = _records(srcs[:1], group)[0]
    group = rec.facts.runtime_group(group, rec.name)
    out = rec.runtime.wait(getattr(ticket, "_graphpass_ticket", None), group)
    record_event("wait", group)
    return out


def _load_wait_fake(ticket, srcs, group, device, started=()):
    return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in srcs]


def _evict(
    loaded: List[torch.Tensor], srcs: List[torch.Tensor], group: str, after: List[torch.Tensor] = ()
) -> torch.Tensor:
    # ``srcs`` (the host tensors the group was loaded from) name the model whose counter this is.
    if srcs:
        rec = lookup(srcs[0])
        if rec is not None:
            group = rec.facts.runtime_group(group, rec.name)
            rec.runtime.evicted(group, loaded)
    record_event("evict", group)
    return _token(loaded)


def _token(loaded: List[torch.Tensor]) -> torch.Tensor:
    """The eviction's token, on the device of what it evicted (see the ticket of ``load_start``)."""
    return torch.zeros((), dtype=torch.int64, device=loaded[0].device if loaded else "cpu")


def _evict_fake(loaded, srcs, group, after=()):
    return _token(loaded)


def _nothing(*args, **kwargs) -> None:
    return None


def _guard(module: str) -> None:
    # "": traced by Dynamo into a graph that graphpass did not schedule (another backend), where the
    # module is not named (see offloading.install._guard_hook): name the modules it can be
    if module:
        who = f"module {module!r}"
    else:
        names = [n or "(the model itself)" for n in guarded_module_names()]
        shown = ", ".join(repr(n) for n in names[:6]) + (f", ... ({len(names)} modules)" if len(names) > 6 else "")
        who = (
            f"a module graphpass.offload() streams (one of {shown})"
            if names
            else "a module graphpass.offload() streams"
        )
    msg = (
        f"{who} holds weights that graphpass.offload() moved off the device, and it ran outside a "
        f"graph graphpass scheduled (an eager call, or torch.compile with another backend). Run it as "
        f"torch.compile(model, backend='graphpass') (any then= delegate) so the loads are in the graph."
    )
    skipped = dynamo_records.skipped_frames()
    if skipped:  # compiled with graphpass, but Dynamo ran the frame eagerly
        msg += "\n" + dynamo_records.skipped_frame_message(skipped)
    raise OffloadError(msg)


def _unloaded_reads(weights: List[torch.Tensor], compiled_for: str) -> None:
    """A graph without loads, traced from the forward frame of a module that holds no streamed tensor
    (``compiled_for``), runs for every instance of its class (Dynamo guards on neither), some of which
    do. Run for one of those, it reads what the model holds: host memory (right, but not streamed: a
    warning once per module) or device stand-ins (refused) (:func:`facts.runs_eagerly`)."""
    for w in weights:
        rec = lookup(w)
        if rec is None:
            continue
        facts = rec.facts
        module = max((g for g in facts.guarded_code if rec.name.startswith(g + ".") or not g), key=len, default=None)
        if module is None or module in facts.eager_warned:
            continue
        runs_eagerly(
            facts,
            module,
            f"it runs a graph Dynamo compiled for {compiled_for!r}, an instance of the same class "
            f"that streams nothing (the class's forward is a frame of its own: a graph break above it), which has "
            f"no loads",
            "offload every instance of that class or none (include_patterns / exclude_patterns), or "
            "remove the graph break above it (TORCH_LOGS=graph_breaks)",
        )


_LIB.impl("load_start", _load_start, "CompositeExplicitAutograd")
_LIB.impl("load_wait", _load_wait, "CompositeExplicitAutograd")
_LIB.impl("evict", _evict, "CompositeExplicitAutograd")
_LIB.impl("offload_guard", _guard, "CompositeExplicitAutograd")
_LIB.impl("unloaded_reads", _unloaded_reads, "CompositeExplicitAutograd")
torch.library.register_fake("graphpass::load_start", _load_start_fake, lib=_LIB)
torch.library.register_fake("graphpass::load_wait", _load_wait_fake, lib=_LIB)
torch.library.register_fake("graphpass::evict", _evict_fake, lib=_LIB)
torch.library.register_fake("graphpass::offload_guard", _nothing, lib=_LIB)
torch.library.register_fake("graphpass::unloaded_reads", _nothing, lib=_LIB)


def _wait_setup(ctx, inputs, output) -> None:
    srcs = inputs[1]
    ctx.src_meta = [(s.device, s.dtype, _is_stand_in(s)) for s in srcs]
    ctx.n_started = len(inputs[4])
    stand_ins = [s for s, (_, _, st) in zip(srcs, ctx.src_meta) if st]
    ctx.save_for_backward(*stand_ins)


def _is_stand_in(t: torch.Tensor) -> bool:
    """A graph input that stands in for offloaded bytes: the one-element expanded tensors the
    model holds on an accelerator (a host copy is never expanded)."""
    return t.dim() > 0 and t.numel() > 1 and all(st == 0 for st in t.stride())


def _wait_backward(ctx, grads):
    out = []
    stand_ins = iter(ctx.saved_tensors)
    for g, (device, dtype, stand_in) in zip(grads, ctx.src_meta):
        if g is None:
            out.append(None)
        elif stand_in:
            # the weight lives on the host: its gradient goes there, not to the stand-in
            torch.ops.graphpass.accumulate_grad(g, next(stand_ins))
            out.append(None)
        else:
            out.append(g.to(device=device, dtype=dtype))
    return None, out, None, None, [None] * ctx.n_started


def _accumulate_grad(grad: torch.Tensor, handle: torch.Tensor) -> None:
    rec = lookup(handle)
    if rec is None:
        raise OffloadError("a gradient for an offloaded weight reached graphpass, but its stand-in is not registered")
    rec.runtime.accumulate_grad(rec, grad)


_LIB.impl("accumulate_grad", _accumulate_grad, "CompositeExplicitAutograd")
torch.library.register_fake("graphpass::accumulate_grad", _nothing, lib=_LIB)
torch.fx.node.has_side_effect(torch.ops.graphpass.accumulate_grad.default)


torch.library.register_autograd("graphpass::load_wait", _wait_backward, setup_context=_wait_setup, lib=_LIB)

# --------------------------------------------------------------------------------------------
# Tensor parallel: DTensor arguments
# --------------------------------------------------------------------------------------------
# A DTensor weight (tensor parallel) is offloaded as its local shard: each rank streams its own
# bytes, and the ops run on the local shards; what a load returns is rewrapped with the spec
# (mesh, placements, global shape) of the tensor it stands for. No collective is added.


def _locals(ts) -> list:
    return [local_tensor(t) for t in ts]


def _dtensor_load_start(op_call, args, kwargs):
    srcs, group, device, *rest = args
    return op_call(_locals(srcs), group, device, *[_locals(r) for r in rest], **kwargs)


def _dtensor_load_wait(op_call, args, kwargs):
    ticket, srcs, group, device, *rest = args
    out = op_call(local_tensor(ticket), _locals(srcs), group, device, *[_locals(r) for r in rest], **kwargs)
    return [with_spec_of(o, s) if is_dtensor(s) else o for o, s in zip(out, srcs)]


def _dtensor_evict(op_call, args, kwargs):
    loaded, srcs, group, *rest = args
    return op_call(_locals(loaded), _locals(srcs), group, *[_locals(r) for r in rest], **kwargs)


# registered with the ops, here where they are defined, never by a pass
register_dtensor_handlers(
    {
        torch.ops.graphpass.load_start.default: _dtensor_load_start,
        torch.ops.graphpass.load_wait.default: _dtensor_load_wait,
        torch.ops.graphpass.evict.default: _dtensor_evict,
    }
)


# --------------------------------------------------------------------------------------------
# Tensor subclasses wrapping plain tensors (torchao's Int8Tensor)
# --------------------------------------------------------------------------------------------
# offload() streams the inner tensors (qdata, scale, ...) and the graph Dynamo hands graphpass
# reads the wrapper: a load op called with a wrapper reaches the wrapper type's
# ``__torch_dispatch__``, where the rules below take over: the op runs on the inner tensors, and
# what a load returns is wrapped again with the same type and metadata. Under AOTAutograd the rule
# runs while tracing, so the compiled graph holds the ops on the inner tensors alone.


def _flat_args(args) -> list:
    """Every tensor-list argument with its wrappers replaced by their inner tensors (``after`` may
    hold a wrapper too: the output of a trap's last reader, when the wrapper type propagates)."""
    return [flatten_wrappers(a)[0] if isinstance(a, (list, tuple)) else a for a in args]


def _wrapped_load_start(cls, func, types, args, kwargs):
    return func(*_flat_args(args), **(kwargs or {}))


def _wrapped_load_wait(cls, func, types, args, kwargs):
    metas = flatten_wrappers(args[1])[1]  # (ticket, srcs, ...): the loads come back as the srcs were
    return unflatten_wrappers(func(*_flat_args(args), **(kwargs or {})), metas)


def _wrapped_evict(cls, func, types, args, kwargs):
    return func(*_flat_args(args), **(kwargs or {}))


_WRAPPED_RULES = {"load_start": _wrapped_load_start, "load_wait": _wrapped_load_wait, "evict": _wrapped_evict}


def let_wrappers_through(types) -> None:
    """Register the load ops' rules for these wrapper subclass types (idempotent). Called by
    ``offload()`` for the wrapper types whose inner tensors it streams (the types are known there,
    not where the ops are defined), never by a pass. The rules live in torch's per-op table
    (process-wide by nature, like the ops themselves), keyed by our ops."""
    from torch._library.simple_registry import singleton

    for cls in types:
        for name, rule in _WRAPPED_RULES.items():
            holder = singleton.find(f"graphpass::{name}").torch_dispatch_rules
            if holder.find(cls) is None:
                torch.library.register_torch_dispatch(f"graphpass::{name}", cls, rule, lib=_LIB)


LOAD_START = torch.ops.graphpass.load_start.default
LOAD_WAIT = torch.ops.graphpass.load_wait.default
EVICT = torch.ops.graphpass.evict.default
OFFLOAD_GUARD = torch.ops.graphpass.offload_guard.default
OFFLOAD_GUARD_TARGETS = (OFFLOAD_GUARD, torch.ops.graphpass.offload_guard)  # Dynamo records the packet

torch.fx.node.has_side_effect(EVICT)
torch.fx.node.has_side_effect(OFFLOAD_GUARD)
UNLOADED_READS = torch.ops.graphpass.unloaded_reads.default
torch.fx.node.has_side_effect(UNLOADED_READS)
torch.fx.node.has_side_effect(torch.ops.graphpass.offload_guard)


def is_guard(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in OFFLOAD_GUARD_TARGETS
