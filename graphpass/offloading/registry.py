"""The records of offloaded tensors, found from the tensor itself.

One :class:`OffloadedTensor` per tensor graphpass streams (where its bytes live, the model state it
belongs to); :data:`REGISTRY` maps the storage address of every live one to its record. The ops
look a record up from the tensor that reaches them at run time, never from the graph: Dynamo may run
one compiled graph for several instances of a model class.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import OffloadError
from ..tensor_utils import is_wrapper_subclass, local_tensor, wrapper_fields
from .facts import OffloadFacts
from .safetensors_io import TensorLocation


@dataclass(eq=False)
class OffloadedTensor:
    """One tensor graphpass streams: where its bytes live and the model state it belongs to."""

    name: str  # first FQN (``layers.0.mlp.up.weight``, ``layers.0.up.weight.scale``)
    fqns: tuple[str, ...]
    unit: str  # the budget unit it was planned with
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    host: torch.Tensor  # the bytes on the host: host copy (cpu/pinned); disk: an untouched stand-in
    # (on a host device a private mapping of its file region, for code Dynamo runs eagerly: map_private)
    location: Optional[TensorLocation]  # disk: where its bytes are
    handle: Optional[torch.Tensor] = None  # what the model holds when it is not ``host`` (CUDA: a stand-in)
    runtime: Any = field(repr=False, default=None)  # its model's OffloadRuntime: moves it (run time)
    facts: OffloadFacts = field(repr=False, default=None)  # type: ignore[assignment]  # its model's decisions (compile time)

    @property
    def key(self) -> torch.Tensor:
        """The tensor that reaches the graph (and identifies this record at run time)."""
        return self.handle if self.handle is not None else self.host


class _Registry:
    """Storage address -> record, for live offloaded tensors only (weak both ways)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ptr: dict[int, weakref.ref] = {}

    def add(self, rec: OffloadedTensor) -> None:
        ptr = rec.key.untyped_storage().data_ptr()
        with self._lock:
            self._by_ptr[ptr] = weakref.ref(rec)

    def remove(self, rec: OffloadedTensor) -> None:
        ptr = rec.key.untyped_storage().data_ptr()
        with self._lock:
            ref = self._by_ptr.get(ptr)
            if ref is not None and ref() in (rec, None):
                del self._by_ptr[ptr]

    def lookup(self, t: Any) -> OffloadedTensor | None:
        t = local_tensor(t)  # a DTensor's record is its local shard's (tensor parallel: each rank streams its own)
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
            return None
        try:  # a tensor without a storage of its own (a sparse tensor) is never offloaded
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        ref = self._by_ptr.get(ptr)
        rec = ref() if ref is not None else None
        if (
            rec is None
            or rec.key.untyped_storage().data_ptr() != ptr
            or tuple(t.shape) != rec.shape
            or t.device != rec.key.device
        ):
            return None
        return rec

    def runtimes(self) -> list:
        """The runtimes of the live records (one per offloaded model)."""
        with self._lock:
            refs = list(self._by_ptr.values())
        found = {}
        for ref in refs:
            runtime = getattr(ref(), "runtime", None)
            if runtime is not None:
                found[id(runtime)] = runtime
        return list(found.values())

    def after_fork_in_child(self) -> None:
        """In a child made by ``fork()``: a lock another thread held is not the child's."""
        self._lock = threading.Lock()


# Process-wide on purpose: a storage address names one tensor in the whole process, so one table
# answers for every model (each record points at its own model's runtime); entries are weak and
# removed with their model's state, and the table is locked.
REGISTRY = _Registry()


def lookup(t: Any) -> OffloadedTensor | None:
    """The offload record of ``t`` if ``t`` is a tensor graphpass.offload() moved off the device."""
    return REGISTRY.lookup(t)


def facts_guarding(module: str) -> list[OffloadFacts]:
    """The facts of live offloaded models with a guarded module of that name (its FQN): read by the
    offload pass when a graph holds a module's hooks alone (no offloaded input to find them from)."""
    return [rt.facts for rt in REGISTRY.runtimes() if module in rt.facts.guarded_code]


def guarded_module_names() -> list[str]:
    """The FQNs of the guarded modules of every live offloaded model (for an error raised where the
    module at fault is not known: a graph another backend compiled, see :func:`offloading.ops._guard`)."""
    return [n for rt in REGISTRY.runtimes() for n in rt.facts.guarded_code]


@dataclass(eq=False)
class WrappedOffload:
    """A tensor subclass input (torchao's ``Int8Tensor``) whose inner tensors graphpass streams:
    the graph reads the wrapper, the loads move ``inner`` (see :mod:`graphpass.offloading.ops`)."""

    name: str  # the wrapper's FQN (``layers.0.fc.weight``)
    inner: tuple[OffloadedTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.inner)

    @property
    def runtime(self) -> Any:
        return self.inner[0].runtime

    @property
    def facts(self) -> OffloadFacts:
        return self.inner[0].facts

    @property
    def location(self) -> Optional[TensorLocation]:
        return next((r.location for r in self.inner if r.location is not None), None)


def lookup_input(t: Any) -> OffloadedTensor | WrappedOffload | None:
    """The offload record of a graph input: a streamed tensor's, or, for a wrapper subclass whose
    inner tensors are streamed, all of theirs (:class:`WrappedOffload`). A wrapper streamed in part
    is an error (offload() plans a wrapper's inner tensors together)."""
    rec = lookup(t)
    if rec is not None or not is_wrapper_subclass(t):
        return rec
    fields = wrapper_fields(t)
    recs = [lookup(v) for _, v in fields]
    if not any(recs):
        return None
    missing = [n for (n, _), r in zip(fields, recs) if r is None]
    if missing:
        raise OffloadError(
            f"tensor subclass {type(t).__name__} holds inner tensors graphpass.offload() streams "
            f"({next(r.name for r in recs if r)!r}) and others it does not ({', '.join(missing)}): its inner tensors "
            f"were replaced after offload(); offload the model again on a fresh instance"
        )
    return WrappedOffload(recs[0].name.rsplit(".", 1)[0], tuple(recs))


def plain_records(recs) -> list[OffloadedTensor]:
    """The records of plain tensors behind ``recs`` (a :class:`WrappedOffload`'s inner ones)."""
    return [r for rec in recs for r in (rec.inner if isinstance(rec, WrappedOffload) else (rec,))]


# --------------------------------------------------------------------------------------------
