"""The custom ops graphpass inserts into graphs, and the runtime state they touch.

``graphpass::trap_enter(label, deps)`` and ``graphpass::trap_exit(label, deps)`` mark where a trap
starts and ends. They return nothing and are registered as side-effecting, so neither FX dead-code
elimination, AOTAutograd nor inductor removes them; ``deps`` are the activations that flow into
(enter) or out of (exit) the trap, which orders them against the trap's compute by a real data
dependency. At run time they open and close a ``torch.profiler.record_function`` range named
``graphpass.trap/<label>`` while a profiler is active, and report to any :func:`trace_traps`
recorder of the current context.

State lives in a ``contextvars.ContextVar`` (one stack per thread / task), never in a module global
that two models or threads could share.
"""

from __future__ import annotations

import contextlib
import warnings
import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional

import torch

from .fx_utils import owned_tensors, relocated, tensor_keys
from .tensor_utils import local_tensor, register_dtensor_handlers

PROFILE_PREFIX = "graphpass.trap/"


@dataclass
class _RuntimeState:
    open_ranges: list = field(default_factory=list)  # [(label, record_function handle or None)]
    recorders: tuple = ()


_STATE: contextvars.ContextVar[_RuntimeState | None] = contextvars.ContextVar("graphpass_runtime", default=None)


def _state() -> _RuntimeState:
    st = _STATE.get()
    if st is None:
        st = _RuntimeState()
        _STATE.set(st)
    return st


def record_event(kind: str, label: str) -> None:
    """Report ``(kind, label)`` to every :func:`trace_traps` recorder of the current context."""
    st = _STATE.get()
    if st is not None:
        for rec in st.recorders:
            rec.append((kind, label))


def _profiler_on() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


# Defined with torch.library.Library rather than torch.library.custom_op: the ops return nothing
# and need no autograd formula, and a direct CompositeExplicitAutograd kernel costs ~4 us a call
# against ~18 us through custom_op's wrapper (measured here; it matters for small models).
_LIB = torch.library.Library("graphpass", "FRAGMENT")
_LIB.define(
    "trap_enter(str label, Tensor[] deps, bool profile=True, Tensor[]? owner=None, str owner_fqn='', int model=0) -> ()"
)
_LIB.define(
    "trap_exit(str label, Tensor[] deps, bool profile=True, Tensor[]? owner=None, str owner_fqn='', int model=0) -> ()"
)


# --------------------------------------------------------------------------------------------
# Labels of a graph Dynamo shares between instances
# --------------------------------------------------------------------------------------------
# A graph traced from one block's own frame (after a graph break inside the block) is run by
# Dynamo for every other block of the class whose guards pass: its boundaries carry the label of
# the block it was traced from. Such boundaries also carry ``owner`` (a weight of the trap, as the
# block that runs holds it), ``owner_fqn`` (where that weight sat when traced) and ``model`` (a key
# of the enclosing model): the label is then resolved to where the owner weight sits now.
# Process-wide on purpose, as the ops can carry no object: keys are ``id``s of live models (each
# entry dies with its model) and the owned-tensor tables are per model.
_TRAP_MODELS: dict[int, weakref.ref] = {}
_OWNED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_RESOLVED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def trap_model_key(model: torch.nn.Module) -> int:
    """The key a boundary carries for ``model`` (the enclosing model of a shared graph)."""
    key = id(model)
    if key not in _TRAP_MODELS or _TRAP_MODELS[key]() is not model:
        _TRAP_MODELS[key] = weakref.ref(model, lambda _, k=key: _TRAP_MODELS.pop(k, None))
    return key


def _resolved_label(label: str, owner: List[torch.Tensor], owner_fqn: str, model_key: int) -> str:
    ref = _TRAP_MODELS.get(model_key) if owner else None
    model = ref() if ref is not None else None
    if model is None:
        return label
    keys = tensor_keys(owner[0])
    cache = _RESOLVED.setdefault(model, {})
    hit = cache.get((label, keys[0]))
    if hit is not None:
        return hit
    owned = _OWNED.get(model)
    if owned is None or not any(k in owned for k in keys):
        owned = _OWNED[model] = owned_tensors(model)  # built once, rebuilt for a tensor it does not know
    fqns = next((owned[k] for k in keys if k in owned), [])
    cache[(label, keys[0])] = out = _relabel(label, owner_fqn, fqns)
    return out


def _relabel(label: str, owner_fqn: str, fqns: list[str]) -> str:
    """``label`` moved to where the owner weight sits now (``fqns``); unchanged when the weight did
    not move, or when where it sits does not name one module (the capture registry's rule)."""
    if not fqns or owner_fqn in fqns:
        return label
    found = relocated(label, owner_fqn, fqns)
    return found[0] if len(found) == 1 and found[0] else label


