"""Where loaded bytes land on the host: reused page-locked staging buffers, and private mappings of file regions.

* :class:`StagingPool`: page-locked host buffers reused for disk -> CUDA loads and for device -> host
  gradient copies (no host allocation per step).
* Disk -> host device: the tensor is a read-only or copy-on-write private mapping of its file region
  (:func:`map_for_load`, :func:`map_private`), never a copy; unmapped once the last tensor over it dies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import warnings

import torch

from ..errors import OffloadError
from .leases import FileLeases
from .safetensors_io import TensorLocation


class StagingPool:
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
        return _over_region(
            addr,
            length,
            delta,
            loc.nbytes,
            dtype,
            shape,
            lambda region: leases.register(addr, length, fd, loc.offset + loc.nbytes, region, held=True),
        )


def map_for_load(
    fd: int, loc: TensorLocation, dtype: torch.dtype, shape, leases: FileLeases, name: str
) -> torch.Tensor:
    """``loc``'s bytes as a tensor over a private mapping of its file region, for a load on the worker; the
    caller holds ``leases.lock`` and the file's lease, and checked the region aligned for ``dtype``."""
    start = loc.offset - loc.offset % mmap.ALLOCATIONGRANULARITY
    delta = loc.offset - start
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
        raise OffloadError(f"tensor {name!r}: cannot map {loc.path}: {os.strerror(ctypes.get_errno())}")
    return _over_region(
        addr,
        length,
        delta,
        loc.nbytes,
        dtype,
        shape,
        lambda region: leases.register(addr, length, fd, loc.offset + loc.nbytes, region),
    )


def can_map() -> bool:
    """Can this process map file regions (libc ``mmap`` with private mappings)?"""
    return _MAP_FLAGS is not None


def new_leases() -> FileLeases:
    """Read leases on mapped files, through this process's libc (see ``leases.py``)."""
    return FileLeases(_LIBC)
