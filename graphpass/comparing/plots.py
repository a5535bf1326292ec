"""Divergence as a picture: :func:`plot_report` (PNG) and :func:`write_html` (one self-contained page).

``plot_report`` draws one small panel per captured step: every captured module in execution order
on the x axis, its relative error on a log y axis (relative L∞ ``max|t-r| / max|r|`` as dots and
relative L2 as a line, the worst rank / key of the module), the tolerance line at ``rtol``, failing
modules in red and the step's first diverging module marked with a dashed line (and named). Rows
without numbers (a missing module, an unreadable file) are drawn as red crosses at the top.

matplotlib is an optional dependency (``pip install 'graphpass[plot]'``); it is imported only
here, with the Agg backend (no display needed). Without it, :class:`PlotUnavailableError`.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

from ..atomic_files import write_bytes_atomic
from ..errors import GraphpassError
from .report_format import HEADERS, fmt_value, printable

__all__ = [
    "PlotUnavailableError",
    "plot_report",
    "render_png",
    "write_html",
    "html_page",
    "figure_pixels",
    "step_series",
    "read_metas",
]


# What the plots read of a report and its rows, named here so this module never imports the report
# (compare_report imports it to draw itself).
class RowView(Protocol):
    """What the plots read of one row (:class:`~graphpass.comparing.compare_report.CompareRow`)."""

    step: str
    module: str
    rank: int | None
    key: str | None
    status: str
    max_abs: float | None
    rel_l2: float | None
    rel_linf: float | None
    note: str

    @property
    def passed(self) -> bool: ...

    def where(self) -> str: ...


class ReportView(Protocol):
    """What the plots read of a report (:class:`~graphpass.comparing.compare_report.CompareReport`)."""

    ref_dir: str
    test_dir: str
    rtol: float
    atol: float
    notes: list[str]

    @property
    def rows(self) -> Sequence[RowView]: ...

    @property
    def first_failure(self) -> RowView | None: ...

    @property
    def passed(self) -> bool: ...

    def summary_line(self) -> str: ...


EXTRA_HINT = "pip install 'graphpass[plot]'"
PANEL_W, PANEL_H, DPI, MAX_COLS = 6.0, 3.2, 100, 2  # inches per step panel, dots per inch, panels per row
FLOOR = 1e-18  # lowest point of the log axis; an exact match (error 0) is drawn at the panel's bottom


class PlotUnavailableError(GraphpassError, ImportError):
    """matplotlib, needed for ``--plot`` / ``--html``, is not installed."""


def load_pyplot(what: str = "the divergence plot") -> Any:
    """matplotlib's pyplot on the Agg backend, or PlotUnavailableError saying that drawing ``what``
    needs it and naming the extra to install (the divergence plot, the trace timeline)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        from matplotlib import pyplot
    except ImportError as exc:
        raise PlotUnavailableError(
            f"drawing {what} needs matplotlib, which is not installed ({exc}): {EXTRA_HINT}"
        ) from None
    return pyplot


# --- data ---------------------------------------------------------------------------------------


def _worst(values: list[float | None]) -> float | None:
    nums = [v for v in values if v is not None]
    if not nums:
        return None
    return math.nan if any(math.isnan(v) for v in nums) else max(nums)


def step_series(report: ReportView) -> dict[str, list[dict[str, Any]]]:
    """Per step (execution order), per module (execution order): ``module``, ``rel_linf``, ``rel_l2``
    (worst over its ranks and keys; None when nothing was computable), ``passed`` (every row passed)."""
    steps: dict[str, dict[str, list[RowView]]] = {}
    for row in report.rows:
        steps.setdefault(row.step, {}).setdefault(row.module, []).append(row)
    out: dict[str, list[dict[str, Any]]] = {}
    for step, modules in steps.items():
        out[step] = [
            {
                "module": module or "<step>",
                "rel_linf": _worst([r.rel_linf for r in rows]),
                "rel_l2": _worst([r.rel_l2 for r in rows]),
                "passed": all(r.passed for r in rows),
                "note": "; ".join(dict.fromkeys(r.note for r in rows if r.note)),
            }
            for module, rows in modules.items()
        ]
    return out


def figure_pixels(n_steps: int, dpi: int = DPI) -> tuple[int, int]:
    """``(width, height)`` in pixels of the PNG for ``n_steps`` panels (``MAX_COLS`` per row)."""
    n = max(1, n_steps)
    cols = min(n, MAX_COLS)
    rows = math.ceil(n / cols)
    return round(cols * PANEL_W * dpi), round(rows * PANEL_H * dpi)


