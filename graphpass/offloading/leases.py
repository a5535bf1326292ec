"""Read leases on the files a model maps, so that a writer waits instead of the process dying.

On a host device with ``storage="disk"`` the runtime maps a tensor's file region and the compute
reads the page cache directly (no copy; see ``runtime.OffloadRuntime._map``). A mapping is only as
good as the file under it: if another process truncates the file while a mapped tensor is in use,
the next page the compute touches past the new end raises ``SIGBUS`` and the process dies; if it
rewrites the file in place (``cp new old``), pages not yet read come back as the new bytes.

Linux lets a reader hold a *read lease* on a file (``fcntl(F_SETLEASE, F_RDLCK)``): a process that
opens the file for writing or truncates it is blocked (at most ``/proc/sys/fs/lease-break-time``
seconds, 45 by default) and the holder is sent ``SIGIO``. graphpass maps a region only while it
holds the lease of its file. On ``SIGIO`` a breaker thread copies every live mapped region of
every leased file into anonymous memory and moves the copy over the mapping in one step
(``mremap``, atomic for the other threads reading it), and only then releases the leases. The
compute keeps reading the bytes it had; the writer proceeds; the next load checks the file's
identity and raises ``OffloadError`` naming tensor and file.

The same holds for the regions the model itself holds on a host device (``staging.map_private``:
the stand-in of each streamed tensor, which code Dynamo runs eagerly reads, a skipped frame or a
weight read outside the graph): they are mapped under the lease of their file too (taken when
``offload()`` maps them, kept for the model's life) and privatized by the same break. Eager readers
then keep reading the bytes of the file as ``offload()`` found it, never the new ones and never a
page past a new end (``SIGBUS``); the price is a private copy of every such region in memory, made
once, at the first break.

Without a lease the runtime reads a copy of the region instead of mapping it (slower, never a
fault): not Linux, a file of another user or on a filesystem without leases, a file open for
writing anywhere, a ``SIGIO`` handler other than graphpass's (one installed over it later), or
no handler at all (``signal.signal`` works only in the main thread: the first disk offload made
from another thread maps nothing until one made from the main thread installs it).

What is process-wide here, and why: a signal's handler is one per process, so the handler and
the set of lease holders it notifies are module-level. Each holder (one per offload runtime)
keeps its own leases and regions; the set holds it weakly. So is the *service thread*: it
runs the lease breaks the handler asks for and unmaps the regions whose tensors died. Both
reach it through a C ``SimpleQueue`` (``put`` is one C call): the handler and a region's
weak-reference callback (:class:`RegionRef`, whose callback *is* ``SimpleQueue.put``) run no
Python code an interrupt could split, so a ``KeyboardInterrupt`` can neither leak a mapping and
its table entry nor print "Exception ignored in finalize" (issue 22, item 16), and no
``threading.Thread`` is started inside a signal handler. A region may outlive its model, so the
references are kept by the module until reaped.

After ``fork()`` the child starts its own service thread on a request queue of its own (the
parent's queue's lock is copied in whatever state fork found it: :func:`_requests_after_fork`), as
soon as it holds a lease, and each runtime reopens its files
(:meth:`FileLeases.after_fork`): a lease belongs to an open file description, which ``fork``
shares, and its break signal goes to the thread ``F_SETOWN_EX`` named, the parent's main thread.
With the parent's descriptions a child's mappings were protected by the parent's lease, whose
break the parent handled (or, stopped, did not: the writer waited the 45 s lease-break time)
without privatizing the child's regions: the child died of ``SIGBUS`` (issue 22, item 10).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import queue
import signal
import struct
import threading
import weakref
from typing import Any

log = logging.getLogger("graphpass.offloading.leases")

F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
_SIGIO = getattr(signal, "SIGIO", None)
_F_SETOWN_EX, _F_OWNER_TID = getattr(fcntl, "F_SETOWN_EX", 15), 0
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)

_HOLDERS: "weakref.WeakSet[FileLeases]" = weakref.WeakSet()
_INSTALL_LOCK = threading.Lock()
_PREVIOUS: list[Any] = []  # the handler graphpass's replaced (called after graphpass's own work)
_BREAK = "break"  # a service request: break every holder's leases
_REQUESTS: queue.SimpleQueue = queue.SimpleQueue()  # lease breaks and dead regions, for the service thread
_KEPT: dict[int, "RegionRef"] = {}  # id -> the weak reference of a live mapped region (until reaped)
_SERVICE: dict[str, Any] = {"pid": None, "thread": None}
_MAIN_TID: dict[int, int] = {}  # pid -> native id of its main thread, set in a child made by fork


class RegionRef(weakref.ref):
    """A weak reference to a mapped region (the ctypes array tensors are made over); when the region
    dies its callback, ``_REQUESTS.put`` (C), queues it for the service thread, which unmaps it."""

    __slots__ = ("addr", "length", "holder")


def track_region(region: Any, addr: int, length: int, holder: "FileLeases") -> RegionRef:
    """Unmap ``addr`` (``length`` bytes) on the service thread once ``region`` dies."""
    _ensure_service()
    ref = RegionRef(region, _REQUESTS.put)
    ref.addr, ref.length, ref.holder = addr, length, holder
    _KEPT[id(ref)] = ref
    return ref


def reap(ref: RegionRef) -> None:
    """Unmap a dead region once (the service thread; or any thread once the service is gone)."""
    if _KEPT.pop(id(ref), None) is ref:
        ref.holder.unmap(ref.addr, ref.length, ref)


def _serve(requests: queue.SimpleQueue) -> None:
    while True:
        item = requests.get()
        try:
            if item is _BREAK:
                _break_all(list(_HOLDERS))
            elif isinstance(item, RegionRef):
                reap(item)
        except Exception:  # noqa: BLE001 - the service must outlive one failure
            log.exception("graphpass lease service: %r failed", item)
        del item


def _ensure_service() -> None:
    """Start this process's service thread (again in a child made by fork, where it is gone)."""
    if _SERVICE["pid"] != os.getpid():
        with _INSTALL_LOCK:
            _ensure_service_locked()


