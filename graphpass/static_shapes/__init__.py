"""Static shapes: the allocation audit, padding to buckets and slices of static buffers.

Modules: ``allocation_audit`` (:func:`audit`: every variable-size allocation with a verdict),
``padding_safety`` (may a graph be padded along a dim, with its op tables), ``dispatcher`` (one
static graph per bucket at run time). The graph passes are
:mod:`graphpass.passes.plan_static_shapes` and :mod:`graphpass.passes.slice_static_buffers`.
"""

from .allocation_audit import AuditReport, audit

__all__ = ["audit", "AuditReport"]
