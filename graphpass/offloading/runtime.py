"""The ops the offload pass inserts, and the per-model runtime they drive.

``graphpass::load_start(srcs, group, device, after) -> ticket`` allocates device memory for the tensors of
one trap and starts copying them there: on CUDA on a side stream (from page-locked host memory, or
from disk through reused page-locked staging buffers read by a background worker); on a host
device by a background worker (a copy, or a read from disk). It returns a small ticket tensor.

``graphpass::load_wait(ticket, srcs, group, device, started) -> loaded`` waits for that transfer (the
compute stream waits on the side stream's event, or the worker's job is joined) and returns the
device tensors. The ticket is a real data dependency from start to wait; consumers read the
returned tensors, so nothing orders the pair but data. Its autograd formula sends each gradient
back to the host tensor it was loaded from.

``graphpass::evict(loaded, srcs, group, after) -> token`` is the last reader of a trap's loaded
tensors: it runs after ``after`` (the output of the trap's last reader), and once it has run the
graph holds no reference to them, so their memory is returned. It counts the eviction.

The order is carried by data, so a delegate that reorders nodes (inductor does) keeps it: the load
``prefetch_distance`` traps ahead takes the token of the eviction before it (``after``), and the
wait of the current trap takes that load's ticket (``started``). A load therefore starts after the
previous trap's eviction and before the current trap's compute, no earlier and no later.

``graphpass::accumulate_grad(grad, handle)`` adds a gradient to the host copy behind a device
stand-in (the backward of ``load_wait`` calls it on an accelerator, where the model holds
stand-ins rather than the weights).

``graphpass::offload_guard(module)`` is what the forward pre-hook of an offloaded module calls:
the offload pass deletes it from graphs it schedules; anywhere else (an eager call, another
backend) it runs and raises a clear error instead of computing with weights that are not there.

Residency is measured, not inferred: every loaded tensor carries a finalizer that lowers the
model's resident byte count when its memory is actually released.

Which model a tensor belongs to is looked up from the tensor that reaches the op at run time
(the address of its storage, checked against a weak reference), never baked into the graph:
Dynamo may run one compiled graph for several instances of a model class.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import itertools
import logging
import mmap
import os
import threading
import time
import warnings
import weakref
import queue
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import OffloadError
from ..tensor_utils import is_wrapper_subclass, local_tensor, wrapper_fields
from ..trace_events import EVICT, WAIT, active_sink, record_span
from .files import identity, same_file
from .leases import FileLeases, RegionRef, handler_installed, reap
from .safetensors_io import TensorLocation, read_into
from .facts import GuardedCode, OffloadFacts, refuse_unpinned_cuda_graph_loads  # noqa: F401 (GuardedCode re-exported)
from .graph_slots import GraphSlots, use_count

_log = logging.getLogger("graphpass.offloading.runtime")

# A load the worker has not finished after this long is an error, not a hang (a hung mount, a bug).
LOAD_TIMEOUT_S = 600

# --------------------------------------------------------------------------------------------
# Records: one per offloaded tensor, found from the tensor itself
# --------------------------------------------------------------------------------------------


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
    runtime: "OffloadRuntime" = field(repr=False, default=None)  # type: ignore[assignment]  # moves it (run time)
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
        if rec is None or rec.key.untyped_storage().data_ptr() != ptr or tuple(t.shape) != rec.shape \
                or t.device != rec.key.device:
            return None
        return rec

    def runtimes(self) -> list["OffloadRuntime"]:
        """The runtimes of the live records (one per offloaded model)."""
        with self._lock:
            refs = list(self._by_ptr.values())
        found = {}
        for ref in refs:
            runtime = getattr(ref(), "runtime", None)
            if runtime is not None:
                found[id(runtime)] = runtime
        return list(found.values())


# The live runtimes, for the fork hook below (process-wide on purpose: fork is; weak).
_RUNTIMES: "weakref.WeakSet[OffloadRuntime]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    REGISTRY._lock = threading.Lock()
    for runtime in list(_RUNTIMES):
        runtime.after_fork_in_child()


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
    def runtime(self) -> "OffloadRuntime":
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
# Stats
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryStats:
    """What the offload runtime measured for one model (``graphpass.memory_stats(compiled)``).

    bytes_loaded / loads_issued: bytes and tensors copied to the device by trap loads.
    peak_streamed_bytes: the most bytes of streamed tensors alive on the device at once (counted
        when a load allocates, uncounted when the memory is released).
    resident_bytes: bytes the budget keeps on the device all the time.
    peak_resident_bytes: resident_bytes + peak_streamed_bytes.
    wait_seconds: time the compute spent waiting for loads that had not finished.
    evictions: trap evictions run; groups_loaded: trap loads started.
    buffer_pool_bytes: memory held by the reused load buffers on a host device (they are the
        device memory of streamed tensors there: it settles at the schedule's peak).
    """

    bytes_loaded: int = 0
    loads_issued: int = 0
    groups_loaded: int = 0
    evictions: int = 0
    streamed_bytes_now: int = 0
    peak_streamed_bytes: int = 0
    resident_bytes: int = 0
    wait_seconds: float = 0.0
    buffer_pool_bytes: int = 0

    @property
    def peak_resident_bytes(self) -> int:
        return self.resident_bytes + self.peak_streamed_bytes

    def __str__(self) -> str:
        from tabulate import tabulate

        rows = [
            ("bytes loaded", f"{self.bytes_loaded:,}"),
            ("loads issued (tensors)", self.loads_issued),
            ("trap loads / evictions", f"{self.groups_loaded} / {self.evictions}"),
            ("resident (budget) bytes", f"{self.resident_bytes:,}"),
            ("peak streamed bytes", f"{self.peak_streamed_bytes:,}"),
            ("peak resident offloaded bytes", f"{self.peak_resident_bytes:,}"),
            ("streamed bytes now", f"{self.streamed_bytes_now:,}"),
            ("time waiting on loads", f"{self.wait_seconds * 1e3:.2f} ms"),
            ("reused load buffers (host device)", f"{self.buffer_pool_bytes:,}"),
        ]
        return tabulate(rows, headers=("graphpass offload", "value"))


class _Job:
    """One job of a :class:`_Worker`; its outcome comes back through a C ``SimpleQueue``."""

    __slots__ = ("fn", "args", "done", "worker")

    def __init__(self, fn, args, worker: "_Worker") -> None:
        self.fn, self.args, self.done, self.worker = fn, args, queue.SimpleQueue(), worker

    def run(self) -> None:
        try:
            outcome = (True, self.fn(*self.args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome = (False, exc)
        self.done.put(outcome)

    def result(self, timeout: float):
        """The job's return value (its exception re-raised); OffloadError when the worker is gone or
        it does not finish in ``timeout`` seconds. Polled in short slices: a dead worker is seen at once."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok, value = self.done.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                break
            except queue.Empty:
                if not self.worker.alive():
                    raise OffloadError(f"the offload worker of this load is gone ({self.worker.why_dead()}): "
                                       f"nothing was computed with partial weights") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError from None
        if not ok:
            raise value
        return value


class _Worker:
    """The offload worker: one daemon thread running jobs in order from a C ``SimpleQueue``.

    Not a ``ThreadPoolExecutor``: its ``submit`` and ``Future.result`` go through Python-level
    locks (``threading.Condition``, ``Semaphore``) whose ``__enter__`` a ``KeyboardInterrupt`` can
    split right after the lock was taken, leaking it: the next ``submit`` blocked forever, or the
    worker blocked in ``set_result`` and every later load waited out ``LOAD_TIMEOUT_S`` (issue 22,
    item 8). Here the compute thread only calls ``SimpleQueue.put``/``get`` (C, atomic for Python)
    and the worker blocks on nothing the compute thread holds. Signals never run Python code on
    the worker (Python runs handlers in the main thread only)."""

    def __init__(self, name: str) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(self._jobs,), name=name, daemon=True)
        self._thread.start()

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            job.run()
            del job

    def submit(self, fn, *args) -> _Job:
        job = _Job(fn, args, self)
        self._jobs.put(job)
        return job

    def alive(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()

    def why_dead(self) -> str:
        if self.pid != os.getpid():
            return f"it ran in process {self.pid}, and this is a child made by fork()"
        return "its thread exited"

    def shutdown(self, timeout: float | None = None) -> None:
        self._jobs.put(None)
        if self.alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class _TicketRef(weakref.ref):
    __slots__ = ("ticket",)


@dataclass
class _Pending:
    dsts: Optional[list]  # None while the worker maps them (disk -> host device)
    future: Optional[_Job] = None
    event: Any = None  # torch.cuda.Event the compute stream waits on
    owner: tuple = ()
    mapped: tuple = ()  # the records whose file regions are mapped: their files are checked again at the wait
    ticket_ref: Any = None  # a weak reference to the ticket tensor: its death (no wait) drops this load


class _StagingPool:
    """Reused page-locked host buffers for disk -> CUDA loads: no host allocation per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            best = None
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes and (best is None or buf.numel() < self._free[best].numel()):
                    best = i
            if best is not None:
                return self._free.pop(best)
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)



# Disk -> host device: read-only private mappings of the file region, made with libc through
# ctypes (which releases the GIL for the call, unlike Python's mmap module) and unmapped by a
# finalizer when the tensor dies; a weight is never copied. The worker asks the kernel to read
# the region ahead (POSIX_FADV_WILLNEED) and maps it. It also fills the page tables
# (MAP_POPULATE) when a core is left over by torch's compute threads; without one, populating in
# the worker competes with the compute and was measured slower (2-core machine, both batch sizes)
# than letting the compute fault the pages in as it reads them.
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        return libc
    except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
        return None


_LIBC = _libc()
_MAP_FLAGS = mmap.MAP_PRIVATE if _LIBC is not None and hasattr(mmap, "MAP_PRIVATE") else None
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _spare_core() -> bool:
    """Is there a core the compute does not use? Then the worker fills the page tables."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


def _over_region(addr: int, length: int, delta: int, nbytes: int, dtype: torch.dtype, shape, track) -> torch.Tensor:
    """A tensor over ``nbytes`` of the mapping at ``addr`` (from byte ``delta``); ``track(region)`` arranges
    the unmapping once the last tensor over it is freed (no ``weakref.finalize``: its Python frame is
    a place a ``KeyboardInterrupt`` lands, printing "Exception ignored" and leaking the mapping)."""
    region = (ctypes.c_char * length).from_address(addr)
    track(region)
    with warnings.catch_warnings():  # torch warns for read-only buffers (a populated mapping)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=delta)
    return flat.view(dtype).view(shape)


def map_private(fd: int, loc: TensorLocation, dtype: torch.dtype, shape, leases: FileLeases) -> torch.Tensor | None:
    """``loc``'s bytes as a tensor over a private, copy-on-write mapping of its file region: no page
    is read until something reads it, a write lands in a private copy (never in the file), and it
    is unmapped when the tensor dies. What a host-device model holds for a tensor streamed from disk
    (``install._map_disk_stand_ins``): only code Dynamo runs eagerly reads it (a skipped frame, a
    weight read outside the graph). It is mapped only under a read lease of the file and registered
    with ``leases`` (held for the model's life): a writer of the file waits while the break copies
    it, so an eager reader keeps the bytes ``offload()`` found, never the new ones, never ``SIGBUS``.
    None where it cannot map: no libc ``mmap``, an empty region, one misaligned for ``dtype``, no
    lease (see ``leases.py``), or a failed call."""
    if _MAP_FLAGS is None or loc.nbytes == 0:
        return None
    start = loc.offset - loc.offset % mmap.ALLOCATIONGRANULARITY
    delta = loc.offset - start
    if delta % dtype.itemsize:
        return None
    length = delta + loc.nbytes
    with leases.lock:  # a lease break waits until the region is registered
        if not leases.lease(fd):
            return None
        addr = _LIBC.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, _MAP_FLAGS, fd, start)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        return _over_region(addr, length, delta, loc.nbytes, dtype, shape,
                            lambda region: leases.register(addr, length, fd, loc.offset + loc.nbytes, region, held=True))


