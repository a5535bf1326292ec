"""Write-behind for capture steps: a bounded staging ring and one writer thread per ``ModelCapture``.

A step saved without ``wait`` (``step(wait=False)``, every ``auto_steps`` step by default) is
*staged*: its captured values (already private copies, made by the capture op; values on an
accelerator are copied to host memory here) go into a ring, and a writer thread writes them
(:meth:`CaptureWriter.write_reserved`, so every file goes through :mod:`graphpass.atomic_files`)
while the model computes the next steps. The step's folder name and ``step_index`` are reserved
when it is staged, so names and order are those of the calls, whatever the writer's pace.

Bounds (:class:`StagingConfig`): the ring holds at most ``max_staged_bytes`` bytes of captured
values and at most ``max_staged_steps`` steps. When a step does not fit, ``when_full`` says what
happens: ``"block"`` (default) waits, on the saving thread, until the writer has made room (a
step larger than ``max_staged_bytes`` on its own waits for the ring to empty and is then written
on the saving thread: the ring never holds more than the bound); ``"drop"`` drops the step (its
name is skipped, so later steps keep their names and compare reports the dropped one missing),
counts it (:attr:`WriteBehind.dropped`, each step's meta ``dropped_steps``) and logs a warning.

Nothing completed is lost: :meth:`WriteBehind.flush` waits until every staged step is on disk
(``ModelCapture.flush``, ``disable``, a step saved with ``wait=True``, ``auto_steps``' exit),
and a ``weakref.finalize`` flushes at interpreter exit (or when the ``ModelCapture`` is
collected). A background write that fails is rolled back like any failed write (no partial
file) and its ``CaptureError`` is raised by the next save, ``flush`` or ``disable`` on the
saving side (logged at exit).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import mmap
import numbers
import os
import signal
import struct
import subprocess
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Literal

import torch

from ..errors import CaptureError, ConfigError
from .writer import _jsonable, plain_dtype

log = logging.getLogger("graphpass.capturing.staging")

POLICIES = ("block", "drop")
WRITERS = ("auto", "process", "thread")


@dataclasses.dataclass(frozen=True)
class StagingConfig:
    """How capture steps saved without ``wait`` are staged and written behind the compute.

    ``max_staged_bytes``: most bytes of captured values held by steps waiting to be written
    (default 256 MiB). ``max_staged_steps``: most steps waiting (default 64). ``when_full``:
    ``"block"`` (wait for the writer) or ``"drop"`` (drop the step, counted and logged).
    """

    max_staged_bytes: int = 256 << 20
    max_staged_steps: int = 64
    when_full: Literal["block", "drop"] = "block"
    writer: Literal["auto", "process", "thread"] = "auto"

    def __post_init__(self) -> None:
        for key, low in (("max_staged_bytes", 0), ("max_staged_steps", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
                raise ConfigError(key, value, f"must be an int >= {low}")
        if self.when_full not in POLICIES:
            raise ConfigError("when_full", self.when_full, f"must be one of {', '.join(map(repr, POLICIES))}")
        if self.writer not in WRITERS:
            raise ConfigError("writer", self.writer, f"must be one of {', '.join(map(repr, WRITERS))}")
        if self.writer == "process" and not process_writer_available():
            raise ConfigError(
                "writer",
                self.writer,
                "a writer process needs os.memfd_create (Linux) and sys.executable: use 'thread' or 'auto' here",
            )


def check_staging(value: Any) -> StagingConfig:
    """``ModelCapture(staging=...)``: None (defaults), a :class:`StagingConfig` or a dict of its fields."""
    if value is None:
        return StagingConfig()
    if isinstance(value, StagingConfig):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(StagingConfig)})
        if unknown:
            raise ConfigError("staging", value, f"unknown field(s) {', '.join(unknown)}")
        return StagingConfig(**value)
    raise ConfigError("staging", value, "expected a StagingConfig, a dict of its fields, or None")


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a captured value (a value already on the host is a private clone: kept)."""
    if t.device.type == "cpu":
        return t
    return t.to("cpu")


def staged_bytes(tensors: list[tuple]) -> int:
    return sum(e[1].numel() * e[1].element_size() for e in tensors if isinstance(e[1], torch.Tensor))


