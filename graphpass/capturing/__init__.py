"""Capture: chosen module outputs copied inside the compiled graph and written to disk, and
``compare`` to find the first module where two runs diverge.

Modules: ``ops`` (the ``graphpass::capture`` op and :func:`capture_tensor`), ``registry``
(:class:`TensorRegistry`), ``writer`` (:class:`CaptureWriter`), ``model_capture``
(:class:`ModelCapture` and the specs the capture pass reads), ``auto_steps`` (every forward one
step, named from its input: :meth:`ModelCapture.auto_steps`), ``compare_runs`` (:func:`compare`),
``shards`` (compare across shardings: assembling tensor-parallel pieces, several roots),
``staging`` (steps written behind the compute: :class:`StagingConfig`, the bounded ring and its
writer thread).
The graph pass that inserts the op is :mod:`graphpass.passes.insert_capture_nodes`.
"""

from .auto_steps import AutoSteps, StepInfo
from .compare_runs import CompareError, CompareReport, compare
from .model_capture import TRACED, CaptureSpec, ModelCapture, note_traced, specs_for
from .ops import capture_tensor
from .registry import TensorRegistry
from .staging import StagingConfig
from .writer import CaptureWriter

__all__ = ["ModelCapture", "StagingConfig", "AutoSteps", "StepInfo", "TensorRegistry", "CaptureWriter", "CaptureSpec", "capture_tensor", "compare",
           "CompareReport", "CompareError", "specs_for", "note_traced", "TRACED"]
