"""Static shapes: the allocation audit, padding to buckets and slices of static buffers.

Modules: ``allocation_audit`` (:func:`audit`: every variable-size allocation with a verdict),
``padding_proof`` (may a graph be padded along a dim: a package of op, fact and pattern rules registered by
name, :func:`~.padding_proof.prove_padding`; ``padding_safety`` re-exports its older names), ``dispatcher`` (one
static graph per bucket at run time), ``buckets`` (:func:`choose_buckets`: the bucket sizes that pad
a workload's lengths least for a budget of graphs), ``bucketed_cache`` (:class:`BucketedCache`: a
transformers key/value cache sized by decode-context buckets, for ``generate()``; imported on first use,
since it needs transformers). The graph passes are
:mod:`graphpass.passes.plan_static_shapes` and :mod:`graphpass.passes.slice_static_buffers`.
"""

from .allocation_audit import AuditReport, audit
from .buckets import PaddingReport, choose_buckets, padding_report, power_of_two_buckets

__all__ = [
    "audit",
    "AuditReport",
    "BucketedCache",
    "choose_buckets",
    "padding_report",
    "PaddingReport",
    "power_of_two_buckets",
]


def __getattr__(name: str):
    if name == "BucketedCache":  # needs transformers: imported when asked for
        from .bucketed_cache import BucketedCache

        return BucketedCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
