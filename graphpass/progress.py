"""Progress on long work (offload files and checkpoints, compare, the conformance harness), shown
with tqdm on a terminal only: silent when stderr is not a TTY, or with ``GRAPHPASS_PROGRESS=0``.
``GRAPHPASS_PROGRESS=1`` forces it on (for a pipe you watch)."""

from __future__ import annotations

import os
import sys
from typing import Any


class _Silent:
    """The no-op bar used when progress is off."""

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def enabled() -> bool:
    setting = os.environ.get("GRAPHPASS_PROGRESS", "")
    if setting == "0":
        return False
    if setting == "1":
        return True
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def silent() -> _Silent:
    """A stand-in bar that shows nothing (for work with nothing to count)."""
    return _Silent()


def bar(total: float | None, desc: str, unit: str = "it", unit_scale: bool = False):
    """A tqdm bar on stderr when progress is on, else a silent stand-in with the same methods."""
    if not enabled():
        return _Silent()
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        unit_divisor=1024 if unit == "B" else 1000,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
    )
