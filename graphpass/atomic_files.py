"""Writing files so that nothing half-written is ever read as data, and no planted link is followed.

Every file graphpass writes (capture steps and their meta, offload weight files) goes through
:func:`write_atomic`: the bytes go to a new temporary file created exclusively in the target
folder (``O_CREAT | O_EXCL | O_NOFOLLOW``, a random name: an existing file or a link planted at that
name is never opened), are flushed, and the file is renamed onto its final name (``os.replace``
replaces a link at the final name itself, never writes through it). On any failure the temporary
file is removed and the error propagates.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import Callable, Iterator, Sequence


def _iov_max() -> int:
    """Buffers one ``writev`` call takes here (POSIX guarantees at least 16)."""
    try:
        return max(16, min(int(os.sysconf("SC_IOV_MAX")), 1024))
    except (AttributeError, ValueError, OSError):
        return 16


_IOV_MAX = _iov_max()
TMP_PREFIX, TMP_SUFFIX = ".graphpass-", ".tmp"  # short: a long final name never makes the temp name too long


def temp_names() -> Iterator[str]:
    """Candidate temporary names (random; a test may replace this to force a collision)."""
    while True:
        yield f"{TMP_PREFIX}{secrets.token_hex(8)}{TMP_SUFFIX}"


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
CREATE_FLAGS = _CREATE  # a new file, created exclusively, never through a link


def create_temp(folder: str | os.PathLike) -> tuple[int, str]:
    """Create a new file exclusively in ``folder``: never opens an existing file or follows a link.
    Returns its descriptor and path (a str: capture writes many small files, pathlib costs)."""
    flags = _CREATE
    folder = os.fspath(folder)
    for _, name in zip(range(100), temp_names()):
        path = os.path.join(folder, name)
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(folder))


def probe_writable(folder: str | os.PathLike) -> None:
    """Create and remove a temporary file in ``folder``: raises the ``OSError`` a write there would."""
    fd, probe = create_temp(folder)
    os.close(fd)
    os.unlink(probe)


def target_problem(path: str | os.PathLike) -> str | None:
    """Why :func:`write_atomic` could not write ``path`` (a folder there, a missing or unwritable
    folder), checked now by creating and removing a temporary file beside it; None if it could."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        return "it is a folder, not a file"
    if not folder.is_dir():
        return f"its folder {str(folder)!r} " + ("is not a folder" if os.path.lexists(folder) else "does not exist")
    try:
        probe_writable(folder)
    except OSError as exc:
        return f"its folder {str(folder)!r} is not writable ({exc.strerror or exc})"
    return None


def write_all(fd: int, data: bytes | memoryview | Sequence) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write less than asked); a list or
    tuple of buffers is written back to back (one ``writev`` where the system has it)."""
    if not isinstance(data, (list, tuple)):
        view = memoryview(data).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]
        return
    views = [memoryview(d) for d in data]
    n = 0
    if hasattr(os, "writev") and len(views) <= _IOV_MAX:  # mostly written by this one call, no slicing
        n = os.writev(fd, views)
        if n == sum(v.nbytes for v in views):
            return
    views = [v for v in (v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views) if v.nbytes]
    if not hasattr(os, "writev"):
        for v in views:
            write_all(fd, v)
        return
    while True:
        while n and views:  # drop what was written, keep the rest of a buffer written in part
            if n >= views[0].nbytes:
                n -= views.pop(0).nbytes
            else:
                views[0], n = views[0][n:], 0
        if not views:
            return
        n = os.writev(fd, views[:_IOV_MAX])


def write_atomic(path: str | os.PathLike, write: Callable[[int], None], fsync: bool = False) -> bool:
    """Create or replace ``path`` with what ``write(fd)`` writes, atomically. Returns whether
    ``path`` is new (it did not exist before)."""
    path = os.fspath(path)
    existed = os.path.lexists(path)
    fd, tmp = create_temp(os.path.dirname(path) or ".")
    try:
        try:
            write(fd)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return not existed


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> bool:
    """:func:`write_atomic` of a bytes object."""
    return write_atomic(path, lambda fd: write_all(fd, data))


def is_temp_name(name: str) -> bool:
    """A name :func:`create_temp` makes (a leftover of an interrupted write when found later)."""
    return name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX)
