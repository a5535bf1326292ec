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

The runtime's rooms: the records and their table (``registry.py``), the worker thread (``workers.py``),
staging buffers and file mappings (``staging.py``), the open files checked unchanged (``open_files.py``),
gradients of host copies (``gradients.py``), loads recorded into a CUDA graph (``captured_loads.py``) and
the ``fork()`` hook (``forking.py``). This module is the transfer engine that drives them, and re-exports
the names it held before (``OffloadedTensor``, ``REGISTRY``, ``lookup``, ``map_private``, ...).
"""

from __future__ import annotations

import collections
import itertools
import mmap
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import OffloadError
from ..trace_events import EVICT, WAIT, active_sink, record_span
from . import forking
from .captured_loads import captured_load
from .facts import GuardedCode, OffloadFacts  # noqa: F401 (GuardedCode re-exported)
from .gradients import GradientLanding
from .graph_slots import GraphSlots, use_count
from .open_files import OpenFiles
from .registry import (  # noqa: F401 (re-exported: the names this module held)
    REGISTRY,
    OffloadedTensor,
    WrappedOffload,
    facts_guarding,
    guarded_module_names,
    lookup,
    lookup_input,
    plain_records,
)
from .safetensors_io import TensorLocation, read_into
from .staging import StagingPool, can_map, map_for_load, map_private, new_leases
from .workers import Job, Worker

# A load the worker has not finished after this long is an error, not a hang (a hung mount, a bug).
LOAD_TIMEOUT_S = 600

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


class _TicketRef(weakref.ref):
    __slots__ = ("ticket",)


@dataclass
class _Pending:
    dsts: Optional[list]  # None while the worker maps them (disk -> host device)
    future: Optional[Job] = None
    event: Any = None  # torch.cuda.Event the compute stream waits on
    owner: tuple = ()
    mapped: tuple = ()  # the records whose file regions are mapped: their files are checked again at the wait
    ticket_ref: Any = None  # a weak reference to the ticket tensor: its death (no wait) drops this load


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
        self._executor: Worker | None = None
        self._stream = None
        self._leases = new_leases()  # read leases on mapped files (a writer waits, see leases.py)
        self._files = OpenFiles(self._leases)
        self._staging = StagingPool()
        self._pool: dict[int, list] = {}  # nbytes -> storages of reused load buffers (host devices)
        self._retired: list = []  # evicted tensors the worker releases at its next job
        self._grads = self._gradient_landing()
        # Counters that must survive interruptions (KeyboardInterrupt lands between any two lines):
        # what is alive is not counted up and down by finalizers but read off weak references to
        # the loaded tensors when asked (``_live``), and the cumulative counters are replaced in
        # one assignment, so an interrupted update is all or nothing.
        self._live: list[tuple[weakref.ref, int]] = []
        self._abandoned: collections.deque = collections.deque()  # tickets whose tensor died (appended by a finalizer)
        self._stats = dict(
            bytes_loaded=0, loads_issued=0, groups_loaded=0, evictions=0, peak_streamed_bytes=0, wait_seconds=0.0
        )
        self._closed = False
        self._forked_cuda = 0  # the parent's pid in a child made by fork() of a CUDA runtime (refused)
        forking.track(self)

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
            return MemoryStats(
                resident_bytes=self.resident_bytes, streamed_bytes_now=now, buffer_pool_bytes=pool, **self._stats
            )

    def reset_stats(self) -> None:
        self._drain_abandoned()
        with self._lock:
            self._stats = dict(
                bytes_loaded=0,
                loads_issued=0,
                groups_loaded=0,
                evictions=0,
                peak_streamed_bytes=self._streamed_now(),
                wait_seconds=0.0,
            )  # the pool keeps its size

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
            self._stats = {
                **s,
                "peak_streamed_bytes": max(s["peak_streamed_bytes"], now),
                "bytes_loaded": s["bytes_loaded"] + nbytes,
                "loads_issued": s["loads_issued"] + len(dsts),
                "groups_loaded": s["groups_loaded"] + 1,
            }

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
        self._staging = StagingPool()
        self._executor = None
        self._pending, self._latest, self._retired = {}, {}, []
        self._abandoned = collections.deque()
        self._evict_events = {}
        self._grads = self._gradient_landing()
        if self.device.type == "cuda":
            self._forked_cuda = parent or -1
        self._files.after_fork_in_child()

    # ---------------------------------------------------------------- resources
    def _submit(self, group: str, job: Any, recs: list, *args: Any) -> Job:
        """Run ``job(recs, *args)`` on the worker; while graphpass.trace() records, as a load range there."""
        sink = active_sink()  # read here, on the compute thread: the worker does not share its context
        if sink is not None:
            job = sink.worker_job(group, job, tensors=len(recs), nbytes=sum(r.nbytes for r in recs))
        return self._worker().submit(job, recs, *args)

    def _worker(self) -> Worker:
        """The worker, started on first use, and again where it is gone (a child made by fork, whose
        copy of the parent's worker has no thread; ``after_fork_in_child`` drops it there first)."""
        worker = self._executor
        if worker is None or not worker.alive():
            with self._lock:
                worker = self._executor
                if worker is None or not worker.alive():
                    worker = self._executor = Worker("graphpass-offload")
        return worker

    def _side_stream(self):
        """The loads' CUDA side stream, made on first use."""
        if self._stream is None:
            with self._lock:
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def track_file(self, path: str, expected: tuple | None = None, tensor: str = "") -> None:
        """Open ``path`` now and record its identity (size, inode, mtime, device, ctime); with ``expected``
        (the identity when offload() resolved it) refuse a file that changed since."""
        mapped = self.storage == "disk" and self.device.type != "cuda" and can_map()
        self._files.track(path, expected, tensor, mapped)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(timeout=LOAD_TIMEOUT_S)
        self._files.close()

    # ---------------------------------------------------------------- gradients of host copies
    def _gradient_landing(self) -> GradientLanding:
        return GradientLanding(self.device, self._staging, self._worker, self.finish_gradients)

    def accumulate_grad(self, rec: OffloadedTensor, grad: torch.Tensor) -> None:
        """Add ``grad`` to the gradient of ``rec``'s host copy (``gradients.py``: from a CUDA backward pass,
        copied on a stream of its own and added by the worker before the backward pass ends)."""
        self._grads.add(rec.host, grad)

    def finish_gradients(self) -> None:
        """Wait until every gradient copy this backward pass started has been added on the host."""
        self._grads.finish(LOAD_TIMEOUT_S)

    # ---------------------------------------------------------------- the transfers
    def _checked_fd(self, rec: OffloadedTensor) -> int:
        """The open file of ``rec``'s bytes, checked unchanged and still covering it (``open_files.py``)."""
        return self._files.checked(rec.name, rec.location)

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
        fd = self._files.fd(loc.path)
        with self._leases.lock:
            mapped = map_private(fd, loc, like.dtype, like.shape, self._leases)
            if mapped is not None:
                self._files.check_unchanged(fd, loc.path)
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
            if delta % rec.dtype.itemsize or not leases.lease(self._files.fd(loc.path)):
                dst = torch.empty(rec.shape, dtype=rec.dtype)
                read_into(self._checked_fd(rec), loc, dst)
                return dst
            fd = self._checked_fd(rec)  # under the lease: the file cannot change until it is released
            return map_for_load(fd, loc, rec.dtype, rec.shape, leases, rec.name)

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
        """A load recorded into a CUDA graph (``captured_loads.py``)."""
        dsts, event = captured_load(recs, group, self.facts, self._side_stream())
        self._allocated(dsts, sum(r.nbytes for r in recs))
        return _Pending(dsts, None, event)

    def start(self, recs: list, group: str) -> int:
        if self._closed:
            raise OffloadError("this model's offload runtime was closed (graphpass.offload state released)")
        if self._forked_cuda:
            raise OffloadError(
                f"this model was offloaded to {self.device} in process {self._forked_cuda}, and this is a child it "
                f"made with fork(): CUDA does not work in a forked child. Start workers with the 'spawn' or "
                f"'forkserver' method (multiprocessing.set_start_method) and offload the model in each"
            )
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
        elif all(r.location is not None for r in recs) and can_map():
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
        for rec in {r.location.path: r for r in pending.mapped}.values():
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
