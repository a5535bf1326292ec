"""Capture: chosen module outputs copied inside the compiled graph and written to disk, in the
format of :mod:`graphpass.capture_format`; :mod:`graphpass.comparing` compares two such runs.

Modules: ``ops`` (the ``graphpass::capture`` op and :func:`capture_tensor`), ``registry``
(:class:`TensorRegistry`), ``writer`` (:class:`CaptureWriter`), ``step_files`` (one step's files,
torch-free), ``writer_child`` (the writer process), ``model_capture`` (:class:`ModelCapture` and
the specs the capture pass reads), ``auto_steps`` (every forward one step, named from its input:
:meth:`ModelCapture.auto_steps`), ``staging`` (steps written behind the compute:
:class:`StagingConfig`, the bounded ring and its writer thread).
The graph pass that inserts the op is :mod:`graphpass.passes.insert_capture_nodes`.
"""

import warnings
from typing import Any

from .auto_steps import AutoSteps, StepInfo
from .model_capture import TRACED, CaptureSpec, ModelCapture, note_traced, specs_for
from .ops import capture_tensor
from .registry import TensorRegistry
from .staging import StagingConfig
from .writer import CaptureWriter

__all__ = [
    "ModelCapture",
    "StagingConfig",
    "AutoSteps",
    "StepInfo",
    "TensorRegistry",
    "CaptureWriter",
    "CaptureSpec",
    "capture_tensor",
    "specs_for",
    "note_traced",
    "TRACED",
]

# moved to graphpass.comparing (compare is its own package): deprecated aliases, kept for one release, as are the
# old module paths (graphpass.capturing.compare_runs, ...: thin modules here)
_MOVED = ("compare", "CompareReport", "CompareError")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"graphpass.capturing.{name} moved to graphpass.comparing.{name}; the old name will be "
            "removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        from .. import comparing

        return getattr(comparing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
