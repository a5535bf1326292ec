"""The schedule as a timeline: :func:`trace` runs a compiled model under ``torch.profiler`` and writes
a Chrome / Perfetto trace in which every trap, every offload load and every eviction is a range.

    report = graphpass.trace(compiled, x, path="trace.json", plot="trace.png")
    print(report)        # loads, how much of their time was hidden under trap compute, waits

What is recorded, and where (docs/trace.md shows how to read it):

* the profiler's own events (every aten op on the compute thread; on CUDA the kernels and copies on
  their streams, the side stream's host-to-device copies among them);
* on a track ``graphpass compute (thread N)``: one ``graphpass.call`` range per call, inside it one
  ``graphpass.trap/<label>`` range per trap (from its ``trap_enter`` to its ``trap_exit``), the
  ``graphpass.wait/<label>`` ranges (the compute waiting for a load) and the
  ``graphpass.evict/<label>`` ranges (an eviction);
* on the offload worker's own track ``graphpass offload worker (thread N)``: one
  ``graphpass.load/<label>`` range per load the worker performs, from the moment it starts the job to
  the moment the tensors are ready (``args.issued_us``: when the compute issued it).

torch.profiler does not record ``record_function`` ranges of threads it was not started on (the
offload worker), so the runtime reports ranges to a :class:`TraceSink` held in a ``ContextVar``
while :func:`trace` runs (the worker's job is wrapped when the compute thread submits it); after the
run they are merged into the profiler's JSON on its clock, found from clock marks (a
``record_function`` range taken between two ``perf_counter`` readings).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .atomic_files import target_problem
from .errors import ConfigError
from .trace_events import CALL, EVICT, LOAD, SINK, TRAP, WAIT, Span, TraceError, TraceSink, active_sink, record_span  # noqa: F401 (re-exported)

__all__ = ["trace", "TraceReport", "TraceSink", "TraceError", "Span", "active_sink", "record_span"]

log = logging.getLogger("graphpass.trace")

_CLOCK_MARK = "graphpass.trace/clock"
_TRACK_BASE = 1 << 30  # synthetic thread ids of the compute tracks: native id + this (no clash with real ids)


# --- the summary ----------------------------------------------------------------------------------


def _overlap(span: Span, others: list[Span]) -> float:
    """Seconds of ``span`` covered by ``others`` (which do not overlap each other)."""
    return sum(max(0.0, min(span.t1, o.t1) - max(span.t0, o.t0)) for o in others)


@dataclass
class TraceReport:
    """What :func:`trace` recorded: the ranges (``spans``) and where the files went."""

    path: Path
    spans: list[Span]
    calls: int
    plot: Path | None = None
    title: str = ""

    def of(self, cat: str) -> list[Span]:
        return sorted((s for s in self.spans if s.cat == cat), key=lambda s: s.t0)

    def to_dict(self) -> dict[str, Any]:
        """The summary ``graphpass trace --json`` prints (schema in docs/cli.md)."""
        traps, loads, waits = self.of(TRAP), self.of(LOAD), self.of(WAIT)
        load_s = sum(s.t1 - s.t0 for s in loads)
        hidden_s = sum(_overlap(s, traps) for s in loads)
        return {
            "path": str(self.path),
            "plot": None if self.plot is None else str(self.plot),
            "calls": self.calls,
            "call_ms": [round(s.ms, 3) for s in self.of(CALL)],
            "traps": len(traps),
            "loads": len(loads),
            "evictions": len(self.of(EVICT)),
            "waits": len(waits),
            "trap_ms": round(sum(s.ms for s in traps), 3),
            "load_ms": round(load_s * 1e3, 3),
            "hidden_load_ms": round(hidden_s * 1e3, 3),
            "hidden_fraction": round(hidden_s / load_s, 4) if load_s > 0 else None,
            "wait_ms": round(sum(s.ms for s in waits), 3),
        }

    def __str__(self) -> str:
        d = self.to_dict()
        hidden = "" if d["hidden_fraction"] is None else f", {d['hidden_fraction']:.0%} of it under trap compute"
        return (
            f"trace written to {d['path']}: {d['calls']} call(s), {d['traps']} trap ranges, {d['loads']} loads "
            f"({d['load_ms']:.2f} ms on the worker{hidden}), {d['evictions']} evictions, the compute waited "
            f"{d['wait_ms']:.2f} ms on loads; open it in https://ui.perfetto.dev or chrome://tracing"
        )

    def plot_png(self, path: str | os.PathLike[str], size: tuple[int, int] = (1200, 360)) -> Path:
        """Draw the timeline (tracks: compute, worker) to ``path``; needs ``graphpass[plot]``."""
        from .trace_plot import write_png

        self.plot = write_png(self, Path(path), size)
        return self.plot


# --- running and merging --------------------------------------------------------------------------


def _clock_marks(n: int = 5) -> list[tuple[str, float, float]]:
    """``record_function`` ranges each taken between two ``perf_counter`` readings."""
    marks = []
    for i in range(n):
        name = f"{_CLOCK_MARK}{i}"
        before = time.perf_counter()
        with torch.profiler.record_function(name):
            after = time.perf_counter()
        marks.append((name, before, after))
    return marks


def _clock_offset(events: list[dict], marks: list[tuple[str, float, float]]) -> float:
    """Profiler microseconds minus ``perf_counter`` microseconds, from the tightest clock mark."""
    starts = {e.get("name"): e.get("ts") for e in events if e.get("ph") == "X"}
    found = [
        (after - before, starts[name] - (before + after) / 2 * 1e6)
        for name, before, after in marks
        if isinstance(starts.get(name), (int, float))
    ]
    if not found:
        raise TraceError(
            "the profiler's trace holds none of graphpass's clock marks: cannot place the "
            "offload worker's ranges on its clock (is another profiler consuming the events?)"
        )
    return min(found)[1]


def _run_profiled(compiled: Callable, inputs: tuple, kwargs: dict, calls: int, sink: TraceSink):
    from torch.profiler import ProfilerActivity, profile

    from .ops import trace_traps

    if torch.autograd.profiler._is_profiler_enabled:
        raise TraceError("a torch.profiler is already running: graphpass.trace runs its own; call it outside yours")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    token = SINK.set(sink)
    try:
        with trace_traps(recorder=sink), profile(activities=activities) as prof:
            marks = _clock_marks()
            for i in range(calls):
                sink.call = i
                t0 = time.perf_counter()
                compiled(*inputs, **kwargs)
                sink.add(CALL, f"call {i}", t0)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
    finally:
        SINK.reset(token)
    return prof, marks


def _exported(prof: Any) -> dict:
    fd, name = tempfile.mkstemp(prefix="graphpass-trace-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(name)
        with open(name, encoding="utf-8") as f:
            return json.load(f)
    finally:
        os.unlink(name)


def _track_events(spans: list[Span], offset_us: float, pid: int) -> list[dict]:
    """Chrome trace events: the ranges, and a named track per compute thread and per worker."""
    events, tracks = [], {}
    for s in spans:
        compute = s.cat != LOAD
        tid = s.tid + _TRACK_BASE if compute else s.tid
        kind = "compute" if compute else "offload worker"
        tracks.setdefault(tid, (f"graphpass {kind} (thread {s.tid})", 0 if compute else 1))
        args = {"trap": s.label, "call": s.call, **s.args}
        if "issued" in args:
            args["issued_us"] = round(args.pop("issued") * 1e6 + offset_us, 3)
        events.append(
            {
                "ph": "X",
                "cat": s.cat,
                "name": s.cat if s.cat == CALL else f"{s.cat}/{s.label}",
                "pid": pid,
                "tid": tid,
                "ts": round(s.t0 * 1e6 + offset_us, 3),
                "dur": round(max(0.0, s.t1 - s.t0) * 1e6, 3),
                "args": args,
            }
        )
    ts = min((e["ts"] for e in events), default=0.0)  # metadata carry a ts, as the profiler's own do
    for tid, (name, order) in tracks.items():
        events.append({"ph": "M", "name": "thread_name", "ts": ts, "pid": pid, "tid": tid, "args": {"name": name}})
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "ts": ts,
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": -2 + order},
            }
        )
    return events


def _check_args(calls: Any, warmup: Any, plot_size: Any) -> None:
    for key, value, low in (("calls", calls, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(key, value, f"expected an integer >= {low}")
    if not (
        isinstance(plot_size, tuple)
        and len(plot_size) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and 64 <= v <= 8000 for v in plot_size)
    ):
        raise ConfigError("plot_size", plot_size, "expected (width, height) in pixels, each 64..8000")


def check_outputs(path: Any, plot: Any = None, names: tuple[str, str] = ("path", "plot")) -> None:
    """Refuse, before anything runs, an output the trace (``path``) or the plot could not be written to:
    a folder given as the file, a folder that cannot be created or is not writable, one file for both.
    A missing folder is created now (as the writes always did), not after the run."""
    outputs = [(names[0], path, "trace")] + ([(names[1], plot, "timeline plot")] if plot is not None else [])
    for key, value, what in outputs:
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise ConfigError(key, value, f"expected the path of the {what} file to write (e.g. 'trace.json')")
        try:
            Path(value).parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # named below: a file where a folder should be, a folder that cannot be created
        problem = target_problem(value)
        if problem is not None:
            raise TraceError(
                f"{key}: cannot write the {what} to {os.fspath(value)!r}: {problem} (checked before running the model)"
            )
    if plot is not None and os.path.abspath(path) == os.path.abspath(plot):
        raise ConfigError(names[1], os.fspath(plot), f"the same file as {names[0]}: the plot would overwrite the trace")


def trace(
    compiled: Callable,
    *inputs: Any,
    path: str | os.PathLike[str] = "trace.json",
    plot: str | os.PathLike[str] | None = None,
    plot_size: tuple[int, int] = (1200, 360),
    calls: int = 1,
    warmup: int = 1,
    title: str = "",
    **kwargs: Any,
) -> TraceReport:
    """Run ``compiled(*inputs, **kwargs)`` ``warmup`` times (compiling it), then ``calls`` times under
    ``torch.profiler``, and write the Chrome / Perfetto trace to ``path`` (open it in
    https://ui.perfetto.dev or chrome://tracing): the profiler's events plus a range per call, trap,
    load (on the offload worker's track), wait and eviction. With ``plot`` also draw the timeline as a
    PNG of ``plot_size`` pixels (needs ``pip install 'graphpass[plot]'``). Returns a :class:`TraceReport`."""
    _check_args(calls, warmup, plot_size)
    check_outputs(path, plot)
    target = Path(path)
    if plot is not None:  # without matplotlib, fail before running anything
        from .trace_plot import load_pyplot

        load_pyplot()
    for _ in range(warmup):
        compiled(*inputs, **kwargs)
    sink = TraceSink()
    prof, marks = _run_profiled(compiled, inputs, kwargs, calls, sink)
    doc = _exported(prof)
    events = doc.setdefault("traceEvents", [])
    offset = _clock_offset(events, marks)
    doc["traceEvents"] = [e for e in events if not str(e.get("name", "")).startswith(_CLOCK_MARK)]
    doc["traceEvents"] += _track_events(sink.spans, offset, os.getpid())
    doc["graphpass"] = {"calls": calls, "title": title}
    from .atomic_files import write_bytes_atomic

    try:
        write_bytes_atomic(target, json.dumps(doc).encode("utf-8"))
    except OSError as exc:
        raise TraceError(f"cannot write the trace to {str(target)!r}: {exc}") from None
    report = TraceReport(path=target, spans=list(sink.spans), calls=calls, title=title)
    log.info("%s", report)
    if plot is not None:
        report.plot_png(plot, plot_size)
    return report
