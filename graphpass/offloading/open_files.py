"""The files a model's loads read: held open, each checked unchanged before it is read or mapped.

One :class:`OpenFiles` per offloaded model (its runtime's): path -> open descriptor, the file's identity
when ``offload()`` resolved it (:func:`~graphpass.offloading.files.identity`), and the read leases on
the files it maps (``leases.py``). A file truncated, rewritten in place or replaced is refused with
what changed (:func:`changed`).
"""

from __future__ import annotations

import os
import threading

from ..errors import OffloadError
from .files import identity, same_file
from .leases import FileLeases, handler_installed
from .safetensors_io import TensorLocation


class OpenFiles:
    """Path -> open file descriptor and identity, and the read leases on them."""

    def __init__(self, leases: FileLeases) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._ids: dict[str, tuple] = {}  # path -> identity() when offload() resolved it
        self.leases = leases  # read leases on mapped files (a writer waits, see leases.py)

    def track(self, path: str, expected: tuple | None, tensor: str, mapped: bool) -> None:
        """Open ``path`` now and record its identity (size, inode, mtime, device, ctime); with ``expected``
        (the identity when offload() resolved it) refuse a file that changed since."""
        fd = self.fd(path)
        now = identity(os.fstat(fd))
        if expected is not None and not same_file(expected, now):
            raise OffloadError(changed(tensor, path, expected, now, "since offload() read its header"))
        self._ids.setdefault(path, expected if expected is not None else now)
        if mapped:
            handler_installed()  # offload() runs in the main thread as a rule: the SIGIO handler goes in now

    def fd(self, path: str) -> int:
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

    def checked(self, name: str, loc: TensorLocation) -> int:
        """The open file of tensor ``name``'s bytes at ``loc``, checked to be the file offload() resolved,
        unchanged (same size, inode, mtime, device, ctime: :func:`same_file`) and still covering the tensor:
        a file truncated or rewritten in place would be read as other bytes, or kill the process with
        SIGBUS when a mapping of it is touched past its new end."""
        fd = self.fd(loc.path)
        now = identity(os.fstat(fd))
        expected = self._ids.get(loc.path, now)
        if loc.offset + loc.nbytes > now[0]:
            raise OffloadError(
                f"tensor {name!r}: {loc.path} is truncated ({now[0]} bytes, its bytes end at {loc.offset + loc.nbytes}); "
                f"it changed while the model serves from it: restore the file and offload the model again"
            )
        if not same_file(expected, now):
            raise OffloadError(changed(name, loc.path, expected, now, "since graphpass.offload() resolved it"))
        return fd

    def check_unchanged(self, fd: int, path: str) -> None:
        """Refuse the file at ``path`` (open as ``fd``) if it changed while graphpass.offload() mapped it."""
        expected, now = self._ids.get(path), identity(os.fstat(fd))
        if expected is not None and not same_file(expected, now):
            raise OffloadError(changed("", path, expected, now, "while graphpass.offload() mapped it"))

    def after_fork_in_child(self) -> None:
        """In a child made by ``fork()``: reopen the files, so that the child's leases are its own (see
        ``leases.py``); a file replaced since (renamed over) keeps the inherited description, never leased."""
        self._lock = threading.Lock()
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
        self.leases.after_fork(reopened)

    def close(self) -> None:
        for fd in self._fds.values():
            self.leases.release(fd)
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()


def changed(tensor: str, path: str, expected: tuple, now: tuple, when: str) -> str:
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
    return (
        f"{name}{path} changed {when} ({', '.join(what) or 'identity differs'}): graphpass reads the bytes "
        f"there at every load and refuses a file rewritten, truncated or replaced in place. Restore it, or "
        f"offload a fresh model from the new file; to update a checkpoint in use, write the new file "
        f"under another name and rename it over the old one"
    )
