"""What the op rules of the padding proof share: a finding, a scalar argument that uses the padded length
(:func:`_value_use`), and the rule of an unknown op (:data:`UNKNOWN_OP`). See :mod:`.op_checks`."""

from __future__ import annotations

from typing import Any, Iterable

import sympy
import torch

from ...fx_utils import mentions_symbol
from .nodes import _iter_values, _label
from .registry import OpRule, ProofContext

_Finding = tuple[int | None, str]


def _value_use(node: torch.fx.Node, ctx: ProofContext, args: Iterable[Any] | None = None) -> _Finding | None:
    """A scalar argument that mentions a padded length: the op computes with the length itself."""
    leaves = _iter_values(list(node.args) + list(node.kwargs.values()) if args is None else list(args))
    for v in leaves:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Basic)) and mentions_symbol(v, ctx.names):
            expr = v.node.expr if hasattr(v, "node") else v
            return None, f"uses the padded length ({expr}) as a value"
    return None


def _unknown(node: torch.fx.Node, name: str | None, ctx: ProofContext) -> _Finding | None:
    return None, f"unknown op {_label(node)}: cannot prove row independence"


#: The conservative default: an op without a rule (a name not in :data:`.registry.OP_RULES`, a custom op, a
#: higher-order op) whose input or output has a padded dim is a violation.
UNKNOWN_OP = OpRule("unknown_op", _unknown)
