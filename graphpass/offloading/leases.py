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

The same holds for the regions the model itself holds on a host device (``runtime.map_private``:
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
keeps its own leases and regions; the set holds it weakly.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
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


def _libc_calls(libc):
    if libc is None or not hasattr(libc, "mremap"):
        return None
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    return libc


def _on_sigio(signum, frame):
    """Runs in the main thread between two bytecodes: hand the work to a thread (the main thread
    may be inside a critical section of a runtime right now) and chain to the replaced handler."""
    holders = list(_HOLDERS)
    if holders:
        threading.Thread(target=_break_all, args=(holders,), name="graphpass-lease-break", daemon=True).start()
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
        fcntl.fcntl(fd, _F_SETOWN_EX, struct.pack("ii", _F_OWNER_TID, threading.main_thread().native_id))
    except (OSError, AttributeError, TypeError):  # older kernels: the process, as F_SETLEASE set it
        pass


class FileLeases:
    """The leases and mapped regions of one offload runtime.

    ``mapping(fd)`` is entered around "check the file, map the region, register it": the lease
    cannot be broken between those steps (``break_leases`` takes the same lock), so every region
    mapped under a lease is registered before the lease can go."""

    def __init__(self, libc) -> None:
        self._libc = _libc_calls(libc)
        self._lock = threading.RLock()
        self._leased: set[int] = set()
        self._regions: dict[int, tuple[int, int, int]] = {}  # address -> (length, fd, file offset of its end)
        self._held: dict[int, tuple[int, int, int]] = {}  # the same, for the regions the model holds (stand-ins)
        self._breaking: int | None = None  # the thread inside break_leases
        self._deferred: list[tuple[int, int]] = []  # unmaps asked for by that thread meanwhile
        self.breaks = 0  # lease breaks handled (the tests read it)

    # ---------------------------------------------------------------- leases
    def lease(self, fd: int) -> bool:
        """Hold (or take) a read lease on ``fd``; False when it cannot be had (read a copy)."""
        if fd in self._leased:
            return True
        if self._libc is None or not handler_installed():
            return False
        try:
            fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:  # EAGAIN: open for writing somewhere; EACCES: another user's file; EINVAL
            log.debug("no read lease on fd %d (%s): reading copies instead of mapping", fd, exc)
            return False
        _signal_main_thread(fd)
        self._leased.add(fd)
        _HOLDERS.add(self)
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

    # ---------------------------------------------------------------- regions
    def register(self, addr: int, length: int, fd: int, end: int, held: bool = False) -> None:
        """A region of ``length`` bytes at ``addr`` mapping ``fd`` up to file offset ``end``; ``held``:
        one the model holds for its life (a stand-in eager code reads), not a load's."""
        (self._held if held else self._regions)[addr] = (length, fd, end)

    def unmap(self, addr: int, length: int) -> None:
        """The finalizer of a mapped region: unmap it (deferred while this thread privatizes)."""
        with self._lock:
            if self._breaking == threading.get_ident():
                self._deferred.append((addr, length))
                return
            self._regions.pop(addr, None)
            self._held.pop(addr, None)
            self._libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(length))

    def live_regions(self) -> int:
        """Regions the loads have mapped and that are alive (not counting the stand-ins the model holds)."""
        return len(self._regions)

    def held_regions(self) -> tuple[int, int]:
        """(stand-in regions the model holds that still map a file, those privatized by a break)."""
        mapped = sum(1 for _, fd, _ in self._held.values() if fd >= 0)
        return mapped, len(self._held) - mapped

    def break_leases(self) -> None:
        """Privatize every registered region, then release every lease (see the module docstring)."""
        with self._lock:
            if not self._leased and not self._regions and not self._held:
                return
            self._breaking = threading.get_ident()
            try:
                for regions in (self._regions, self._held):
                    for addr, (length, fd, end) in list(regions.items()):
                        if addr in regions and fd in self._leased and self._covers(fd, end):
                            self._privatize(addr, length)
                            regions[addr] = (length, -1, 0)  # anonymous memory now: nothing to break
                for fd in list(self._leased):
                    self.release(fd)
            finally:
                self._breaking = None
                deferred, self._deferred = self._deferred, []
            for addr, length in deferred:
                self.unmap(addr, length)
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
        log.error("lease break came too late (after /proc/sys/fs/lease-break-time): a mapped region of fd %d "
                  "is past the file's end already and cannot be copied", fd)
        return False

    def _privatize(self, addr: int, length: int) -> None:
        libc = self._libc
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        copy = libc.mmap(None, length, prot, mmap.MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        if copy in (None, ctypes.c_void_p(-1).value):
            log.error("lease break: no memory for a private copy of a mapped region (%d bytes)", length)
            return
        ctypes.memmove(copy, addr, length)  # the file is intact: its writer waits for the release
        moved = libc.mremap(ctypes.c_void_p(copy), length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, ctypes.c_void_p(addr))
        if moved != addr:
            libc.munmap(ctypes.c_void_p(copy), ctypes.c_size_t(length))
            log.error("lease break: mremap over a mapped region failed (errno %d)", ctypes.get_errno())
