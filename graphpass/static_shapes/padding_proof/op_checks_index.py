"""Op rules of the padding proof: indexing and slicing, ``narrow``, ``cat``, ``repeat``, pads and
embeddings (tables looked up by position). See :mod:`.op_checks`."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ...fx_utils import example_of, mentions_symbol, size_expr
from ..position_tables import TableRead
from .facts import NegMask, Positions, ZeroAbove
from .nodes import _arg, _label, _norm_dim, _op_name, _source, _static_int
from .op_checks_base import _Finding, _value_use
from .registry import ProofContext, op_rule
from .tables import CONCAT, EMBEDDINGS, INDEXING, PADS, REPEATS


def _starts_at_zero(start: Any, size: Any, ctx: ProofContext) -> bool:
    """``x[-n:]`` where ``n`` is the dim's own length (transformers trims a mask to the last
    ``inputs_embeds.shape[1]`` positions): the slice starts at row 0 whatever the padding."""
    v = example_of(start)
    if size is None or not isinstance(v, torch.SymInt):
        return False
    return ctx.same_size(-size_expr(v), size)


def _bad_start(start: Any, ctx: ProofContext) -> str | None:
    """Why a start index / int index into a padded dim is not row-preserving, or None."""
    v = example_of(start)
    if v is None:
        return None
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return "counts from the end of the padded dim (reads padding rows)" if v < 0 else None
    if isinstance(v, (torch.SymInt, torch.SymFloat)) and mentions_symbol(v, ctx.names):
        return f"is computed from the padded length ({v.node.expr}) and moves with the padding"
    if isinstance(v, torch.Tensor):
        return "is a tensor: rows chosen by tensor values"
    return None


@op_rule(*INDEXING, name="indexing")
def _check_getitem(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    target = node.args[0] if node.args else None
    t = example_of(target)
    if not isinstance(t, torch.Tensor):
        return None  # a tuple / list / torch.Size element
    pads = ctx.padded(t)
    if name in ("narrow", "select", "slice"):
        return _check_narrow(node, name, t, pads, ctx)
    idx = node.args[1] if len(node.args) > 1 else None
    if name == "setitem" and _masked_scalar_write(node, t, idx, ctx):
        return _value_use(node, ctx)
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if isinstance(idx, list):
        items = [idx]  # x[[0, 2]]: one advanced index on dim 0
    used = sum(_index_width(i) for i in items)
    d = 0
    for item in items:
        if item is Ellipsis:
            d += t.dim() - used
            continue
        w = _index_width(item)
        for dd in range(d, d + w):
            if dd not in pads:
                if w == 1 and name != "setitem":
                    _note_table_read(node, item, target, t.shape[dd], ctx)
                continue
            why = _bad_index(item, ctx, t.shape[dd])
            if why:
                verb = "writes" if name == "setitem" else "indexes"
                return dd, f"{verb} the padded dim with an index that {why}"
        d += w
    return None


def _masked_scalar_write(node: torch.fx.Node, t: torch.Tensor, idx: Any, ctx: ProofContext) -> bool:
    """``x[mask] = v`` with one boolean ``mask`` sized like ``x``'s leading dims and a scalar ``v`` (a Python
    number or a 0-d tensor): the same as ``x.masked_fill_(mask, v)``, so element ``(i, ...)`` of ``x`` reads only
    ``mask[i, ...]`` and ``v`` (gemma3's ``llm_input_ids[input_ids == image_token_id] = 0``). A value tensor
    with elements of its own is written in mask order (the k-th true entry takes the k-th value): not row-wise."""
    m = example_of(idx) if isinstance(idx, torch.fx.Node) else None
    if not (isinstance(m, torch.Tensor) and m.dtype == torch.bool and 0 < m.dim() <= t.dim()):
        return False
    if not all(ctx.same_size(a, b) for a, b in zip(m.shape, t.shape)):
        return False
    value = node.args[2] if len(node.args) > 2 else None
    v = example_of(value)
    if isinstance(v, torch.Tensor):
        return v.dim() == 0
    return isinstance(v, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _check_narrow(
    node: torch.fx.Node, name: str, t: torch.Tensor, pads: tuple[int, ...], ctx: ProofContext
) -> _Finding | None:
    """``narrow`` / ``select`` / ``slice`` of ``t`` (whose padded dims are ``pads``)."""
    d = _arg(node, 1, "dim", 0)
    if not isinstance(d, int):
        return (None, f"{name} along a dim that is not static") if pads else None
    d = _norm_dim(d, t.dim())
    if d not in pads:
        return None
    start = _arg(node, 2, "start" if name != "select" else "index", None)
    why = _bad_start(start, ctx)
    if name == "slice":
        step = _static_int(_arg(node, 4, "step", 1))
        if step is None or step < 1:
            why = why or "steps backwards or by a non-static step"
    return (d, f"{name} along the padded dim {why}") if why else None


def _index_width(item: Any) -> int:
    """How many dims of the indexed tensor one item of a subscript consumes."""
    if item is None:
        return 0
    v = example_of(item)
    if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
        return v.dim()
    return 0 if item is Ellipsis else 1


def _bad_index(item: Any, ctx: ProofContext, size: Any = None) -> str | None:
    """Why one item of a subscript, indexing a padded dim of length ``size``, is not row-preserving,
    or None. A tensor index proven to hold the positions ``0 .. size - 1`` (an identity index, see
    :func:`index_provenance`) reads row ``i`` into row ``i``."""
    v = example_of(item)
    if size is not None and _identity_index(item, size, ctx):
        return None
    if isinstance(item, slice):
        why = None if _starts_at_zero(item.start, size, ctx) else _bad_start(item.start, ctx)
        step = example_of(item.step)
        if step is not None and not (isinstance(step, int) and step >= 1):
            why = why or "steps backwards or by a non-static step"
        return why
    if isinstance(v, torch.Tensor):
        return (
            "is a boolean mask: rows chosen by tensor values"
            if v.dtype == torch.bool
            else "is a tensor: rows chosen by tensor values"
        )
    if isinstance(item, (list, tuple)):
        return "is a list: rows picked by position"
    return _bad_start(item, ctx)


def _tail_closed(node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any]) -> bool:
    """Every use of the sink columns ``node`` appends after the padded keys is a fact-carrying step (the row max,
    the subtraction of it, the softmax) until a slice drops them: no other op sees the padding in the middle."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            f = facts.get(u)
            if isinstance(f, (NegMask, ZeroAbove)):
                if f.tail > 0:
                    todo.append(u)
                continue  # tail 0: the slice that dropped the sink columns
            if _op_name(u) in ("max", "amax") and all(
                all(isinstance(facts.get(w), NegMask) and facts[w].tail > 0 for w in g.users)
                for g in (list(u.users) if _op_name(u) == "max" else [u])
            ):
                continue  # the row max, subtracted from the same rows
            return False
    return True


@op_rule(*CONCAT)
def _check_cat(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    fact = ctx.facts.get(node)
    if isinstance(fact, NegMask) and fact.tail > 0 and ctx.causal_ok and _tail_closed(node, ctx.facts):
        ctx.relied_on.update(fact.needs)
        return None  # sink columns after the masked keys, dropped again after the softmax
    pieces = _arg(node, 0, "tensors", ())
    if not isinstance(pieces, (list, tuple)):
        return None, f"{name} of an unreadable list: cannot prove row independence"
    d = _arg(node, 1, "dim", 0)
    tensors = [example_of(p) for p in pieces]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0]
    if not tensors:
        return None
    if not isinstance(d, int):
        return None, f"{name} along a dim that is not static"
    for i, t in enumerate(tensors):
        dd = _norm_dim(d, t.dim())
        if dd in ctx.padded(t) and i < len(tensors) - 1:
            return dd, "cat along the padded dim"  # padding would land in the middle
    return None


@op_rule(*REPEATS)
def _check_repeat(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    t = example_of(node.args[0] if node.args else _arg(node, 0, "input"))
    if not isinstance(t, torch.Tensor):
        return None
    pads = ctx.padded(t)
    if not pads:
        return None
    if name == "repeat_interleave":
        reps = example_of(_arg(node, 1, "repeats", None))
        d = _arg(node, 2, "dim", None)
        if isinstance(reps, torch.Tensor) and reps.dim() > 0:
            return None, "repeat_interleave with tensor repeats: cannot prove row independence"
        if d is None:
            return None, "repeat_interleave without dim flattens the padded dim into the middle"
        return _value_use(node, ctx, [reps])  # row i -> rows k*i..k*i+k-1: padding stays last
    if node.op == "call_method" and len(node.args) > 2:
        counts: Any = list(node.args[1:])
    else:
        counts = _arg(node, 1, "repeats" if name == "repeat" else "dims", ())
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts]
    for d in pads:
        i = d + len(counts) - t.dim()
        c = _static_int(counts[i]) if 0 <= i < len(counts) else 1
        if c is not None and c > 1 and len(pads) == 1:
            # c copies of the rows one after the other: x.unsqueeze(d).expand(c at d).reshape(c * n at d), the
            # merge of a static dim into the padded one that _reshape_keeps_rows accepts (llama4's MoE repeats
            # the tokens once per expert and views them back as [experts, tokens, hidden])
            continue
        if c != 1:
            return d, f"{name} along the padded dim puts padding in the middle"
    return None


@op_rule(*PADS)
def _check_pad(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    t = example_of(_arg(node, 0, "input"))
    if not isinstance(t, torch.Tensor):
        return None
    amounts = _arg(node, 1, "pad", ())
    mode = _arg(node, 2, "mode", "constant") if name == "pad" else "constant"
    if not isinstance(amounts, (list, tuple)):
        return None, f"{name} with unreadable amounts: cannot prove row independence"
    for d in ctx.padded(t):
        k = t.dim() - 1 - d
        left = _static_int(amounts[2 * k]) if 2 * k < len(amounts) else 0
        right = _static_int(amounts[2 * k + 1]) if 2 * k + 1 < len(amounts) else 0
        if right != 0:
            return d, f"{name} appends after the padded dim (the bucket's padding would sit before it)"
        if left != 0 and mode != "constant":
            return d, f"{name} in {mode!r} mode along the padded dim reads other rows"
    return _value_use(node, ctx, [_arg(node, 3, "value", None)])


@op_rule(*EMBEDDINGS)
def _check_embedding(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    table = _arg(node, 1, "weight", None)
    w = example_of(table)
    if isinstance(w, torch.Tensor) and w.dim() and 0 in ctx.padded(w):
        return 0, "embedding looks up rows of a table along the padded dim"
    if isinstance(w, torch.Tensor) and w.dim():
        _note_table_read(node, _arg(node, 0, "input", None), table, w.shape[0], ctx)
    return None


def _note_table_read(node: torch.fx.Node, index: Any, table: Any, rows: Any, ctx: ProofContext) -> None:
    """Record a lookup of a static-size table (``rows`` along the looked-up dim) by a position index (its value
    at row ``i`` is ``i + offset``): its padding rows read past the table at a bucket too long for it
    (:mod:`.position_tables`)."""
    fact = ctx.facts.get(index) if isinstance(index, torch.fx.Node) else None
    rows = _static_int(rows)
    if not isinstance(fact, Positions) or fact.base is not None or rows is None:
        return
    length = size_expr(example_of(index).shape[fact.dim])
    if not mentions_symbol(length, ctx.names):
        return
    where = _source(node)
    ctx.table_reads.append(
        TableRead(
            f"{_label(node)} at node {node.name}{f' ({where})' if where else ''}",
            getattr(table, "name", str(table)),
            rows,
            length - 1 + fact.offset,
        )
    )


def _identity_index(item: Any, size: Any, ctx: ProofContext) -> bool:
    """``item`` holds ``0 .. size - 1`` along the dim it broadcasts on (row ``i`` reads row ``i``)."""
    fact = ctx.facts.get(item) if isinstance(item, torch.fx.Node) else None
    if not isinstance(fact, Positions) or fact.offset != 0 or fact.base is not None:
        return False
    return ctx.same_size(example_of(item).shape[fact.dim], size)