def trap_enter(
    label: str,
    deps: List[torch.Tensor],
    profile: bool = True,
    owner: Optional[List[torch.Tensor]] = None,
    owner_fqn: str = "",
    model: int = 0,
) -> None:
    st = _state()
    label = _resolved_label(label, owner, owner_fqn, model) if owner else label
    handle = None
    if profile and _profiler_on():
        handle = torch.ops.profiler._record_function_enter_new(PROFILE_PREFIX + label, None)
    st.open_ranges.append((label, handle))
    record_event("enter", label)


def trap_exit(
    label: str,
    deps: List[torch.Tensor],
    profile: bool = True,
    owner: Optional[List[torch.Tensor]] = None,
    owner_fqn: str = "",
    model: int = 0,
) -> None:
    st = _state()
    label = _resolved_label(label, owner, owner_fqn, model) if owner else label
    # Close the innermost open range with this label (and any left open inside it by an
    # exception or a graph break); an exit without an enter closes nothing.
    for i in range(len(st.open_ranges) - 1, -1, -1):
        if st.open_ranges[i][0] == label:
            for _, handle in reversed(st.open_ranges[i:]):
                if handle is not None:
                    torch.ops.profiler._record_function_exit._RecordFunction(handle)
            del st.open_ranges[i:]
            break
    record_event("exit", label)


def _nothing(*args, **kwargs) -> None:
    return None


for _name, _fn in (("trap_enter", trap_enter), ("trap_exit", trap_exit)):
    _LIB.impl(_name, _fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"graphpass::{_name}", _nothing, lib=_LIB)


TRAP_ENTER = torch.ops.graphpass.trap_enter.default
TRAP_EXIT = torch.ops.graphpass.trap_exit.default
BOUNDARY_OPS = (TRAP_ENTER, TRAP_EXIT)

for _op in BOUNDARY_OPS:
    torch.fx.node.has_side_effect(_op)


_ENTER_TARGETS = (TRAP_ENTER, torch.ops.graphpass.trap_enter)  # Dynamo records the packet
_EXIT_TARGETS = (TRAP_EXIT, torch.ops.graphpass.trap_exit)
BOUNDARY_TARGETS = _ENTER_TARGETS + _EXIT_TARGETS  # what fx_utils.find_calls looks up


def is_enter(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _ENTER_TARGETS


def is_exit(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _EXIT_TARGETS


def is_boundary(node: torch.fx.Node) -> bool:
    return is_enter(node) or is_exit(node)


@contextlib.contextmanager
def trace_traps(recorder: Any = None) -> Iterator[Any]:
    """Record ``("enter"|"exit", label)`` for every trap boundary that runs in this context, and
    ``("load"|"wait"|"evict", label)`` for every offload step.

    >>> with graphpass.trace_traps() as events:
    ...     compiled(x)

    ``recorder``: any object with ``append((kind, label))`` to report to instead of a new list
    (``graphpass.trace`` passes one that timestamps the events).
    """
    st = _state()
    events: Any = [] if recorder is None else recorder
    st.recorders = st.recorders + (events,)
    try:
        yield events
    finally:
        st.recorders = tuple(r for r in st.recorders if r is not events)


class trap_block(contextlib.ContextDecorator):
    """Mark a manual trap in model code: ``with graphpass.trap_block("encoder"): ...``.

    Under ``torch.compile`` the enter/exit calls are traced into the graph as boundary nodes and
    every node between them belongs to the trap ``name`` (as do the tensors those nodes read).
    Run eagerly, it opens the same profiler range. A trap is a region, not an offload: weights it
    reads are offloaded only when ``graphpass.offload`` selects them.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            from .errors import ConfigError

            raise ConfigError(type(self).__name__, name, "a manual trap needs a non-empty string name")
        self.name = name

    def __enter__(self) -> "trap_block":
        torch.ops.graphpass.trap_enter(self.name, [])
        return self

    def __exit__(self, *exc) -> bool:
        torch.ops.graphpass.trap_exit(self.name, [])
        return False


class offload_block(trap_block):
    """Deprecated alias of :class:`trap_block` (the old name said "offload" for a region that
    offloads nothing by itself). Warns once per call site outside a compiled region."""

    def __init__(self, name: str) -> None:
        if not torch.compiler.is_compiling():
            warnings.warn(
                "graphpass.offload_block is deprecated: use graphpass.trap_block (same arguments); "
                "a trap marks a region, offload() chooses what to offload",
                DeprecationWarning,
                stacklevel=2,
            )
        super().__init__(name)


def _local_boundary(op_call, args, kwargs):
    """DTensor handler for the boundary ops: they read no data, so they take the local shards
    (no sharding strategy, no redistribution, so no collective a boundary could add)."""
    label, deps, *rest = args
    local = [local_tensor(d) for d in deps]
    if "owner" in kwargs:
        kwargs = {**kwargs, "owner": [local_tensor(o) for o in kwargs["owner"]]}
    if len(rest) > 1:
        rest[1] = [local_tensor(o) for o in rest[1]]
    return op_call(label, local, *rest, **kwargs)


# The boundary ops take DTensor deps (tensor parallel, FSDP2) as their local shards: registered
# with the ops, here where they are defined, never by a pass.
register_dtensor_handlers({op: _local_boundary for op in BOUNDARY_OPS})