class WriteBehind:
    """The staging ring and its writer thread (started on the first staged step).

    ``write(job)``: writes one staged step; ``job`` is what :meth:`stage` was given."""

    def __init__(self, config: StagingConfig, write: Callable[[Any], Any]) -> None:
        self.config = config
        self._write = write
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (job, nbytes) for the writer thread
        self._bytes = 0  # bytes in the ring and in the write under way
        self._busy = 0  # steps staged and not yet finished (ring + the one being written)
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0  # steps dropped under when_full="drop"
        self.written = 0  # staged steps written
        self.peak_bytes = 0  # most bytes the ring held at once

    # -- saving side -------------------------------------------------------------------------------
    def fits(self, nbytes: int) -> bool:
        return self._bytes + nbytes <= self.config.max_staged_bytes and self._busy < self.config.max_staged_steps

    def submit(self, nbytes: int, make_job: Callable[[], Any]) -> str:
        """Stage a step of ``nbytes``: ``make_job()`` (called under the ring's lock, so steps are
        named in the order they are staged) builds what the writer gets. Returns ``"staged"``;
        ``"dropped"`` (``drop``, no room: ``make_job`` was still called, so the step's name is
        taken and stays a gap); or ``"caller"`` (``block``, a step larger than the bound alone:
        nothing staged, the ring is empty, the caller writes it)."""
        with self._cond:
            if not self.fits(nbytes):
                if self.config.when_full == "drop":
                    make_job()
                    self.dropped += 1
                    return "dropped"
                too_big = nbytes > self.config.max_staged_bytes
                self._cond.wait_for(lambda: (self._busy == 0) if too_big else self.fits(nbytes))
                if too_big:
                    return "caller"
            if self._closed:
                raise CaptureError("capture step saved after the capture's writer was closed (interpreter exit)")
            job = make_job()
            self._bytes += nbytes
            self._busy += 1
            try:
                self._push(job, nbytes)
            except BaseException:
                self._bytes -= nbytes
                self._busy -= 1
                raise
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            self._cond.notify_all()
            return "staged"

    def nbytes(self, tensors: list[tuple]) -> int:
        """What a step of ``tensors`` (``(name, value, ...)`` entries) counts against ``max_staged_bytes``."""
        return staged_bytes(tensors)

    def carries(self, tensors: list[tuple]) -> bool:
        """Can a step of ``tensors`` be staged (else it is written on the saving thread)?"""
        return True

    def _push(self, job: Any, nbytes: int) -> None:
        """Hand a staged step to the writer (called with the lock held)."""
        self._queue.append((job, nbytes))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="graphpass-capture-writer", daemon=True)
            self._thread.start()

    def wait_idle(self) -> None:
        """Wait until every staged step is written (failures stay pending for :meth:`raise_errors`)."""
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0)

    def flush(self) -> None:
        """Wait until every staged step is written; raise the first background failure since the
        last flush (``CaptureError``), if any."""
        self.wait_idle()
        self.raise_errors()

    def raise_errors(self) -> None:
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            first = errors[0]
            more = f" (and {len(errors) - 1} more failed step(s))" if len(errors) > 1 else ""
            raise CaptureError(f"a capture step written in the background failed: {first}{more}") from first

    @property
    def pending(self) -> int:
        """Steps staged and not yet written."""
        return self._busy

    def close(self) -> None:
        """Flush (errors are logged, not raised) and stop the writer thread. Idempotent."""
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0)
            self._closed = True
            self._cond.notify_all()
        self._stop()
        try:
            self.raise_errors()
        except CaptureError as exc:
            log.error("%s", exc)
        if self.dropped:
            log.warning("capture dropped %d step(s) because the writer fell behind (when_full='drop')", self.dropped)

    # -- writer thread -----------------------------------------------------------------------------
    def _stop(self) -> None:
        """After the last step is written (lock not held): end the writer thread."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        _leave_signals_to_the_main_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job, nbytes = self._queue[0]
            try:
                self._write(job)
            except BaseException as exc:  # noqa: BLE001 - reported on the saving side
                with self._cond:
                    self._errors.append(exc)
                log.error("capture step written in the background failed: %s", exc)
            else:
                self.written += 1
            finally:
                with self._cond:
                    self._queue.popleft()
                    self._bytes -= nbytes
                    self._busy -= 1
                    self._cond.notify_all()


# -- the writer process ---------------------------------------------------------------------------


def process_writer_available() -> bool:
    """A writer process needs a shareable memory file (``os.memfd_create``: Linux) and an interpreter to start."""
    return hasattr(os, "memfd_create") and bool(sys.executable)


class StagingRing:
    """A shared memory file of ``capacity`` bytes the saving process copies staged values into and
    the writer process reads; regions are taken and given back first in, first out."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.fd = os.memfd_create("graphpass-capture-staging", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(self.fd, self.capacity)  # pages are allocated when first written
            self._map = mmap.mmap(self.fd, self.capacity)
        except BaseException:
            os.close(self.fd)
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "non-writable buffer": an mmap is writable
            self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._regions: collections.deque = collections.deque()  # (start, end), oldest first
        self._head = 0  # where the next region starts

    def place(self, n: int) -> int | None:
        """The start of a free region of ``n`` bytes (None: none now), without taking it."""
        if not self._regions:
            return 0 if n <= self.capacity else None
        tail = self._regions[0][0]
        if self._head > tail:  # in use: [tail, head); free: [head, capacity) and [0, tail)
            if self._head + n <= self.capacity:
                return self._head
            return 0 if n <= tail else None
        return self._head if self._head + n <= tail else None  # wrapped: free [head, tail) (none when equal)

    def take(self, n: int) -> int:
        """Take ``n > 0`` bytes where :meth:`place` says."""
        start = self.place(n)
        assert start is not None
        self._regions.append((start, start + n))
        self._head = start + n
        return start

    def untake(self) -> None:
        """Give back the newest region (a step that could not be sent)."""
        start, _ = self._regions.pop()
        self._head = start if self._regions else 0

    def give_back(self) -> None:
        """Free the oldest region."""
        self._regions.popleft()
        if not self._regions:
            self._head = 0

    def close(self) -> None:
        self.bytes = None
        try:
            self._map.close()
        except BufferError:  # a view still exported: the mapping goes with the last reference
            pass
        os.close(self.fd)