class OffloadRuntime:
    """Per-model transfer engine: tickets, the worker, the CUDA side stream, open files, pools and
    the counters. What to move, from where and how far ahead is in its :class:`OffloadFacts`
    (``facts``), which it reads and never changes."""

    def __init__(self, facts: OffloadFacts) -> None:
        self.facts = facts
        # re-entrant: a finalizer (memory released) may run while this thread holds it
        self._lock = threading.RLock()
        self._evict_events: dict[int, Any] = {}  # CUDA: thread -> event after its last eviction
        self._tickets = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._latest: dict[tuple, int] = {}  # (thread, group) -> ticket: an aborted call's loads are dropped
        self._executor: _Worker | None = None
        self._stream = None
        self._fds: dict[str, int] = {}
        self._ids: dict[str, tuple] = {}  # path -> identity() when offload() resolved it
        self._staging = _StagingPool()
        self._leases = FileLeases(_LIBC)  # read leases on mapped files (a writer waits, see leases.py)
        self._pool: dict[int, list] = {}  # nbytes -> storages of reused load buffers (host devices)
        self._retired: list = []  # evicted tensors the worker releases at its next job
        self._grads_pending: list[_Job] = []  # gradient additions of the running backward pass (CUDA)
        self._grad_stream = None
        self._grad_task = -1  # the backward pass (autograd graph task) whose end waits for them
        # Counters that must survive interruptions (KeyboardInterrupt lands between any two lines):
        # what is alive is not counted up and down by finalizers but read off weak references to
        # the loaded tensors when asked (``_live``), and the cumulative counters are replaced in
        # one assignment, so an interrupted update is all or nothing.
        self._live: list[tuple[weakref.ref, int]] = []
        self._abandoned: collections.deque = collections.deque()  # tickets whose tensor died (appended by a finalizer)
        self._stats = dict(bytes_loaded=0, loads_issued=0, groups_loaded=0, evictions=0,
                           peak_streamed_bytes=0, wait_seconds=0.0)
        self._closed = False
        self._forked_cuda = 0  # the parent's pid in a child made by fork() of a CUDA runtime (refused)
        _RUNTIMES.add(self)

    # ---------------------------------------------------------------- facts it reads
    @property
    def config(self) -> Any:
        return self.facts.config

    @property
    def device(self) -> torch.device:
        return self.facts.device

    @property
    def storage(self) -> str:
        return self.facts.storage

    @property
    def resident_bytes(self) -> int:
        return self.facts.resident_bytes

    # ---------------------------------------------------------------- counters
    def stats(self) -> MemoryStats:
        self._drain_abandoned()
        with self._lock:
            now = self._streamed_now()
            pool = sum(s.nbytes() for storages in self._pool.values() for s in storages)
            return MemoryStats(resident_bytes=self.resident_bytes, streamed_bytes_now=now, buffer_pool_bytes=pool,
                               **self._stats)

    def reset_stats(self) -> None:
        self._drain_abandoned()
        with self._lock:
            self._stats = dict(bytes_loaded=0, loads_issued=0, groups_loaded=0, evictions=0,
                               peak_streamed_bytes=self._streamed_now(), wait_seconds=0.0)  # the pool keeps its size

    def _streamed_now(self) -> int:
        """Bytes of loaded tensors alive now (the truth, whatever was interrupted); prunes the dead."""
        live = [(ref, n) for ref, n in self._live if ref() is not None]
        self._live = live
        return sum(n for _, n in live)

    def _allocated(self, dsts: list, nbytes: int) -> None:
        refs = [(weakref.ref(d), d.numel() * d.element_size()) for d in dsts]
        with self._lock:
            self._live = self._live + refs
            now = self._streamed_now()
            s = self._stats
            self._stats = {**s, "peak_streamed_bytes": max(s["peak_streamed_bytes"], now), "bytes_loaded": s["bytes_loaded"] + nbytes,
                           "loads_issued": s["loads_issued"] + len(dsts), "groups_loaded": s["groups_loaded"] + 1}

    def _count(self, key: str, amount) -> None:
        with self._lock:
            self._stats = {**self._stats, key: self._stats[key] + amount}

    def _drain_abandoned(self) -> None:
        """Drop the loads of tickets that died without a wait (a call that raised between the two)."""
        while True:
            try:
                ref = self._abandoned.popleft()
            except IndexError:
                return
            self._take(ref.ticket)

    def watch_ticket(self, out: torch.Tensor, ticket: int) -> None:
        """Drop the load of ``ticket`` if ``out`` (its ticket tensor) dies without a wait: a weak reference
        whose callback is ``_abandoned.append`` (a C call: no Python frame an interrupt could split,
        unlike ``weakref.finalize``), held by the pending load, so it goes unheard once waited."""
        ref = _TicketRef(out, self._abandoned.append)
        ref.ticket = ticket
        pending = self._pending.get(ticket)
        if pending is not None:
            pending.ticket_ref = ref

    def after_fork_in_child(self) -> None:
        """In a child made by ``fork()``: the parent's worker thread, its loads in flight and the locks
        other threads held are not the child's. Start afresh (a new worker on first use), and reopen
        the files, so that the child's leases are its own (see ``leases.py``). A CUDA runtime is
        refused at its next load (CUDA does not survive fork)."""
        parent = self._executor.pid if self._executor is not None else 0
        self._lock = threading.RLock()
        self._staging = _StagingPool()
        self._executor = None
        self._pending, self._latest, self._retired = {}, {}, []
        self._abandoned = collections.deque()
        self._evict_events, self._grads_pending, self._grad_task = {}, [], -1
        if self.device.type == "cuda":
            self._forked_cuda = parent or -1
        reopened = {}
        for path, fd in list(self._fds.items()):
            try:
                new = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            if same_file(self._ids.get(path), identity(os.fstat(new))):
                reopened[fd] = self._fds[path] = new
                os.close(fd)  # the parent's description (and its lease) stays the parent's
            else:  # replaced since (renamed over): keep reading the inherited description, never lease it
                os.close(new)
        self._leases.after_fork(reopened)

    # ---------------------------------------------------------------- resources
    def _submit(self, group: str, job: Any, recs: list, *args: Any) -> _Job:
        """Run ``job(recs, *args)`` on the worker; while graphpass.trace() records, as a load range there."""
        sink = active_sink()  # read here, on the compute thread: the worker does not share its context
        if sink is not None:
            job = sink.worker_job(group, job, tensors=len(recs), nbytes=sum(r.nbytes for r in recs))
        return self._worker().submit(job, recs, *args)

    def _worker(self) -> _Worker:
        """The worker, started on first use, and again where it is gone (a child made by fork, whose
        copy of the parent's worker has no thread; ``after_fork_in_child`` drops it there first)."""
        worker = self._executor
        if worker is None or not worker.alive():
            with self._lock:
                worker = self._executor
                if worker is None or not worker.alive():
                    worker = self._executor = _Worker("graphpass-offload")
        return worker

    def _side_stream(self):
        return self._lazy_stream("_stream")

    def _lazy_stream(self, attr: str):
        """The CUDA stream held in ``attr``, made on first use (the loads' side stream, the gradients' one)."""
        if getattr(self, attr) is None:
            with self._lock:
                if getattr(self, attr) is None:
                    setattr(self, attr, torch.cuda.Stream(device=self.device))
        return getattr(self, attr)

    def track_file(self, path: str, expected: tuple | None = None, tensor: str = "") -> None:
        """Open ``path`` now and record its identity (size, inode, mtime, device, ctime); with ``expected``
        (the identity when offload() resolved it) refuse a file that changed since."""
        fd = self._fd(path)
        now = identity(os.fstat(fd))
        if expected is not None and not same_file(expected, now):
            raise OffloadError(_changed(tensor, path, expected, now, "since offload() read its header"))
        self._ids.setdefault(path, expected if expected is not None else now)
        if self.storage == "disk" and self.device.type != "cuda" and _MAP_FLAGS is not None:
            handler_installed()  # offload() runs in the main thread as a rule: the SIGIO handler goes in now

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError as exc:
                        raise OffloadError(f"cannot open offload file {path}: {exc}") from None
                    self._fds[path] = fd
                    self._ids.setdefault(path, identity(os.fstat(fd)))
        return fd

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(timeout=LOAD_TIMEOUT_S)
        for fd in self._fds.values():
            self._leases.release(fd)
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()

    # ---------------------------------------------------------------- gradients of host copies
    def accumulate_grad(self, rec: OffloadedTensor, grad: torch.Tensor) -> None:
        """Add ``grad`` to the gradient of ``rec``'s host copy.

        From a CUDA device inside a backward pass the copy to the host does not stop the compute: it
        runs on its own stream into a reused page-locked buffer, the worker adds it on the host once
        the copy is done, and the backward pass ends only after every such addition (an autograd
        callback waits for them), so the optimizer never reads a partial gradient."""
        host = rec.host
        if grad.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            _add_grad(host, grad.to(device=host.device, dtype=host.dtype), grad)
            return
        task = torch._C._current_graph_task_id()
        if task == -1:  # not inside a backward pass
            _add_grad(host, grad.to(device=host.device, dtype=host.dtype), grad)
            return
        with self._lock:
            if task != self._grad_task:  # once per backward pass: its end waits for the additions
                self._grad_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradients)
            stream = self._d2h_stream()
            stream.wait_stream(torch.cuda.current_stream(grad.device))
            buf = self._staging.take(host.numel() * host.element_size())
            part = buf[: host.numel() * host.element_size()].view(host.dtype).view(host.shape)
            event = torch.cuda.Event()
            with torch.cuda.stream(stream):
                part.copy_(grad.to(host.dtype), non_blocking=True)
                event.record(stream)
            grad.record_stream(stream)
            self._grads_pending.append(self._worker().submit(self._land_grad, host, buf, part, event))

    def _land_grad(self, host: torch.Tensor, buf: torch.Tensor, part: torch.Tensor, event) -> None:
        """On the worker, once the copy is done: the first gradient of a backward pass becomes the host
        copy's gradient as it lies in the page-locked buffer (no host copy of it; the buffer leaves
        the pool, and torch's page-locked allocator caches it when the gradient is freed), a later
        one is added and its buffer goes back to the pool."""
        kept = False
        try:
            event.synchronize()
            if host.grad is None:
                host.grad = part
                kept = True
            else:
                host.grad.add_(part)
        finally:
            if not kept:
                self._staging.give(buf)

    def finish_gradients(self) -> None:
        """Wait until every gradient copy this backward pass started has been added on the host."""
        with self._lock:
            pending, self._grads_pending = self._grads_pending, []
            self._grad_task = -1
        for job in pending:
            job.result(LOAD_TIMEOUT_S)

    def _d2h_stream(self):
        return self._lazy_stream("_grad_stream")

    # ---------------------------------------------------------------- the transfers
    def _checked_fd(self, rec: OffloadedTensor) -> int:
        """The open file of ``rec``'s bytes, checked to be the file offload() resolved, unchanged
        (same size, inode, mtime, device, ctime: :func:`same_file`) and still covering the tensor: a file truncated or
        rewritten in place would be read as other bytes, or kill the process with SIGBUS when a
        mapping of it is touched past its new end."""
        loc = rec.location
        fd = self._fd(loc.path)
        now = identity(os.fstat(fd))
        expected = self._ids.get(loc.path, now)
        if loc.offset + loc.nbytes > now[0]:
            raise OffloadError(
                f"tensor {rec.name!r}: {loc.path} is truncated ({now[0]} bytes, its bytes end at {loc.offset + loc.nbytes}); "
                f"it changed while the model serves from it: restore the file and offload the model again"
            )
        if not same_file(expected, now):
            raise OffloadError(_changed(rec.name, loc.path, expected, now, "since graphpass.offload() resolved it"))
        return fd

    def read_copy(self, rec: OffloadedTensor) -> torch.Tensor:
        """A fresh host tensor with ``rec``'s bytes read from its file (``state_dict()`` of a disk model)."""
        out = torch.empty(rec.shape, dtype=rec.dtype)
        read_into(self._checked_fd(rec), rec.location, out)
        return out

    def map_stand_in(self, loc: TensorLocation, like: torch.Tensor) -> torch.Tensor | None:
        """A tensor shaped as ``like`` over a private mapping of ``loc`` held under the file's read
        lease (:func:`map_private`), or None (then the model holds an empty stand-in, and a frame
        Dynamo skips that reads it is refused: ``eager_reads_real``). The file is checked unchanged
        since ``offload()`` resolved it once the lease is held (it cannot change after that)."""
        fd = self._fd(loc.path)
        with self._leases.lock:
            mapped = map_private(fd, loc, like.dtype, like.shape, self._leases)
            expected, now = self._ids.get(loc.path), identity(os.fstat(fd))
            if mapped is not None and expected is not None and not same_file(expected, now):
                raise OffloadError(_changed("", loc.path, expected, now, "while graphpass.offload() mapped it"))
        return mapped

    def _read(self, rec: OffloadedTensor, dst: torch.Tensor) -> None:
        read_into(self._checked_fd(rec), rec.location, dst)

    def _map(self, rec: OffloadedTensor) -> torch.Tensor:
        """``rec``'s bytes as a tensor over a private mapping of its file region.

        The pages are the page cache's own (no copy). The mapping is released when the last
        tensor over it is freed, so the process's resident memory holds the traps in flight, not
        the model. The schedule pass refuses graphs that write an offloaded tensor. A region is
        mapped only under a read lease of its file (``leases.py``: a writer then waits while the
        live regions are copied, instead of the compute faulting on a truncated file); without
        one, or for a region misaligned for its dtype, the bytes are read into a fresh tensor."""
        loc = rec.location
        if loc.nbytes == 0:
            self._checked_fd(rec)
            return torch.empty(rec.shape, dtype=rec.dtype)
        start = loc.offset - loc.offset % mmap.ALLOCATIONGRANULARITY
        delta = loc.offset - start
        leases = self._leases
        with leases.lock:  # a lease break waits until the region is registered
            if delta % rec.dtype.itemsize or not leases.lease(self._fd(loc.path)):
                dst = torch.empty(rec.shape, dtype=rec.dtype)
                read_into(self._checked_fd(rec), loc, dst)
                return dst
            fd = self._checked_fd(rec)  # under the lease: the file cannot change until it is released
            length = delta + loc.nbytes
            if hasattr(os, "posix_fadvise"):  # a cold page cache starts reading now, in the background
                os.posix_fadvise(fd, loc.offset, loc.nbytes, os.POSIX_FADV_WILLNEED)
            populate = _spare_core()
            # Writable and private (copy-on-write) unless populating (that would copy every page):
            # a write the schedule pass did not see lands in a private copy, never in the file.
            prot = mmap.PROT_READ if populate else mmap.PROT_READ | mmap.PROT_WRITE
            flags = _MAP_FLAGS | (_MAP_POPULATE if populate else 0)
            addr = _LIBC.mmap(None, length, prot, flags, fd, start)  # ctypes: the GIL is released
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OffloadError(f"tensor {rec.name!r}: cannot map {loc.path}: {os.strerror(ctypes.get_errno())}")
            return _over_region(addr, length, delta, loc.nbytes, rec.dtype, rec.shape,
                                lambda region: leases.register(addr, length, fd, loc.offset + loc.nbytes, region))

    def _map_job(self, recs: list) -> list:
        self._drop_retired()
        dsts = [self._map(r) for r in recs]
        self._allocated(dsts, sum(r.nbytes for r in recs))
        return dsts

    def _host_job(self, recs: list, dsts: list) -> None:
        self._drop_retired()
        for rec, dst in zip(recs, dsts):
            if rec.location is not None:
                self._read(rec, dst)
            else:
                dst.copy_(rec.host)

    def _disk_to_cuda_job(self, recs: list, dsts: list, event) -> None:
        offsets, total = GraphSlots.layout(recs)  # 64-byte aligned offsets, so any dtype can view its part
        staging = self._staging.take(total)
        try:
            views = []
            for rec, pos in zip(recs, offsets):
                part = staging[pos : pos + rec.nbytes].view(rec.dtype).view(rec.shape) if rec.nbytes else None
                if part is not None:
                    self._read(rec, part)
                views.append(part)
            stream = self._side_stream()
            with torch.cuda.stream(stream):
                for part, dst in zip(views, dsts):
                    if part is not None:
                        dst.copy_(part, non_blocking=True)
                event.record(stream)
            event.synchronize()  # the staging buffer is reusable once the copy is done
        finally:
            self._staging.give(staging)

    def _host_buffer(self, rec: OffloadedTensor) -> torch.Tensor:
        """A device tensor for ``rec`` on a host device, backed by a reused buffer.

        Fresh memory for every load would be mapped from the OS and faulted in page by page on
        each step (it dominated the disk benchmark); a buffer is reused once nothing but the pool
        references its storage, which the storage's use count says exactly, so a buffer still
        read by the graph (or a view of it) is never handed out again."""
        device = self.device
        if rec.nbytes == 0 or use_count is None:
            return torch.empty(rec.shape, dtype=rec.dtype, device=device)
        stride = torch.empty(rec.shape, dtype=rec.dtype, device="meta").stride()
        with self._lock:
            for storage in self._pool.setdefault(rec.nbytes, []):
                if use_count(storage) == 1:
                    break
            else:
                storage = torch.empty(rec.nbytes, dtype=torch.uint8, device=device).untyped_storage()
                self._pool[rec.nbytes].append(storage)  # buffer_pool_bytes is read off the pool
            return torch.empty(0, dtype=rec.dtype, device=device).set_(storage, 0, rec.shape, stride)

    def _start_captured(self, recs: list, group: str) -> _Pending:
        """A load recorded into a CUDA graph: page-locked host copies -> fixed slots, on the side stream,
        forked from and joined into the capture by events (the replay copies again at every step, so
        a host copy updated between replays is what the next replay computes with)."""
        refuse_unpinned_cuda_graph_loads(recs, self.storage, f"trap {group!r}: a CUDA graph is being recorded")
        device = self.device
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(device))  # after every reader of the slot's last trap
        slots = self.facts.graph_slots
        dsts = slots[-1].take(recs) if slots else None
        if dsts is None:  # not reserved (a capture graphpass was not told of) or every slot in use
            _log.warning("trap %r: no free fixed slot for a load recorded into a CUDA graph; it uses the graph's own "
                         "memory pool (correct, but its memory stays reserved by the graph)", group)
            with torch.cuda.stream(stream):
                dsts = [torch.empty(r.shape, dtype=r.dtype, device=device) for r in recs]
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            for rec, dst in zip(recs, dsts):
                dst.copy_(rec.host, non_blocking=True)
            event.record(stream)
        self._allocated(dsts, sum(r.nbytes for r in recs))
        return _Pending(dsts, None, event)

    def start(self, recs: list, group: str) -> int:
        if self._closed:
            raise OffloadError("this model's offload runtime was closed (graphpass.offload state released)")
        if self._forked_cuda:
            raise OffloadError(
                f"this model was offloaded to {self.device} in process {self._forked_cuda}, and this is a child it "
                f"made with fork(): CUDA does not work in a forked child. Start workers with the 'spawn' or "
                f"'forkserver' method (multiprocessing.set_start_method) and offload the model in each")
        self._drain_abandoned()
        device = self.device
        nbytes = sum(r.nbytes for r in recs)
        owner = (threading.get_ident(), group)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            pending = self._start_captured(recs, group)
        elif device.type == "cuda":
            # The CPU runs ahead of the GPU; memory freed by an evicted trap is reused only once
            # the GPU is past that trap. Waiting here for the eviction before this load keeps the
            # device at the schedule's traps instead of the caching allocator growing to all.
            done = self._evict_events.pop(threading.get_ident(), None)
            if done is not None:
                done.synchronize()
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                dsts = [torch.empty(r.shape, dtype=r.dtype, device=device) for r in recs]
            self._allocated(dsts, nbytes)
            event = torch.cuda.Event(blocking=True)
            if any(r.location is not None for r in recs):
                pending = _Pending(dsts, self._submit(group, self._disk_to_cuda_job, recs, dsts, event), event)
            else:
                with torch.cuda.stream(stream):
                    for rec, dst in zip(recs, dsts):
                        dst.copy_(rec.host, non_blocking=True)  # the graph's input is a stand-in
                    event.record(stream)
                pending = _Pending(dsts, None, event)
        elif all(r.location is not None for r in recs) and _MAP_FLAGS is not None:
            # disk -> host device: map the file region (the worker maps it), no copy at all
            pending = _Pending(None, self._submit(group, self._map_job, recs), mapped=tuple(recs))
        else:
            dsts = [self._host_buffer(r) for r in recs]
            self._allocated(dsts, nbytes)
            pending = _Pending(dsts, self._submit(group, self._host_job, recs, dsts))
        pending.owner = owner
        with self._lock:
            ticket = next(self._tickets)
            stale = self._latest.get(owner)
            dropped = self._pending.pop(stale, None) if stale is not None else None  # a call that raised
            self._latest[owner] = ticket
            self._pending[ticket] = pending
        del dropped  # released outside the lock
        return ticket

    def _take(self, ticket: int) -> _Pending | None:
        with self._lock:
            pending = self._pending.pop(ticket, None)
            if pending is not None and self._latest.get(pending.owner) == ticket:
                del self._latest[pending.owner]
        return pending

    def wait(self, ticket: int | None, group: str) -> list:
        if ticket is None:  # a ticket tensor that lost its number: this thread's latest load of the group
            with self._lock:
                ticket = self._latest.get((threading.get_ident(), group))
        pending = self._take(ticket) if ticket is not None else None
        if pending is None:
            raise OffloadError(f"trap {group!r}: load ticket {ticket} is unknown (its load was never started)")
        t0 = time.perf_counter()
        if pending.future is not None:
            try:  # re-raises the worker's OffloadError naming the tensor
                mapped = pending.future.result(LOAD_TIMEOUT_S)
            except TimeoutError:
                raise OffloadError(
                    f"trap {group!r}: its load did not finish in {LOAD_TIMEOUT_S} s (the offload worker is stuck: "
                    f"a file on a hung mount, or a bug); nothing was computed with partial weights"
                ) from None
            if pending.dsts is None:
                pending.dsts = mapped
        for path, rec in {r.location.path: r for r in pending.mapped}.items():
            self._checked_fd(rec)  # the compute reads the mapping next: the file must still cover it
        if pending.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(pending.event)
            for d in pending.dsts:
                d.record_stream(current)
        self._count("wait_seconds", time.perf_counter() - t0)
        record_span(WAIT, group, t0)  # graphpass.trace: the compute waited from t0 to now
        return pending.dsts


    def evicted(self, group: str, loaded: list | None = None) -> None:
        t0 = time.perf_counter()
        try:
            self._evicted(group, loaded)
        finally:
            record_span(EVICT, group, t0)  # graphpass.trace: the eviction as a range

    def _evicted(self, group: str, loaded: list | None) -> None:
        with self._lock:
            self._stats = {**self._stats, "evictions": self._stats["evictions"] + 1}
            if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                event = torch.cuda.Event(blocking=True)
                event.record(torch.cuda.current_stream(self.device))
                self._evict_events[threading.get_ident()] = event
            if loaded and self.device.type != "cuda" and self._pending and self.storage == "disk":
                # a load is in flight: keep the last reference so the worker, not the compute
                # thread, unmaps the region (milliseconds for a layer) when it runs its next job
                self._retired.append(list(loaded))
                return
        self._drop_retired()  # nothing in flight (the end of a pass): release what is left now

    def _drop_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        retired.clear()


