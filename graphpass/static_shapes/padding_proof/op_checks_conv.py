"""Op rules of the padding proof: sliding windows (``conv1d``, ``unfold``). See :mod:`.op_checks`."""

from __future__ import annotations

from typing import Any

import torch

from ...fx_utils import example_of
from .nodes import _arg, _dims, _iter_nodes, _label, _namespace, _norm_dim, _op_name, _static_int
from .op_checks_base import _Finding, _value_use
from .provenance import _starts_at_row_0
from .registry import ProofContext, op_rule
from .tables import _SAFE_NAMESPACES, CONVS, POINTWISE, WINDOWS


@op_rule(*CONVS)
def _check_conv1d(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    """``conv1d(x, w, stride=1, padding=p, dilation=d)`` along a padded time dim (the last): output
    row ``i`` reads input rows ``i - p .. i - p + (k - 1) * d``, so with ``p >= (k - 1) * d`` only
    rows ``<= i`` (the causal convolution of Mamba-style layers, sliced back to the length)."""
    x = example_of(_arg(node, 0, "input"))
    w = example_of(_arg(node, 1, "weight", None))
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return None, f"{name} with unreadable operands: cannot prove row independence"
    pads = ctx.padded(x)
    if any(d != x.dim() - 1 for d in pads):
        return pads[0], f"{name} contracts over the padded dim"
    if not pads:
        return _value_use(node, ctx)
    stride, padding, dilation = (
        _dims(_arg(node, i, kw, dflt)) for i, kw, dflt in ((3, "stride", 1), (4, "padding", 0), (5, "dilation", 1))
    )
    k = _static_int(w.shape[-1])
    causal = (
        ctx.causal_ok
        and k is not None
        and stride is not None
        and padding is not None
        and dilation is not None
        and stride[0] == 1
        and padding[0] >= (k - 1) * dilation[0]
    )
    if not causal and ctx.causal_ok and _valid_conv(stride, padding, dilation, k):
        return _value_use(node, ctx)
    if not causal:
        return pads[
            0
        ], f"{name} along the padded dim reads later rows (not stride 1 with padding >= (kernel - 1) * dilation)"
    extra = 2 * padding[0] - (k - 1) * dilation[0]
    if extra > 0:
        bad = _unsliced_extra_rows(node, x.dim() - 1, x.shape[-1], ctx)
        if bad is not None:
            return pads[0], (
                f"{name}'s {extra} output rows past the input's length read its zero padding unpadded and "
                f"padding rows bucketed; {_label(bad)} at node {bad.name} reads them (only a slice "
                "[..., :length] may, before anything else)"
            )
    return _value_use(node, ctx)


def _unsliced_extra_rows(node: torch.fx.Node, dim: int, length: Any, ctx: ProofContext) -> torch.fx.Node | None:
    """The obligation of a causal convolution: its output rows ``length ..`` (past the input's length; the last rows
    of an unpadded call read the convolution's own zero padding, of a bucketed one the bucket's padding rows) are
    dropped by a prefix slice ``[..., :length]`` of ``dim`` before anything else reads them. Pointwise ops with no
    other padded operand may come first (they keep those rows in place). Returns the first node that reads them, or
    None."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            name = _op_name(u) if u.op in ("call_function", "call_method") else None
            out = example_of(u)
            if u.op == "call_function" and _namespace(u.target) in _SAFE_NAMESPACES:
                todo.append(u)  # graphpass's markers (a trap boundary) pass their input through
                continue
            if name == "getitem" and _prefix_slice_of(u, dim, length, ctx):
                continue
            if (
                name in ("narrow", "slice")
                and _static_int(_arg(u, 1, "dim", None)) in (dim, dim - example_of(n).dim())
                and _starts_at_row_0(_arg(u, 2, "start", None))
                and ctx.same_size(_arg(u, 3, "length" if name == "narrow" else "end", None), length)
                and _static_int(_arg(u, 4, "step", 1)) in (1, None)
            ):
                continue
            others = [a for a in _iter_nodes((u.args, u.kwargs)) if a is not n and ctx.padded(a)]
            if (
                name in POINTWISE
                and not others
                and isinstance(out, torch.Tensor)
                and out.dim() == example_of(n).dim()
                and ctx.same_size(out.shape[dim], example_of(n).shape[dim])
            ):
                todo.append(u)
                continue
            return u
    return None


def _prefix_slice_of(node: torch.fx.Node, dim: int, length: Any, ctx: ProofContext) -> bool:
    """``node`` is ``x[..., :length]`` along ``dim`` of ``x`` (a full slice or an Ellipsis on every other dim)."""
    t = example_of(node.args[0])
    idx = node.args[1] if len(node.args) > 1 else None
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if (
        not isinstance(t, torch.Tensor)
        or any(i is None or isinstance(example_of(i), torch.Tensor) for i in items)
        or sum(1 for i in items if i is Ellipsis) > 1
    ):
        return False
    d, found = 0, False
    for item in items:
        if item is Ellipsis:
            d += t.dim() - (len(items) - 1)
            continue
        if not isinstance(item, slice):
            return False
        if d == dim:
            found = (
                _starts_at_row_0(item.start)
                and item.step in (None, 1)
                and item.stop is not None
                and ctx.same_size(item.stop, length)
            )
        elif item != slice(None):
            return False
        d += 1
    return found


def _valid_conv(stride: list[int] | None, padding: list[int] | None, dilation: list[int] | None, k: int | None) -> bool:
    """A ``conv1d`` with stride 1 and no padding (a "valid" convolution) keeps every real row exact, causal or not:
    output row ``r`` reads input rows ``r .. r + (k - 1) * d``. With ``n`` real input rows the unpadded call has
    ``n - (k - 1) * d`` output rows, and each of them (``r <= n - 1 - (k - 1) * d``) reads input rows ``<= n - 1``
    only: the real ones. The bucketed call computes those same rows first and more after them, which the slice
    back to ``n - (k - 1) * d`` drops. Zaya's CCA stacks two of them after ``F.pad(x, (k1 - 1 + k2 - 1, 0))``: row
    ``i`` of the result then reads rows ``i - (k1 - 1 + k2 - 1) .. i`` of ``x``. A zero padding inside the
    convolution (``padding > 0``) is different: the unpadded call's last rows read those zeros, where the bucketed
    one reads padding rows."""
    return (
        k is not None
        and stride is not None
        and padding is not None
        and dilation is not None
        and len(stride) == len(padding) == len(dilation) == 1
        and stride[0] == 1
        and padding[0] == 0
    )


@op_rule(*WINDOWS)
def _check_unfold(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    """``x.unfold(d, size, 1)`` along the padded dim: window ``r`` holds rows ``r .. r + size - 1``, the reads of a
    valid convolution (:func:`_valid_conv`), so every window that exists at the real length reads real rows only
    (inkling2's short convolution: ``F.pad(x, (k - 1, 0)).unfold(-1, k, 1)``). Only the tensor method and aten's
    ``unfold`` (``torch.nn.functional.unfold`` is im2col over images, another op of the same name); a step other
    than 1 starts the windows at multiples of it, which is still a prefix, but is refused until a model needs it."""
    if node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload):
        return None, f"unknown op {_label(node)}: cannot prove row independence"
    x = example_of(_arg(node, 0, "input"))
    if not isinstance(x, torch.Tensor):
        return None, f"{name} with an unreadable operand: cannot prove row independence"
    pads = ctx.padded(x)
    d = _static_int(_arg(node, 1, "dimension", None))
    size = _static_int(_arg(node, 2, "size", None))
    step = _static_int(_arg(node, 3, "step", None))
    if d is None or size is None or step is None:
        return (pads[0] if pads else None), f"{name} with arguments that are not static: cannot prove row independence"
    if _norm_dim(d, x.dim()) in pads and not (ctx.causal_ok and step == 1):
        return _norm_dim(d, x.dim()), f"{name} along the padded dim with step {step}: not proven"
    return _value_use(node, ctx)