# --- the figure -----------------------------------------------------------------------------------


def _draw_step(ax: Any, step: str, series: list[dict[str, Any]], rtol: float, is_first_step: bool) -> None:
    x = list(range(len(series)))
    linf = [s["rel_linf"] for s in series]
    finite = [v for v in linf + [s["rel_l2"] for s in series] if v is not None and math.isfinite(v)]
    top = max(finite + [rtol, 1e-6]) * 30
    floor = max(FLOOR, min([v for v in finite if v > 0] + [rtol if rtol > 0 else 1e-6]) * 1e-3)  # exact 0 goes here
    clip = lambda v: top if v is None or math.isnan(v) or math.isinf(v) else max(v, floor)  # noqa: E731
    ax.plot(x, [clip(s["rel_l2"]) for s in series], "-", color="0.55", lw=1, label="rel L2")
    for i, s in enumerate(series):
        bad = not s["passed"]
        if s["rel_linf"] is None or not math.isfinite(s["rel_linf"]):
            ax.plot(i, top, "x", color="tab:red", ms=8, mew=2)
        else:
            ax.plot(i, clip(s["rel_linf"]), "o", color="tab:red" if bad else "tab:blue", ms=5)
    ax.plot([], [], "o", color="tab:blue", label="rel L∞ (pass)")
    ax.plot([], [], "o", color="tab:red", label="rel L∞ (FAIL)")
    ax.axhline(rtol if rtol > 0 else floor, color="tab:orange", ls="-", lw=1.2, label=f"rtol = {rtol:g}")
    first = next((i for i, s in enumerate(series) if not s["passed"]), None)
    if first is not None:
        ax.axvline(first, color="tab:red", ls="--", lw=1.2)
        ax.annotate(
            ("first diverging module: " if is_first_step else "first FAIL: ") + series[first]["module"],
            xy=(first, top),
            xytext=(4, -12),
            textcoords="offset points",
            color="tab:red",
            fontsize=8,
        )
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, top * 3)
    ax.set_title(printable(step), fontsize=9)
    every = max(1, math.ceil(len(series) / 32))  # at most ~32 tick labels per panel
    ax.set_xticks(x[::every], [printable(s["module"]) for s in series][::every], rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.5, max(0.5, len(series) - 0.5))
    ax.set_ylabel("relative error", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(True, which="major", axis="y", alpha=0.3)


def render_png(report: ReportView, dpi: int = DPI, max_steps: int = 24) -> bytes:
    """The divergence plot as PNG bytes; see :func:`plot_report`."""
    plt = load_pyplot()
    all_steps = step_series(report)
    names = list(all_steps)
    if len(names) > max_steps:  # keep every failing step first, then the earliest passing ones
        failing = [n for n in names if any(not s["passed"] for s in all_steps[n])]
        keep = set((failing + [n for n in names if n not in failing])[:max_steps])
        names = [n for n in names if n in keep]
    w, h = figure_pixels(len(names), dpi)
    fig = plt.figure(figsize=(w / dpi, h / dpi), dpi=dpi, layout="constrained")
    try:
        cols = min(max(1, len(names)), MAX_COLS)
        rows = math.ceil(max(1, len(names)) / cols)
        first = report.first_failure
        for i, name in enumerate(names):
            ax = fig.add_subplot(rows, cols, i + 1)
            _draw_step(ax, name, all_steps[name], report.rtol, first is not None and first.step == name)
            if i == 0:
                ax.legend(fontsize=7, loc="best", framealpha=0.8)
        if not names:
            fig.text(0.5, 0.5, "nothing compared", ha="center", va="center")
        shown = f" (showing {len(names)} of {len(all_steps)} steps)" if len(names) < len(all_steps) else ""
        fig.suptitle(
            f"relative error per module, execution order (rtol={report.rtol:g}, atol={report.atol:g}){shown}",
            fontsize=10,
        )
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    finally:
        plt.close(fig)
    return buf.getvalue()


def plot_report(report: ReportView, path: str | os.PathLike[str], dpi: int = DPI, max_steps: int = 24) -> Path:
    """Write the divergence plot of ``report`` to ``path`` (PNG): one panel per step (at most
    ``max_steps``, failing steps first), ``MAX_COLS`` panels per row, each ``PANEL_W`` x ``PANEL_H``
    inches at ``dpi`` (:func:`figure_pixels` gives the size). Written atomically; returns the path."""
    data = render_png(report, dpi=dpi, max_steps=max_steps)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target, data)
    return target


