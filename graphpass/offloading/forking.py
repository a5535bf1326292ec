"""``fork()`` and the offload runtimes: in a child, the parent's worker threads, their loads in flight and the
locks other threads held are not the child's. One hook (process-wide on purpose: fork is) resets the
record table's lock and every live runtime (:meth:`OffloadRuntime.after_fork_in_child`). Python runs the
``after_in_child`` hooks in the order they were registered: ``leases.py`` resets its lease service in its own
hook, and a runtime then takes its files' new leases from that fresh service, so ``leases`` is imported (and its
hook registered) before this module registers its own."""

from __future__ import annotations

import os
import weakref
from typing import Any

from . import leases  # noqa: F401 (imported first: its own fork hook must run before this one)
from .registry import REGISTRY

# The live runtimes (weak).
_RUNTIMES: weakref.WeakSet = weakref.WeakSet()


def track(runtime: Any) -> None:
    """Reset ``runtime`` in a child made by ``fork()`` (while it lives)."""
    _RUNTIMES.add(runtime)


def _after_fork_in_child() -> None:
    REGISTRY.after_fork_in_child()
    for runtime in list(_RUNTIMES):
        runtime.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
