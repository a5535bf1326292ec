"""The timeline of a :class:`graphpass.tracing.TraceReport` as a PNG (``graphpass.trace(..., plot=...)``,
``graphpass trace --plot``).

Two tracks per compute thread and one per offload worker, time in milliseconds from the first call:
``compute: traps`` (one bar per trap range, labelled), ``compute: waits, evictions`` (red: the
compute waiting for a load; purple: an eviction) and ``worker: loads`` (one bar per load, from the
moment the worker starts it to the moment it is ready; a thin line before it from when the compute
issued it). A load that lies under a trap bar of the compute track is hidden by compute; a red wait
is time the compute stood still.

matplotlib is optional (``pip install 'graphpass[plot]'``), imported only here with the Agg backend.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Protocol

from .atomic_files import write_bytes_atomic
from .trace_events import CALL, EVICT, LOAD, TRAP, WAIT, Span, TraceError


class PlottedReport(Protocol):
    """What the plot reads of a :class:`graphpass.tracing.TraceReport` (which calls this module to draw
    itself: the plot names its needs here instead of importing it back)."""

    spans: list[Span]
    title: str

    def of(self, cat: str) -> list[Span]: ...

    def to_dict(self) -> dict[str, Any]: ...


DPI = 100
TRAP_COLORS = ("#4c78a8", "#72b7b2")
COLORS = {LOAD: "#54a24b", WAIT: "#e45756", EVICT: "#b279a2", CALL: "#dddddd"}


def load_pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or PlotUnavailableError naming the extra to install."""
    from .comparing.plots import load_pyplot as load

    return load("the trace timeline (plot=... / --plot)")


def _tracks(report: PlottedReport) -> list[tuple[str, list]]:
    """``[(track name, [(span, color), ...]), ...]`` top to bottom."""
    tracks: dict[str, list] = {}
    several = len({(s.cat == LOAD, s.tid) for s in report.spans}) > 2  # name the threads only then
    for s in report.spans:
        thread = f" {s.tid}" if several else ""
        if s.cat == TRAP:
            tracks.setdefault(f"compute{thread}: traps", []).append((s, None))
        elif s.cat in (WAIT, EVICT):
            tracks.setdefault(f"compute{thread}: waits, evictions", []).append((s, COLORS[s.cat]))
        elif s.cat == LOAD:
            tracks.setdefault(f"worker{thread}: loads", []).append((s, COLORS[LOAD]))
    order = sorted(tracks, key=lambda name: (name.startswith("worker"), name))
    return [(name, sorted(tracks[name], key=lambda p: p[0].t0)) for name in order]


def _draw(ax: Any, report: PlottedReport, origin: float, px_per_ms: float) -> None:
    tracks = _tracks(report)
    for s in report.of(CALL):  # the calls as a light background
        ax.axvspan((s.t0 - origin) * 1e3, (s.t1 - origin) * 1e3, color=COLORS[CALL], alpha=0.35, lw=0)
    for row, (_, pairs) in enumerate(tracks):
        y = len(tracks) - 1 - row
        for i, (s, color) in enumerate(pairs):
            x0, width = (s.t0 - origin) * 1e3, max((s.t1 - s.t0) * 1e3, 1.5 / px_per_ms)  # at least 1.5 px
            face = color or TRAP_COLORS[i % 2]
            ax.broken_barh(
                [(x0, width)],
                (y - 0.35, 0.7),
                facecolors=face,
                edgecolors="white",
                linewidth=0.5 if s.cat == TRAP else 0,
            )
            if s.cat == LOAD and "issued" in s.args and s.args["issued"] < s.t0:
                ax.plot([(s.args["issued"] - origin) * 1e3, x0], [y, y], color=face, lw=1, alpha=0.7)
            text = s.label
            if s.cat in (TRAP, LOAD) and width * px_per_ms > 6 * len(text) + 6:  # only where it fits
                ax.text(x0 + width / 2, y, text, ha="center", va="center", fontsize=7, color="white", clip_on=True)
    ax.set_yticks(range(len(tracks)), [name for name, _ in reversed(tracks)], fontsize=8)
    ax.set_ylim(-0.6, len(tracks) - 0.4)
    ax.set_xlabel("ms from the first traced call", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3)


def render_png(report: PlottedReport, size: tuple[int, int] = (1200, 360), dpi: int = DPI) -> bytes:
    """The timeline as PNG bytes of exactly ``size`` = (width, height) pixels."""
    plt = load_pyplot()
    from matplotlib.patches import Patch

    if not report.spans:
        raise TraceError("nothing was traced: no call, trap or load ranges to draw")
    origin = min(s.t0 for s in report.spans)
    end = max(s.t1 for s in report.spans)
    fig = plt.figure(figsize=(size[0] / dpi, size[1] / dpi), dpi=dpi, layout="constrained")
    try:
        ax = fig.add_subplot(1, 1, 1)
        span_ms = (end - origin) * 1e3 * 1.01
        ax.set_xlim(0, span_ms)
        _draw(ax, report, origin, px_per_ms=0.8 * size[0] / max(span_ms, 1e-9))
        d = report.to_dict()
        hidden = "" if d["hidden_fraction"] is None else f"{d['hidden_fraction']:.0%} of load time under trap compute, "
        ax.set_title(
            f"{report.title + ': ' if report.title else ''}{d['loads']} loads, {hidden}"
            f"compute waited {d['wait_ms']:.1f} ms of {sum(d['call_ms']):.1f} ms",
            fontsize=9,
        )
        handles = [
            Patch(color=TRAP_COLORS[0], label="trap"),
            Patch(color=COLORS[LOAD], label="load (worker)"),
            Patch(color=COLORS[WAIT], label="wait (compute idle)"),
            Patch(color=COLORS[EVICT], label="eviction"),
        ]
        fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncols=4, frameon=False)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    finally:
        plt.close(fig)
    return buf.getvalue()


def write_png(report: PlottedReport, path: Path, size: tuple[int, int] = (1200, 360)) -> Path:
    """Write :func:`render_png` to ``path`` atomically; returns the path."""
    data = render_png(report, size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, data)
    except OSError as exc:
        raise TraceError(f"cannot write the timeline plot to {str(path)!r}: {exc}") from None
    return path
