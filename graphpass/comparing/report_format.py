"""How a compare report is written as text: the table's headers, numbers, and file names made
printable. A leaf of ``comparing`` (no import of the report), shared by the report
(:mod:`compare_report`) and its plots and HTML page (:mod:`plots`)."""

from __future__ import annotations

import math

HEADERS = ["step", "module", "rank", "key", "status", "max abs", "rel L2", "rel L∞", "note"]


def printable(text: str) -> str:
    """``text`` with undecodable file-name bytes (``os.fsdecode``'s surrogates) and any other lone
    surrogate written as backslash escapes, so it can be printed to a strict UTF-8 stream."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


def fmt_value(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def json_float(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # "nan" / "inf": keeps the JSON strict
