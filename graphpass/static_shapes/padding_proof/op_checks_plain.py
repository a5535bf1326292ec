"""Op rules of the padding proof that their table decides: reshapes, factories, pointwise ops, layout
and meta ops. See :mod:`.op_checks`."""

from __future__ import annotations

import torch

from .nodes import _arg
from .op_checks_base import _Finding, _value_use
from .registry import ProofContext, op_rule
from .tables import FACTORIES, LAYOUT, META, POINTWISE, RESHAPES


@op_rule(*RESHAPES)
def _check_reshape(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    """Reshapes are decided by the layout sweep (:mod:`.layout`): where each padded factor lands, and whether the rows
    come back in the same order."""
    return None


@op_rule(*FACTORIES)
def _check_factory(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    if name == "arange":
        if isinstance(node.target, torch._ops.OpOverload):
            values = [_arg(node, -1, "start", None), _arg(node, -1, "step", None)]
        else:
            values = [node.args[0], *node.args[2:3]] if len(node.args) >= 2 else []
            values += [node.kwargs.get("start"), node.kwargs.get("step")]
        return _value_use(node, ctx, values)
    return _value_use(node, ctx, [_arg(node, pos, kw, None) for pos, kw in FACTORIES[name]])


@op_rule(*POINTWISE)
def _check_pointwise(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    if name == "where" and len(node.args) + len(node.kwargs) < 3:
        return None, "where(cond) returns indices of true values: cannot prove row independence"
    return _value_use(node, ctx)


@op_rule(*LAYOUT, *META, name="layout")
def _check_layout(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    """Dim-wise layout ops (:data:`.tables.LAYOUT`) and size queries (:data:`.tables.META`): always safe."""
    return None
