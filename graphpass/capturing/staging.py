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
import logging
import numbers
import threading
from typing import Any, Callable, Literal

import torch

from ..errors import CaptureError, ConfigError

log = logging.getLogger("graphpass.capturing.staging")

POLICIES = ("block", "drop")


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

    def __post_init__(self) -> None:
        for key, low in (("max_staged_bytes", 0), ("max_staged_steps", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
                raise ConfigError(key, value, f"must be an int >= {low}")
        if self.when_full not in POLICIES:
            raise ConfigError("when_full", self.when_full, f"must be one of {', '.join(map(repr, POLICIES))}")


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
        self._ring: collections.deque = collections.deque()  # (job, nbytes)
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
        return (self._bytes + nbytes <= self.config.max_staged_bytes
                and self._busy < self.config.max_staged_steps)

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
            self._ring.append((make_job(), nbytes))
            self._bytes += nbytes
            self._busy += 1
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="graphpass-capture-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return "staged"

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
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None:
            thread.join()
        try:
            self.raise_errors()
        except CaptureError as exc:
            log.error("%s", exc)
        if self.dropped:
            log.warning("capture dropped %d step(s) because the writer fell behind (when_full='drop')", self.dropped)

    # -- writer thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ring or self._closed)
                if not self._ring:
                    return
                job, nbytes = self._ring[0]
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
                    self._ring.popleft()
                    self._bytes -= nbytes
                    self._busy -= 1
                    self._cond.notify_all()

