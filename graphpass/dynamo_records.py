"""What Dynamo itself recorded about a call: graph breaks, and frames it skipped (so compiled nothing).

A graph break inside a ``for`` loop over layers makes Dynamo skip the whole frame: the backend is
never called, so graphpass sees no graph. Dynamo says so in its counters
(``torch._dynamo.utils.counters["unimplemented"]`` / ``["graph_break"]``, process-wide and
cumulative); :func:`snapshot` and :func:`new_reasons` take the difference around one call.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from .torch_compat import count_loop_skips

count_loop_skips()  # torch 2.9 only logs a frame it skips: counted like later releases do, before any trace

_KINDS = ("unimplemented", "graph_break")
_SKIP_MARKERS = ("frame skipped", "Skipping the frame", "skipping frame", "Skipping frame")


def snapshot() -> dict[str, Counter]:
    """Dynamo's break records now (copies)."""
    from torch._dynamo.utils import counters

    return {k: Counter(counters.get(k, {})) for k in _KINDS}


def new_reasons(before: dict[str, Counter]) -> list[str]:
    """The break reasons Dynamo recorded since ``before``, most informative first."""
    after = snapshot()
    out: list[str] = []
    for k in _KINDS:
        for reason, n in after[k].items():
            if n > before.get(k, Counter()).get(reason, 0) and reason not in out:
                out.append(reason)
    return sorted(out, key=lambda r: not any(m in r for m in _SKIP_MARKERS))


def version() -> int:
    """A number that changes whenever Dynamo records a new break reason (distinct reasons so far):
    cheap enough to read on every call, so a check can run again only when there is news."""
    from torch._dynamo.utils import counters

    return sum(len(counters.get(k, ())) for k in _KINDS)


def skipped_frames() -> list[str]:
    """Every break record in this process in which Dynamo says it skipped a frame (no "before":
    for an error raised when a skipped frame already ran eagerly)."""
    return [r for r in new_reasons({}) if any(m in r for m in _SKIP_MARKERS)]


_SITE = re.compile(r"frame skipped: (?P<name>\S+) \((?P<file>.+) line (?P<line>\d+)\)")


@dataclass(frozen=True)
class SkippedFrame:
    """A frame Dynamo skipped (runs eagerly from now on): its code's name, file and first line,
    from Dynamo's own record (``frame skipped: forward (/path/model.py line 187)``; a resume
    function's first line is where it resumes inside the function it came from; on torch 2.9, where
    :func:`graphpass.torch_compat.count_loop_skips` writes the record, the line of the break)."""

    name: str
    file: str
    line: int
    record: str


def skipped_frame_sites() -> list[SkippedFrame]:
    """Every frame skip Dynamo recorded in this process (until ``torch._dynamo.reset()``) that names its code."""
    out: list[SkippedFrame] = []
    for record in skipped_frames():
        for m in _SITE.finditer(record):
            out.append(SkippedFrame(m["name"], m["file"], int(m["line"]), record))
    return out


def code_span(fn) -> tuple[str, int, int] | None:
    """``(file, first line, last line)`` of a function's code (a module class's ``forward``), or None."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return code.co_filename, code.co_firstlineno, max(lines, default=code.co_firstlineno)


def skipped_frame_message(reasons: list[str]) -> str:
    """Why Dynamo compiled nothing, in its own words, and what to do."""
    skip = next((r for r in reasons if any(m in r for m in _SKIP_MARKERS)), None)
    first = reasons[-1] if reasons else None  # the break that started it (a skip wraps it)
    lines = ["Dynamo compiled no graph for this call, so graphpass saw nothing to rewrite."]
    if skip is not None:
        lines.append(
            "Dynamo skipped the whole frame: a graph break inside a loop (torch.compile cannot "
            "resume inside a for/while loop, so it runs the frame eagerly)."
        )
    if first is not None:
        summary = "\n    ".join(line.strip() for line in first.strip().splitlines()[:4] if line.strip())
        lines.append(f"Dynamo's record of the break:\n    {summary}")
    lines.append(
        "What to do: remove the graph break (print, .item(), data-dependent Python control flow, "
        "an untraceable call) or move it out of the layer loop; TORCH_LOGS=graph_breaks shows each "
        "break where it happens."
    )
    return "\n".join(lines)


def has_compiled_code(model, unknown: bool) -> bool:
    """Does Dynamo hold compiled code for ``type(model).forward`` (for any instance of the class;
    ``torch._dynamo.reset()`` drops it)? ``unknown`` is the answer when torch's private API to ask
    has moved: each caller picks the safe side for what it guards."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return bool(_debug_get_cache_entry_list(type(model).forward))
    except Exception:  # noqa: BLE001 - private API moved
        return unknown