# --- the HTML page --------------------------------------------------------------------------------


def read_metas(root: str | os.PathLike[str], steps: list[str]) -> dict[str, Any]:
    """``{step: meta dict}`` for every step folder of ``root`` that has a readable ``{step}_meta.json``
    (an unreadable one is ``{"error": ...}``, a missing one is left out)."""
    metas: dict[str, Any] = {}
    for rel in steps:
        f = Path(root) / rel / f"{Path(rel).name}_meta.json"
        try:
            metas[rel] = json.loads(f.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            metas[rel] = {"error": f"unreadable meta file: {exc}"}
    return metas


_CSS = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}tr.fail td{background:#fde2e2}
tr.first td{background:#f8b4b4;font-weight:bold}pre{background:#f6f6f6;padding:.5em;overflow:auto;font-size:12px}
.verdict{font-size:1.1em;padding:.4em;border-left:4px solid #c00}.ok{border-color:#080}img{max-width:100%}"""


def _esc(value: Any) -> str:
    return html.escape(printable(str(value)), quote=False)  # text nodes only, never attribute values


def _table(report: ReportView) -> str:

    first = report.first_failure
    head = "".join(f"<th>{_esc(h)}</th>" for h in HEADERS)
    body = []
    for r in report.rows:
        cls = "first" if r is first else ("fail" if not r.passed else "")
        cells = [
            r.step,
            r.module,
            "" if r.rank is None else r.rank,
            "" if r.key is None else r.key,
            r.status,
            fmt_value(r.max_abs),
            fmt_value(r.rel_l2),
            fmt_value(r.rel_linf),
            r.note,
        ]
        body.append(f'<tr class="{cls}">' + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>\n" + "\n".join(body) + "\n</tbody></table>"


def _metas_section(report: ReportView) -> str:
    steps = list(dict.fromkeys(r.step for r in report.rows))
    parts = []
    for side, root in (("ref", report.ref_dir), ("test", report.test_dir)):
        metas = read_metas(root, steps)
        parts.append(f"<h3>{side}: {_esc(root)}</h3>")
        if not metas:
            parts.append("<p>no meta files</p>")
        for step, meta in metas.items():
            text = json.dumps(meta, indent=2, ensure_ascii=False, default=str)
            parts.append(f"<details><summary>{_esc(step)}</summary><pre>{_esc(text)}</pre></details>")
    return "\n".join(parts)


def html_page(report: ReportView, png: bytes | None = None) -> str:
    """One self-contained page: verdict, the plot (``png``, embedded as base64), the table, the notes
    and the meta of both runs' steps. No external resources: it opens offline."""
    first = report.first_failure
    verdict = "".join(f"{_esc(line)}<br>" for line in report.summary_line().splitlines())
    img = (
        ""
        if png is None
        else (
            f'<img alt="relative error per module and step" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
        )
    )
    notes = "".join(f"<li>{_esc(n)}</li>" for n in report.notes)
    first_line = (
        ""
        if first is None
        else f"<p>first diverging module: <b>{_esc(first.module or '<step>')}</b> ({_esc(first.where())})</p>"
    )
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>graphpass compare: {_esc(report.ref_dir)} vs {_esc(report.test_dir)}</title>"
        f"<style>{_CSS}</style></head><body>\n"
        f"<h1>graphpass compare</h1><p>ref <code>{_esc(report.ref_dir)}</code> vs test <code>{_esc(report.test_dir)}</code>, "
        f"rtol={report.rtol:g}, atol={report.atol:g}</p>\n"
        f'<p class="verdict{" ok" if report.passed else ""}">{verdict}</p>{first_line}\n{img}\n'
        f"<h2>Tensors (execution order)</h2>\n{_table(report)}\n"
        + (f"<h2>Notes</h2><ul>{notes}</ul>\n" if notes else "")
        + f"<h2>Meta of both runs</h2>\n{_metas_section(report)}\n</body></html>\n"
    )


def write_html(report: ReportView, path: str | os.PathLike[str], plot: bool = True, dpi: int = DPI) -> Path:
    """Write :func:`html_page` to ``path`` (atomically); ``plot=False`` leaves the plot out (and needs
    no matplotlib). Returns the path."""
    png = render_png(report, dpi=dpi) if plot else None
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target, html_page(report, png).encode("utf-8"))
    return target
