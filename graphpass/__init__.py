"""graphpass: a torch.compile backend that rewrites the FX graph and delegates to a real compiler.

    compiled = torch.compile(model, backend="graphpass")
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager", traps=["layers.*"]))
    print(graphpass.explain(model, *example_inputs))
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # registers graphpass:: custom ops
from .backend import CompiledGraph, GraphpassBackend, backend, graphpass_backend
from .compare import CompareReport, compare
from .config import GraphpassConfig
from .errors import (
    ConfigError,
    DelegateError,
    DelegateUnavailableError,
    GraphpassError,
    CaptureError,
    OffloadError,
    OwnershipError,
    PatternError,
    PatternMatchError,
)
from .capture import CaptureWriter, ModelCapture, TensorRegistry
from .explain import ExplainReport, explain
from .audit import AuditReport, audit
from .ops import capture_tensor, offload_block, trace_traps
from . import offload_runtime  # registers the offload ops
from .offload import OffloadConfig, OffloadPlan, OffloadState, memory_stats, offload
from .offload_runtime import MemoryStats
from .patterns import ModulePattern, compile_pattern
from .pipeline import PIPELINE

__all__ = [
    "__version__",
    "backend",
    "graphpass_backend",
    "GraphpassBackend",
    "GraphpassConfig",
    "CompiledGraph",
    "explain",
    "ExplainReport",
    "audit",
    "AuditReport",
    "compare",
    "CompareReport",
    "offload_block",
    "capture_tensor",
    "ModelCapture",
    "TensorRegistry",
    "CaptureWriter",
    "CaptureError",
    "trace_traps",
    "ModulePattern",
    "compile_pattern",
    "PIPELINE",
    "GraphpassError",
    "ConfigError",
    "PatternError",
    "PatternMatchError",
    "DelegateError",
    "DelegateUnavailableError",
    "OwnershipError",
    "OffloadError",
    "offload",
    "OffloadConfig",
    "OffloadPlan",
    "OffloadState",
    "MemoryStats",
    "memory_stats",
]
