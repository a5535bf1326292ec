"""The files graphpass writes for ``storage="disk"``: their names, their cleanup, and file identity.

* Names: ``graphpass-offload-<Class>-<pid>-<token>-<hex>.safetensors``: the writer's process id and
  a token of that process's start (its start time in clock ticks since boot, from
  ``/proc/<pid>/stat``, and the boot id), so a later process can tell a file of a live writer from
  a file left by a dead one even when the pid was reused.
* Cleanup: a file is removed when its model's offload state is garbage-collected, at normal
  interpreter exit, and on ``SIGTERM`` (a handler is installed only where the default disposition
  is in place: it removes this process's files and then dies of ``SIGTERM`` as before). A
  ``SIGKILL`` or ``os._exit`` leaves the file behind: the next :func:`graphpass.offload` into the
  same folder removes the files of writers that are no longer alive (:func:`remove_stale`), and
  graphpass temporary files (``.graphpass-*.tmp``) last modified before the current process started.
* Identity: ``(st_size, st_ino, st_mtime_ns, st_dev)`` of a file, recorded when ``offload()``
  resolves it and compared before every read or mapping of it (:func:`identity`).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import signal
import threading
import time

from ..atomic_files import is_temp_name

_NAME = re.compile(
    r"^graphpass-offload-(?P<cls>\w+)-(?P<pid>\d+)-(?P<token>[0-9a-f]+)-(?P<hex>[0-9a-f]+)\.safetensors$"
)

# Paths of the files this process wrote and still serves (removed on SIGTERM). Process-wide on
# purpose: a signal handler has no model to ask; entries are removed with their model's state.
_LIVE: set[str] = set()
_LIVE_LOCK = threading.Lock()
_SIGTERM = {"installed": False}


def identity(st: os.stat_result) -> tuple[int, int, int, int, int, int]:
    """What must not change in a file graphpass serves from: size, inode, modification time, device,
    status-change time, link count (compared by :func:`same_file`)."""
    return (st.st_size, st.st_ino, st.st_mtime_ns, st.st_dev, st.st_ctime_ns, st.st_nlink)


def same_file(expected: tuple | None, now: tuple) -> bool:
    """Whether the file of identity ``now`` is the one recorded as ``expected``, unchanged.

    Size, inode, device and mtime must be equal, and the ctime too: a rewrite in place with the old
    mtime restored (``touch -d``, ``os.utime``) still moves the ctime, which no user can set. A ctime
    that moved together with the link count is a rename over the file, its removal or a new hard
    link: the bytes are the same (the open file keeps them), so that is no change. (A chmod or chown
    moves the ctime alone: it counts as a change.)"""
    if expected is None or now[:4] != expected[:4]:
        return False
    return now[4] == expected[4] or now[5] != expected[5]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time)`` of process ``pid`` from ``/proc``, or None where there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except FileNotFoundError:
        return ("X", "")  # no such process
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return (fields[0], fields[19]) if len(fields) > 19 else None


def process_token(pid: int) -> str | None:
    """A short hex token of process ``pid``'s start (boot id + start time); None if it is not running;
    ``"0"`` where ``/proc`` cannot tell (then only the pid is compared)."""
    stat = _proc_stat(pid)
    if stat is None:
        return "0" if _alive(pid) else None
    state, start = stat
    if state in ("X", "Z", "x"):  # gone, or a zombie: dead for our purpose
        return None
    return hashlib.sha1(f"{_boot_id()}/{start}".encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def file_name(cls_name: str) -> str:
    """A new name for a weights file this process writes."""
    pid = os.getpid()
    cls_name = re.sub(r"\W", "_", cls_name) or "Module"
    return f"graphpass-offload-{cls_name}-{pid}-{process_token(pid) or '0'}-{secrets.token_hex(4)}.safetensors"


def _process_start() -> float:
    """When this process started (seconds since the epoch); the import time where /proc cannot tell."""
    stat = _proc_stat(os.getpid())
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + int(stat[1]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, TypeError, IndexError, AttributeError):
        return _IMPORTED


_IMPORTED = time.time()


def remove_stale(folder: str | os.PathLike) -> list[str]:
    """Remove, from ``folder``, weights files whose writer process is gone (or whose pid now names
    another process) and graphpass temporary files last modified before this process started.
    Files of live writers, files without a pid in their name and everything else are kept.
    Returns the paths removed."""
    removed: list[str] = []
    started = _process_start()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            m = _NAME.match(entry.name)
            if m is not None:
                pid, token = int(m.group("pid")), m.group("token")
                now = process_token(pid)
                stale = now is None or (token != "0" and now != "0" and now != token)
            else:
                stale = is_temp_name(entry.name) and entry.stat(follow_symlinks=False).st_mtime < started
            if stale:
                os.unlink(entry.path)
                removed.append(entry.path)
        except OSError:
            continue  # removed by someone else meanwhile, or not ours to remove
    return removed


def track(path: str) -> None:
    """Remember ``path`` as a file of this process (removed on SIGTERM); install the handler."""
    with _LIVE_LOCK:
        _LIVE.add(str(path))
    _install_sigterm()


def untrack(path: str) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(str(path))


def written_here(path: str) -> bool:
    """Was ``path`` written by this process (its pid in the name)? A child made by fork() shares its
    parent's models but not their files: it must not remove them when its copy of a model goes."""
    m = _NAME.match(os.path.basename(str(path)))
    return m is not None and int(m.group("pid")) == os.getpid()


def _after_fork_in_child() -> None:
    global _LIVE_LOCK
    _LIVE_LOCK = threading.Lock()
    _LIVE.clear()  # the parent's files: a SIGTERM of the child leaves them alone


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def remove_all() -> None:
    """Remove every file this process still serves from (SIGTERM)."""
    with _LIVE_LOCK:
        paths = list(_LIVE)
        _LIVE.clear()
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def _on_sigterm(signum, frame) -> None:
    remove_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # then die of SIGTERM, as without graphpass
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    """Install the SIGTERM cleanup once, from the main thread, and only over the default disposition:
    a handler the program set itself is left alone (its own exit path runs the atexit cleanup)."""
    if _SIGTERM["installed"] or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError, AttributeError):  # not the main interpreter, or no SIGTERM
        return
    _SIGTERM["installed"] = True
