"""graphpass: a torch.compile backend that rewrites the FX graph and delegates to a real compiler.

    compiled = torch.compile(model, backend="graphpass")
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager", traps=["layers.*"]))
    print(graphpass.explain(model, *example_inputs))
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import ops
from .capturing import CaptureWriter, CompareReport, ModelCapture, StagingConfig, TensorRegistry, capture_tensor, compare
from .config import GraphpassConfig
from .dynamo_backend import CompiledGraph, GraphpassBackend, backend, graphpass_backend
from .errors import (
    CaptureError,
    ConfigError,
    DelegateError,
    DelegateUnavailableError,
    DynamicShapesDisabledError,
    GraphpassError,
    OffloadError,
    OwnershipError,
    PatternError,
    PatternMatchError,
)
from .explain_report import ExplainReport, explain
from .offloading import MemoryStats, OffloadConfig, OffloadPlan, OffloadState, memory_stats, offload
from .ops import offload_block, trace_traps
from .patterns import ModulePattern, compile_pattern
from .pipeline import PIPELINE
from .static_shapes import AuditReport, audit
from .tracing import TraceReport, trace

ops.register_all()  # every graphpass:: custom op, whatever was imported first

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
    "StagingConfig",
    "TensorRegistry",
    "CaptureWriter",
    "CaptureError",
    "trace_traps",
    "trace",
    "TraceReport",
    "ModulePattern",
    "compile_pattern",
    "PIPELINE",
    "GraphpassError",
    "ConfigError",
    "PatternError",
    "PatternMatchError",
    "DelegateError",
    "DelegateUnavailableError",
    "DynamicShapesDisabledError",
    "OwnershipError",
    "OffloadError",
    "offload",
    "OffloadConfig",
    "OffloadPlan",
    "OffloadState",
    "MemoryStats",
    "memory_stats",
]