def _ensure_service_locked() -> None:
    if _SERVICE["pid"] != os.getpid():
        thread = threading.Thread(target=_serve, args=(_REQUESTS,), name="graphpass-lease-service", daemon=True)
        thread.start()
        _SERVICE.update(pid=os.getpid(), thread=thread)


def _libc_calls(libc):
    if libc is None or not hasattr(libc, "mremap"):
        return None
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    return libc


def _on_sigio(signum, frame):
    """Runs in the main thread between two bytecodes: hand the work to a thread (the main thread
    may be inside a critical section of a runtime right now) and chain to the replaced handler."""
    _REQUESTS.put(_BREAK)  # one C call: nothing here an interrupt could leave half done
    previous = _PREVIOUS[0] if _PREVIOUS else None
    if callable(previous):
        previous(signum, frame)


def _break_all(holders: list) -> None:
    for holder in holders:
        holder.break_leases()


def handler_installed() -> bool:
    """Is graphpass's ``SIGIO`` handler the process's? Installs it when it can (main thread only)."""
    if _SIGIO is None:
        return False
    with _INSTALL_LOCK:
        current = signal.getsignal(_SIGIO)
        if current is _on_sigio:
            return True
        if _PREVIOUS:  # installed once and replaced since: whoever replaced it owns SIGIO now
            return False
        try:
            signal.signal(_SIGIO, _on_sigio)
        except (ValueError, OSError):  # not the main thread
            return False
        _ensure_service_locked()
        # SIG_DFL for SIGIO terminates the process and SIG_IGN drops it: neither is chained
        _PREVIOUS.append(current if callable(current) else None)
        return True


def _signal_main_thread(fd: int) -> None:
    """Send ``fd``'s lease-break signal to the main thread (F_SETOWN_EX), not to any thread of
    the process: the main thread runs Python's handler, and a write to the file made *from* the
    main thread (``open(path, "r+b")``, ``os.truncate``) blocks in the kernel until the lease goes;
    only a signal aimed at that thread interrupts it (EINTR: the handler runs, the call is
    retried), where one delivered to another thread would leave it waiting out the whole
    lease-break time."""
    try:
        fcntl.fcntl(
            fd,
            _F_SETOWN_EX,
            struct.pack("ii", _F_OWNER_TID, _MAIN_TID.get(os.getpid()) or threading.main_thread().native_id),
        )
    except (OSError, AttributeError, TypeError):  # older kernels: the process, as F_SETLEASE set it
        pass


