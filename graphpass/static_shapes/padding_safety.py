"""Padding-safety analysis for static-shape bucketing: the names this module held before the proof became the
:mod:`.padding_proof` package, re-exported for the code and tests that import them from here. New code imports
from :mod:`graphpass.static_shapes.padding_proof`."""

from __future__ import annotations

from .padding_proof import (
    ROW_WISE_FUNCTIONS,
    PaddingProof,
    PaddingViolation,
    check_padding_safety,
    index_provenance,
    padded_dims,
    prove_padding,
)
from .padding_proof.tables import (
    ALONG_DIM,
    ATTENTION,
    CAUSAL_SCANS,
    CONCAT,
    CONVS,
    EMBEDDINGS,
    FACTORIES,
    INDEXING,
    LAYOUT,
    MATMULS,
    META,
    NORMS,
    PADS,
    POINTWISE,
    REPEATS,
    RESHAPES,
    ROW_WRITES,
    WINDOWS,
)

__all__ = [
    "ALONG_DIM",
    "ATTENTION",
    "CAUSAL_SCANS",
    "CONCAT",
    "CONVS",
    "EMBEDDINGS",
    "FACTORIES",
    "INDEXING",
    "LAYOUT",
    "MATMULS",
    "META",
    "NORMS",
    "PADS",
    "POINTWISE",
    "REPEATS",
    "RESHAPES",
    "ROW_WISE_FUNCTIONS",
    "ROW_WRITES",
    "WINDOWS",
    "PaddingProof",
    "PaddingViolation",
    "check_padding_safety",
    "index_provenance",
    "padded_dims",
    "prove_padding",
]