def _add_grad(host: torch.Tensor, g: torch.Tensor, source: torch.Tensor | None) -> None:
    """``host.grad += g`` (``g`` becomes the gradient when there is none; copied when it is
    ``source`` itself or a reused buffer)."""
    if host.grad is None:
        host.grad = g.clone() if source is None or g is source else g
    else:
        host.grad.add_(g)


def _changed(tensor: str, path: str, expected: tuple, now: tuple, when: str) -> str:
    what = []
    if now[0] != expected[0]:
        what.append(f"size {expected[0]} -> {now[0]} bytes" + (" (truncated)" if now[0] < expected[0] else ""))
    if now[1] != expected[1] or now[3] != expected[3]:
        what.append("another file (inode/device)")
    if now[2] != expected[2]:
        what.append("modified (mtime)")
    elif now[4] != expected[4]:
        what.append("status changed (ctime): rewritten with its mtime restored, or chmod/chown")
    name = f"tensor {tensor!r}: " if tensor else ""
    return (f"{name}{path} changed {when} ({', '.join(what) or 'identity differs'}): graphpass reads the bytes "
            f"there at every load and refuses a file rewritten, truncated or replaced in place. Restore it, or "
            f"offload a fresh model from the new file; to update a checkpoint in use, write the new file "
            f"under another name and rename it over the old one")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