class FileLeases:
    """The leases and mapped regions of one offload runtime.

    ``mapping(fd)`` is entered around "check the file, map the region, register it": the lease
    cannot be broken between those steps (``break_leases`` takes the same lock), so every region
    mapped under a lease is registered before the lease can go."""

    def __init__(self, libc) -> None:
        self._libc = _libc_calls(libc)
        self._munmap = getattr(libc, "munmap", None)
        self._lock = threading.RLock()
        self._leased: set[int] = set()
        self._unleasable: set[int] = set()  # fds a child made by fork shares with its parent: never leased
        self._regions: dict[int, tuple[int, int, int, Any]] = {}  # address -> (length, fd, file offset of its end, ref)
        self._held: dict[int, tuple[int, int, int, Any]] = {}  # the same, for the regions the model holds (stand-ins)
        self.breaks = 0  # lease breaks handled (the tests read it)

    # ---------------------------------------------------------------- leases
    def lease(self, fd: int) -> bool:
        """Hold (or take) a read lease on ``fd``; False when it cannot be had (read a copy)."""
        if fd in self._leased:
            return True
        if self._libc is None or fd in self._unleasable or not handler_installed():
            return False
        try:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:  # EAGAIN: open for writing somewhere; EACCES: another user's file; EINVAL
            log.debug("no read lease on fd %d (%s): reading copies instead of mapping", fd, exc)
            return False
        _signal_main_thread(fd)
        self._leased.add(fd)
        _HOLDERS.add(self)
        _ensure_service()  # a break must be served while a lease is held (a child made by fork: none yet)
        return True

    def release(self, fd: int) -> None:
        with self._lock:
            if fd in self._leased:
                self._leased.discard(fd)
                try:
                    fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
                except OSError:
                    pass

    @property
    def lock(self):
        return self._lock

    def leased(self, fd: int) -> bool:
        return fd in self._leased

    def after_fork(self, reopened: dict[int, int]) -> None:
        """In a child made by fork: the leases held are the parent's (its open file descriptions):
        forget them without releasing them; regions follow their file to the fd the child reopened
        (``reopened``: inherited fd -> new fd), or are left unprotected (-1) where it could not."""
        self._lock = threading.RLock()  # another thread of the parent may have held it at the fork
        self._unleasable |= {fd for fd in self._leased if fd not in reopened}
        self._leased = set()
        for regions in (self._regions, self._held):
            for a, (n, fd, end, ref) in list(regions.items()):
                regions[a] = (n, reopened.get(fd, -1), end, ref)
        # the regions the model holds (stand-ins eager code reads) live on in the child: its own lease on
        # the reopened file protects them (a writer's break reaches the child, which privatizes them)
        for fd in {fd for _, fd, _, _ in self._held.values() if fd >= 0}:
            self.lease(fd)

    def renew(self, old: Any, new: Any) -> None:
        """The region of reference ``old`` is now tracked by ``new`` (a child made by fork, single-threaded:
        no lock, the parent's may be held)."""
        for regions in (self._regions, self._held):
            entry = regions.get(old.addr)
            if entry is not None and entry[3] is old:
                regions[old.addr] = entry[:3] + (new,)

    # ---------------------------------------------------------------- regions
    def register(self, addr: int, length: int, fd: int, end: int, region: Any, held: bool = False) -> None:
        """A region of ``length`` bytes at ``addr`` mapping ``fd`` up to file offset ``end``, over which
        ``region`` (the ctypes array tensors are made over) was made: unmapped once it dies. ``held``:
        one the model holds for its life (a stand-in eager code reads), not a load's."""
        (self._held if held else self._regions)[addr] = (length, fd, end, track_region(region, addr, length, self))

    def unmap(self, addr: int, length: int, ref: Any = None) -> None:
        """Unmap a region whose tensors died (the service thread); its entry goes if it is still ``ref``'s."""
        with self._lock:
            for regions in (self._regions, self._held):
                entry = regions.get(addr)
                if entry is not None and entry[3] is ref:
                    del regions[addr]
            self._munmap(ctypes.c_void_p(addr), ctypes.c_size_t(length))

    def live_regions(self) -> int:
        """Regions the loads have mapped and that are alive (not counting the stand-ins the model holds)."""
        return len(self._regions)

    def held_regions(self) -> tuple[int, int]:
        """(stand-in regions the model holds that still map a file, those privatized by a break)."""
        mapped = sum(1 for _, fd, _, _ in self._held.values() if fd >= 0)
        return mapped, len(self._held) - mapped

    def break_leases(self) -> None:
        """Privatize every registered region, then release every lease (see the module docstring)."""
        with self._lock:
            if not self._leased and not self._regions and not self._held:
                return
            for regions in (self._regions, self._held):
                for addr, (length, fd, end, ref) in list(regions.items()):
                    if addr in regions and fd in self._leased and self._covers(fd, end):
                        self._privatize(addr, length)
                        regions[addr] = (length, -1, 0, ref)  # anonymous memory now: nothing to break
            for fd in list(self._leased):
                self.release(fd)
            self.breaks += 1
        log.info("a file graphpass maps is being written: mapped regions copied, read leases released")

    @staticmethod
    def _covers(fd: int, end: int) -> bool:
        """Does the file still hold the region? Not when the kernel broke the lease by itself (the
        handler ran after the lease-break time): copying would fault exactly as the compute would."""
        try:
            if os.fstat(fd).st_size >= end:
                return True
        except OSError:
            pass
        log.error(
            "lease break came too late (after /proc/sys/fs/lease-break-time): a mapped region of fd %d "
            "is past the file's end already and cannot be copied",
            fd,
        )
        return False

    def _privatize(self, addr: int, length: int) -> None:
        libc = self._libc
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        copy = libc.mmap(None, length, prot, mmap.MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if copy in (None, ctypes.c_void_p(-1).value):
            log.error("lease break: no memory for a private copy of a mapped region (%d bytes)", length)
            return
        ctypes.memmove(copy, addr, length)  # the file is intact: its writer waits for the release
        moved = libc.mremap(
            ctypes.c_void_p(copy), length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, ctypes.c_void_p(addr)
        )
        if moved != addr:
            libc.munmap(ctypes.c_void_p(copy), ctypes.c_size_t(length))
            log.error("lease break: mremap over a mapped region failed (errno %d)", ctypes.get_errno())


def _after_fork_in_child() -> None:
    """The child starts its own service thread when it next needs one, on a request queue of its
    own (:func:`_requests_after_fork`); a lock another thread of the parent held at the fork is not
    held in the child. Its main thread is the thread that forked (Python runs signal handlers
    there), whose id ``threading`` does not update: the parent's ``native_id`` stays, and the
    child's lease-break signals went to the parent."""
    global _INSTALL_LOCK, _REQUESTS
    _INSTALL_LOCK = threading.Lock()
    _MAIN_TID.clear()
    _MAIN_TID[os.getpid()] = threading.get_native_id()
    _REQUESTS = _requests_after_fork(_REQUESTS)


def _requests_after_fork(inherited: queue.SimpleQueue) -> queue.SimpleQueue:
    """A new request queue for a child made by fork: the inherited one's requests move to it, and
    each live region gets a new reference whose callback puts into it.

    The parent's queue cannot serve the child: fork copies its internal lock in whatever state the
    parent's service thread left it. Woken by a ``put`` (a dead region, right after a forward), that
    thread takes the lock at once but marks it taken only once it holds the GIL; a fork in between
    (the forking thread holds the GIL) leaves the child's copy locked and unmarked, so no later
    ``put`` releases it and the child's service thread waits on it forever. Every lease break the
    child's handler asked for then went unserved: the writer waited out the lease-break time, the
    kernel revoked the lease, and the child died of ``SIGBUS`` on its unprivatized regions (issue
    22, item 10: about one run in three on a loaded machine). ``get_nowait`` never waits on that
    lock while requests are queued, and gives up at once on an empty queue."""
    fresh: queue.SimpleQueue = queue.SimpleQueue()
    while True:
        try:
            fresh.put(inherited.get_nowait())  # dead regions still to unmap, a break asked for
        except queue.Empty:
            break
    for key, ref in list(_KEPT.items()):
        region = ref()
        if region is None:  # dead: its callback queued it already (moved above)
            continue
        renewed = RegionRef(region, fresh.put)
        renewed.addr, renewed.length, renewed.holder = ref.addr, ref.length, ref.holder
        del _KEPT[key]
        _KEPT[id(renewed)] = renewed
        ref.holder.renew(ref, renewed)  # the old reference goes unheard: its callback was the old queue's put
    return fresh


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
