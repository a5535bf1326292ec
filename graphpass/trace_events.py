"""What the offload runtime and the trap ops report while :func:`graphpass.trace` runs: the span
kinds, :class:`Span`, the thread-safe :class:`TraceSink`, and :data:`SINK`, the ``ContextVar``
holding the sink of the current trace (None: nothing is recorded). The recording half of
:mod:`graphpass.tracing`, with no import of it, so the runtime and the plot can use it without a
circle; :mod:`graphpass.tracing` runs the profiler and merges these spans in.
"""

from __future__ import annotations

import contextvars
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import GraphpassError

CALL, TRAP, LOAD, WAIT, EVICT = (
    "graphpass.call",
    "graphpass.trap",
    "graphpass.load",
    "graphpass.wait",
    "graphpass.evict",
)


class TraceError(GraphpassError):
    """The trace cannot be recorded or written (a profiler already running, an unwritable path)."""


@dataclass(frozen=True)
class Span:
    """One range: ``cat`` (``graphpass.trap`` ...), ``label`` (the trap), the thread that ran it,
    ``t0`` / ``t1`` in ``time.perf_counter()`` seconds, the call it belongs to and details."""

    cat: str
    label: str
    tid: int  # threading.get_native_id() of the thread that ran it
    thread: str
    t0: float
    t1: float
    call: int
    args: dict = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return (self.t1 - self.t0) * 1e3


class TraceSink:
    """Collects :class:`Span` s while :func:`trace` runs: from the compute thread (trap boundaries,
    through :func:`graphpass.trace_traps`; waits and evictions, from the offload runtime) and from
    the offload worker (the jobs the runtime wraps with :meth:`worker_job`). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[Span] = []
        self.call = 0
        self._open: dict[tuple[int, str], list[float]] = {}

    def add(
        self, cat: str, label: str, t0: float, t1: float | None = None, call: int | None = None, **args: Any
    ) -> None:
        t1 = time.perf_counter() if t1 is None else t1
        th = threading.current_thread()
        span = Span(cat, label, threading.get_native_id(), th.name, t0, t1, self.call if call is None else call, args)
        with self._lock:
            self.spans.append(span)

    def append(self, event: tuple) -> None:
        """A :func:`graphpass.trace_traps` recorder: ``("enter"|"exit", label)`` opens / closes a trap range."""
        kind, label = event
        key = (threading.get_native_id(), label)
        if kind == "enter":
            self._open.setdefault(key, []).append(time.perf_counter())
        elif kind == "exit" and self._open.get(key):
            self.add(TRAP, label, self._open[key].pop())

    def worker_job(self, label: str, job: Callable, **args: Any) -> Callable:
        """``job`` wrapped to record a ``graphpass.load/<label>`` range on the thread that runs it."""
        issued, call = time.perf_counter(), self.call

        def traced(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return job(*a, **kw)
            finally:
                self.add(LOAD, label, t0, call=call, issued=issued, **args)

        return traced


SINK: contextvars.ContextVar[TraceSink | None] = contextvars.ContextVar("graphpass_trace_sink", default=None)


def active_sink() -> TraceSink | None:
    """The sink :func:`trace` set for the current context, or None (then nothing is recorded)."""
    return SINK.get()


def record_span(cat: str, label: str, t0: float) -> None:
    """Record a range from ``t0`` (``perf_counter``) to now on the current thread, if :func:`trace` runs."""
    sink = SINK.get()
    if sink is not None:
        sink.add(cat, label, t0)
