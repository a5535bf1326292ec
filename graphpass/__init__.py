"""graphpass: a torch.compile backend that rewrites the FX graph and delegates to a real compiler.

compiled = torch.compile(model, backend="graphpass")
compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager", traps=["layers.*"]))
print(graphpass.explain(model, *example_inputs))
"""

from __future__ import annotations

from .version import __version__

from . import ops
from .capturing import ModelCapture, capture_tensor
from .comparing import CompareReport, compare
from .config import GraphpassConfig
from .dynamo_backend import backend
from .errors import (  # every error class is in graphpass.errors; the subclasses below stay here for `except`
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
from .offloading import MemoryStats, OffloadConfig, memory_stats, offload
from .ops import offload_block, trace_traps, trap_block
from .static_shapes import AuditReport, audit
from .tracing import TraceReport, trace
from .op_registry import register_all as _register_all
from .static_shapes.scan_trace import install as _install_scan_trace

_register_all()  # every graphpass:: custom op, whatever was imported first
_install_scan_trace()  # Dynamo traces Mamba (v1)'s scan as one op for graphpass with static shapes

# What users call. Internals (the pipeline, the backend class, the registry, offload state,
# patterns) stay importable from their modules: graphpass.pipeline.PIPELINE,
# graphpass.dynamo_backend.GraphpassBackend, graphpass.capturing.TensorRegistry, ...
__all__ = [
    "__version__",
    # compile
    "backend",
    "GraphpassConfig",
    # inspect
    "explain",
    "ExplainReport",
    "audit",
    "AuditReport",
    "trace",
    "TraceReport",
    "trace_traps",
    "trap_block",
    # capture and compare
    "capture_tensor",
    "ModelCapture",
    "compare",
    "CompareReport",
    # offload
    "offload",
    "OffloadConfig",
    "memory_stats",
    "MemoryStats",
    # errors (all of them, subclasses included, in graphpass.errors)
    "GraphpassError",
    "ConfigError",
    "PatternError",
    "CaptureError",
    "OffloadError",
    "DelegateError",
]