class ProcessWriteBehind(WriteBehind):
    """Write-behind to a writer process (:mod:`graphpass.capturing.writer_child`): each staged
    step's values are copied into a :class:`StagingRing` (its ``max_staged_bytes``) and its plan is
    sent down a pipe; a thread of this process reads the writer's replies and frees ring space.

    ``writer``: the capture's ``CaptureWriter`` (a step's records and where its folders go)."""

    def __init__(self, config: StagingConfig, write: Callable[[Any], Any], writer: Any) -> None:
        super().__init__(config, write)
        self._writer = writer  # the CaptureWriter: records and folders of a step
        self._pid = os.getpid()
        self._ring: StagingRing | None = None
        self._proc: subprocess.Popen | None = None
        self._inflight: collections.deque = collections.deque()  # (seq, nbytes), oldest first
        self._seq = 0
        if hasattr(os, "register_at_fork"):
            me = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _forget_parent(me))

    def carries(self, tensors: list[tuple]) -> bool:
        """Values of a dtype the plain encoder does not know (``safetensors.torch.save`` encodes them,
        in this process): written on the saving thread."""
        return all(plain_dtype(e[1]) is not None for e in tensors if isinstance(e[1], torch.Tensor))

    def fits(self, nbytes: int) -> bool:
        ring = self._ring
        return super().fits(nbytes) and (ring is None or ring.place(nbytes) is not None or nbytes == 0)

    def _start(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's ring and writer are not this process's
            self._forget_parent()
        if self._proc is not None:
            return
        if self._ring is not None:  # the last writer process died: start over
            self._ring.close()
        self._ring = StagingRing(self.config.max_staged_bytes)
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _CHILD, str(self._ring.fd), str(self._ring.capacity)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(self._ring.fd,),
            start_new_session=True,
        )  # its own process group: a terminal's Ctrl-C never reaches it
        self._thread = threading.Thread(
            target=self._read_replies, args=(self._proc,), name="graphpass-capture-replies", daemon=True
        )
        self._thread.start()

    def _forget_parent(self) -> None:
        """In a forked child: drop the parent's writer (never write into its ring) and its counts;
        a new lock (another thread may have held the parent's when it forked)."""
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._ring, self._proc, self._thread = None, None, None
        self._inflight.clear()
        self._bytes = self._busy = 0

    def _push(self, job: Any, nbytes: int) -> None:
        """Copy the step's values into the ring and send the step (called with the lock held): the
        writer process plans it (:func:`~graphpass.capturing.step_files.plan_step`) and writes it."""
        self._start()
        tensors, step = job
        records, buffers = self._writer.records(tensors)
        at = self._ring.take(nbytes) if nbytes else 0
        spans, flat = [], []
        for b in buffers:
            n = b.numel() * b.element_size()
            spans.append((at, n))
            at += n
            if n:
                flat.append(b.reshape(-1).view(torch.uint8))
        if flat:  # one copy into the ring for the whole step
            torch.cat(flat, out=self._ring.bytes[spans[0][0] : at])
        w = self._writer
        self._seq += 1
        body = json.dumps(
            {
                "seq": self._seq,
                "records": records,
                "spans": spans,
                "step": step,
                "writer": [os.fspath(w.capture_dir), w.dp_rank, w.tp_rank, w.tp_size],
            },
            default=_jsonable,
        ).encode("utf-8")
        try:
            self._proc.stdin.write(struct.pack("<I", len(body)) + body)
            self._proc.stdin.flush()
        except OSError as exc:  # the writer is gone (its reply thread reports the steps it held)
            if nbytes:
                self._ring.untake()
            self._proc = None  # the next staged step starts a new one
            raise CaptureError(
                f"capture step not staged: the capture writer process is gone ({exc}); the next step starts a new one"
            ) from exc
        self._inflight.append((self._seq, nbytes))

    def _read_replies(self, proc: subprocess.Popen) -> None:
        _leave_signals_to_the_main_thread()
        for line in proc.stdout:
            reply = json.loads(line)
            with self._cond:
                if not self._inflight or self._inflight[0][0] != reply["seq"]:
                    continue
                self._done(reply.get("error"))
        code = proc.wait()
        with self._cond:
            lost = len(self._inflight)
            while self._inflight:
                self._done(f"the capture writer process exited (code {code}) before writing this step")
            if self._proc is proc:
                self._proc = None  # the next staged step starts a new one
            if lost:
                log.error("capture writer process exited (code %s) with %d step(s) unwritten", code, lost)

    def _done(self, error: str | None) -> None:
        """The oldest in-flight step is finished (lock held)."""
        _, nbytes = self._inflight.popleft()
        if nbytes:
            self._ring.give_back()
        if error:
            self._errors.append(CaptureError(error))
            log.error("capture step written in the background failed: %s", error)
        else:
            self.written += 1
        self._bytes -= nbytes
        self._busy -= 1
        self._cond.notify_all()

    def _stop(self) -> None:
        """After the last step is written (lock not held): end the writer process and the reply thread."""
        proc, thread, ring = self._proc, self._thread, self._ring
        self._proc = self._thread = self._ring = None
        if proc is None or self._pid != os.getpid():
            return
        try:
            proc.stdin.close()  # end of input: it exits after the steps it has
        except OSError:
            pass
        proc.wait()
        if thread is not None:
            thread.join()
        ring.close()


_MAIN_THREAD_SIGNALS = {getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n)}


def _leave_signals_to_the_main_thread() -> None:
    """Block the terminal's signals in this background thread. The kernel hands a signal sent to the
    process to any thread that does not block it; Python then only sets a flag, and a main thread
    sleeping or waiting in C (``time.sleep``, a blocking read) is not woken: Ctrl-C would wait for it.
    Blocked here, it goes to a thread that can take it, normally the main one."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, _MAIN_THREAD_SIGNALS)


def _forget_parent(ref: "weakref.ref[ProcessWriteBehind]") -> None:
    behind = ref()
    if behind is not None:
        behind._forget_parent()


def make_write_behind(config: StagingConfig, writer: Any) -> WriteBehind:
    """The write-behind of a ``ModelCapture`` whose :class:`CaptureWriter` is ``writer``: a writer
    process where ``config.writer`` asks for one or (``"auto"``) the system has what it needs, else
    a writer thread."""
    write = lambda job: writer.write_reserved(job[0], **job[1])  # noqa: E731
    if config.writer == "thread" or not process_writer_available():
        return WriteBehind(config, write)
    return ProcessWriteBehind(config, write, writer)


_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_child.py")
