"""The op rules of the padding proof: one check per group of op names, registered by name in
:data:`.registry.OP_RULES` with :func:`.registry.op_rule`. Each returns ``(dim, reason)`` for a violation, or None.

A name without a rule is an unknown op (:data:`UNKNOWN_OP`, the conservative default). The rules read the facts
(:mod:`.facts`) of their inputs to accept causal and masked patterns (``ctx.because`` names the one that did);
what the node's own table says (pointwise, reductions along a dim, matmuls, ...) is in :mod:`.tables`.

The rules live by family, each module registering its own: :mod:`.op_checks_reduce` (reductions, scans,
matmuls, norms), :mod:`.op_checks_attention`, :mod:`.op_checks_index` (indexing, ``cat``, ``repeat``, pads,
embeddings), :mod:`.op_checks_conv` (``conv1d``, ``unfold``) and :mod:`.op_checks_plain` (what the table
decides: reshapes, factories, pointwise, layout); what they share, and :data:`UNKNOWN_OP`, is in
:mod:`.op_checks_base`. Importing this module registers them all, in that order.
"""

from __future__ import annotations

from . import op_checks_reduce, op_checks_attention, op_checks_index, op_checks_conv, op_checks_plain  # noqa: F401
from .op_checks_attention import _check_attention  # noqa: F401 (re-exported: the names this module held)
from .op_checks_base import UNKNOWN_OP, _Finding, _value_use  # noqa: F401
from .op_checks_conv import _check_conv1d, _check_unfold  # noqa: F401
from .op_checks_index import _check_cat, _check_embedding, _check_getitem, _check_pad, _check_repeat  # noqa: F401
from .op_checks_plain import _check_factory, _check_layout, _check_pointwise, _check_reshape  # noqa: F401
from .op_checks_reduce import _check_along_dim, _check_einsum, _check_matmul, _check_norm  # noqa: F401

__all__ = ["UNKNOWN_OP"]
