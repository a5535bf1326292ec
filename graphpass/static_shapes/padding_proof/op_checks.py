"""The op rules of the padding proof: one check per group of op names, registered by name in
:data:`.registry.OP_RULES` with :func:`.registry.op_rule`. Each returns ``(dim, reason)`` for a violation, or None.

A name without a rule is an unknown op (:data:`UNKNOWN_OP`, the conservative default). The rules read the facts
(:mod:`.facts`) of their inputs to accept causal and masked patterns (``ctx.because`` names the one that did);
what the node's own table says (pointwise, reductions along a dim, matmuls, ...) is in :mod:`.tables`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import sympy
import torch

from ...fx_utils import example_of, mentions_symbol, size_expr
from ..position_tables import TableRead
from .facts import Causal, KeysOnly, NegKeys, NegMask, Positions, ZeroAbove, ZeroKeys, ZeroPad, ZeroPadIf
from .nodes import (_MISSING, _arg, _dims, _is_int_tensor, _is_tensor_arg, _iter_nodes, _iter_values, _label, _namespace,
                    _norm_dim, _op_name, _source, _static_int)
from .provenance import _starts_at_row_0
from .registry import OpRule, ProofContext, op_rule
from .tables import (_ALL, _MIX, _SAFE_NAMESPACES, _NEG_MASK_DTYPES, _SOFTMAXES, ALONG_DIM, ATTENTION, CAUSAL_SCANS, CONCAT, CONVS,
                     EMBEDDINGS, FACTORIES, INDEXING, LAYOUT, MATMULS, META, NORMS, PADS, POINTWISE, REPEATS, RESHAPES,
                     WINDOWS)

__all__ = ["UNKNOWN_OP"]

_Finding = tuple[int | None, str]


def _value_use(node: torch.fx.Node, ctx: ProofContext, args: Iterable[Any] | None = None) -> _Finding | None:
    """A scalar argument that mentions a padded length: the op computes with the length itself."""
    leaves = _iter_values(list(node.args) + list(node.kwargs.values()) if args is None else list(args))
    for v in leaves:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Basic)) and mentions_symbol(v, ctx.names):
            expr = v.node.expr if hasattr(v, "node") else v
            return None, f"uses the padded length ({expr}) as a value"
    return None


@op_rule(*ALONG_DIM)
def _check_along_dim(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    spec = ALONG_DIM[name]
    x = _arg(node, 0, "input")
    t = example_of(x)
    if not isinstance(t, torch.Tensor):
        return None
    if name in ("max", "min") and _is_tensor_arg(_arg(node, 1, "other", None)):
        return None  # torch.max(a, b): elementwise
    pads = ctx.padded(t)
    if not pads:
        return None
    if node.op == "call_method" and name == "flip" and len(node.args) > 2:
        raw: Any = list(node.args[1:])  # x.flip(1, 2)
    else:
        raw = _arg(node, spec.pos, spec.kw, _MISSING)
        if raw is _MISSING or raw is None:
            raw = spec.default
    if name in ("var", "std", "var_mean", "std_mean") and isinstance(raw, bool):
        raw = _ALL  # var(x, unbiased)
    dims = None if isinstance(raw, str) else _dims(raw)
    if dims is not None and len(dims) == 0 and spec.what == _MIX and name not in ("flip", "roll"):
        dims, raw = None, _ALL  # sum(x, dim=[]) reduces every dim
    if dims is None:
        if not isinstance(raw, str) and raw is not None:
            return None, f"{name} along a dim that is not static: cannot prove row independence"
        return None, f"{name} over every dim includes the padded dim {pads[0]} and mixes rows"
    for d in dims:
        d = _norm_dim(d, t.dim())
        if d in pads and not _causal_scan(node, name, ctx) and not _masked_softmax(node, name, d, ctx) \
                and not _zero_padded_count(node, name, d, ctx) and not _split_at_length(node, name, d, t, ctx):
            return d, f"{name} {spec.what}"
    return None


def _split_at_length(node: torch.fx.Node, name: str, d: int, t: torch.Tensor, ctx: ProofContext) -> bool:
    """``torch.tensor_split(x, [b], dim=d)`` with ``b`` the padded length itself, or it minus a static count ``k``
    (transformers 5.25 splits every state-space layer's input so, ``k`` the recurrent states a cache keeps, 0
    without one). The first piece is ``x[:, :b]``: a prefix, its real rows still first. The second,
    ``x[:, b:]``, is empty when ``k`` is 0; else it is the last ``k`` rows, which move with the padding (padding
    rows, or real ones at another place), so it must not be read."""
    if name != "tensor_split" or len(node.args) < 2:
        return False
    bounds = node.args[1]
    if not isinstance(bounds, (list, tuple)) or len(bounds) != 1:
        return False
    v = example_of(bounds[0])
    if not isinstance(v, (int, torch.SymInt)):
        return False
    k = size_expr(t.shape[d]) - size_expr(v)
    if not (isinstance(k, sympy.Integer) and k >= 0):
        return False
    if k == 0:
        ctx.because("split_at_padded_length")
        return True
    for u in node.users:  # the pieces are taken by index (parts[1], parts[-1]); any other use may read the tail
        index = u.args[1] if _op_name(u) == "getitem" and len(u.args) > 1 else None
        if not isinstance(index, int) or (index % 2 == 1 and u.users):
            return False  # the last k rows are read
    ctx.because("split_before_unread_tail")
    return True


def _zero_padded_count(node: torch.fx.Node, name: str, d: int, ctx: ProofContext) -> bool:
    """``sum`` / ``count_nonzero`` / ``any`` along ``d`` of an integer or boolean tensor that is 0 at every padding
    row along ``d`` (a zero-padded input read in place, or a :class:`ZeroPadIf`): the padding adds exact zeros,
    so the result is the unpadded one."""
    x = _arg(node, 0, "input")
    fact = ctx.facts.get(x) if isinstance(x, torch.fx.Node) else None
    t = example_of(x)
    if not ctx.causal_ok or name not in ("sum", "count_nonzero", "any") or not isinstance(fact, (ZeroPad, ZeroPadIf)) \
            or fact.dim != d \
            or not (t.dtype == torch.bool or _is_int_tensor(t)) or _arg(node, -1, "dtype", None) not in (None, torch.int64):
        return False
    if isinstance(fact, ZeroPadIf):
        ctx.relied_on.update(fact.needs)
    ctx.because("zero_padded_count")
    return True


def _causal_scan(node: torch.fx.Node, name: str, ctx: ProofContext) -> bool:
    """A prefix scan (or ``diff`` without ``append``) where causal ops count as safe."""
    if not ctx.causal_ok or name not in CAUSAL_SCANS:
        return False
    if name != "diff" or _arg(node, 4, "append", None) is None:
        ctx.because("causal_scan")
        return True
    return False


def _masked_softmax(node: torch.fx.Node, name: str, d: int, ctx: ProofContext) -> bool:
    """A softmax over the keys ``d`` of scores plus an additive causal mask (a :class:`NegMask` on ``d``): every
    real row's later keys, the padding among them, get exactly 0, so the row equals the unpadded one. A
    ``logsumexp`` over the same keys (granite_swa's sink scale) is the log of that softmax's denominator: its max is
    the row's finite max (the diagonal), every fill value's ``exp`` is exactly 0, so it equals the unpadded row's."""
    if name == "logsumexp":
        name = "softmax"  # the same proof: a sum of exp(v - max) over the keys, exact zeros from the fill values
    x = _arg(node, 0, "input")
    fact = ctx.facts.get(x) if isinstance(x, torch.fx.Node) else None
    t = example_of(x)
    if isinstance(fact, NegMask) and name in ("max", "amax") and fact.k == d and ctx.causal_ok:
        ctx.relied_on.update(fact.needs)
        ctx.because("masked_softmax")
        return True  # a real row's max is a finite score (its diagonal): the fill values never win
    if isinstance(fact, NegKeys) and name in _SOFTMAXES and fact.k == d:
        ctx.relied_on.update(fact.needs)
        ctx.because("key_masked_softmax")
        return True  # every row's padding keys get exactly 0 (no causality needed)
    if not (ctx.causal_ok and name in _SOFTMAXES and isinstance(fact, NegMask) and fact.k == d
            and ctx.same_size(t.shape[fact.q], size_expr(t.shape[fact.k]) - fact.tail)):
        return False
    ctx.relied_on.update(fact.needs)
    ctx.because("masked_softmax")
    return True


def _causal_product(node: torch.fx.Node, name: str, ctx: ProofContext) -> bool:
    """``matmul`` / ``bmm`` of attention weights that are 0 at every key after the query (a :class:`ZeroAbove`
    on dims -2, -1) with the values: a real row reads value rows up to its own only."""
    a, b = _arg(node, 0, "input"), _arg(node, 1, "other" if name == "matmul" else "mat2", None)
    fact = ctx.facts.get(a) if isinstance(a, torch.fx.Node) else None
    ta, tb = example_of(a), example_of(b)
    if isinstance(fact, ZeroKeys) and name in ("matmul", "bmm") and isinstance(tb, torch.Tensor) and tb.dim() >= 2 \
            and fact.k == ta.dim() - 1:
        ctx.relied_on.update(fact.needs)
        ctx.because("key_masked_product")
        return True  # the padding value rows are multiplied by exact zeros
    if not (ctx.causal_ok and name in ("matmul", "bmm") and isinstance(fact, ZeroAbove) and fact.tail == 0
            and isinstance(tb, torch.Tensor)
            and tb.dim() >= 2 and (fact.q, fact.k) == (ta.dim() - 2, ta.dim() - 1)
            and ctx.same_size(ta.shape[-2], ta.shape[-1])):
        return False
    ctx.relied_on.update(fact.needs)
    ctx.because("causal_product")
    return True


@op_rule(*MATMULS)
def _check_matmul(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    spec = MATMULS[name]
    if name == "einsum":
        return _check_einsum(node, ctx)
    if _causal_product(node, name, ctx):
        return _value_use(node, ctx)
    pairs: list[tuple[torch.Tensor, int]] = []
    if spec is None:  # matmul: by rank
        a, b = example_of(_arg(node, 0, "input")), example_of(_arg(node, 1, "other"))
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return None
        pairs = [(a, 0 if a.dim() == 1 else -1), (b, 0 if b.dim() == 1 else -2)]
    else:
        for pos, kw, d in spec:
            t = example_of(_arg(node, pos, kw, None))
            if isinstance(t, torch.Tensor):
                pairs.append((t, d))
    for t, d in pairs:
        if t.dim() == 0:
            continue
        d = _norm_dim(d, t.dim())
        if d in ctx.padded(t):
            return d, f"{name} contracts over the padded dim"
    return None


def _check_einsum(node: torch.fx.Node, ctx: ProofContext) -> _Finding | None:
    eq = node.args[0] if node.args else node.kwargs.get("equation")
    ops = list(node.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str):
        return None, "einsum without a readable equation: cannot prove row independence"
    eq = eq.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if "->" not in eq:
        letters = [c for c in lhs if c.isalpha()]
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    kept = set(rhs)
    for term, op in zip(terms, ops):
        t = example_of(op)
        if not isinstance(t, torch.Tensor):
            continue
        pads = ctx.padded(t)
        before, ell, after = term.partition("...")
        labels: dict[int, str] = {i: c for i, c in enumerate(before)}
        if ell:
            labels.update({t.dim() - len(after) + i: c for i, c in enumerate(after)})
        for d in pads:
            c = labels.get(d)
            if c is not None and c not in kept:
                return d, "einsum contracts over the padded dim"
    return None


@op_rule(*NORMS)
def _check_norm(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    t = example_of(_arg(node, 0, "input"))
    if not isinstance(t, torch.Tensor):
        return None
    pads = ctx.padded(t)
    kind = NORMS[name]
    if kind == "trailing":
        shape = _arg(node, 1, "normalized_shape", None)
        k = len(shape) if isinstance(shape, (list, tuple)) else 1
        dims = range(t.dim() - k, t.dim())
    elif kind == "from1":
        dims = range(1, t.dim())
    elif kind == "from2":
        dims = range(2, t.dim())
    else:  # batch norm: statistics over every dim but 1 in training, running stats otherwise
        training = _arg(node, 5, "training", False)
        if training is False:
            return _value_use(node, ctx)
        dims = [d for d in range(t.dim()) if d != 1]
    for d in dims:
        if d in pads:
            return d, f"{name} normalises over the padded dim"
    return _value_use(node, ctx)


@op_rule(*ATTENTION)
def _check_attention(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    q = example_of(_arg(node, 0, "query"))
    k = example_of(_arg(node, 1, "key", None))
    v = example_of(_arg(node, 2, "value", None))
    for t in (q, k):
        if isinstance(t, torch.Tensor) and t.dim() and t.dim() - 1 in ctx.padded(t):
            return t.dim() - 1, f"{name} contracts over the padded head dim"
    for t in (k, v):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.dim() - 2 in ctx.padded(t):
            mask = _arg(node, 3, "attn_mask", None)
            causal = _arg(node, 5, "is_causal", False) is True or _causal_mask(mask, ctx)
            if causal and ctx.causal_ok and not _rows_aligned(q, k, ctx):
                return t.dim() - 2, ("causal attention whose queries and keys do not have the same padded length "
                                     f"({size_expr(q.shape[-2]) if isinstance(q, torch.Tensor) and q.dim() >= 2 else '?'} "
                                     f"queries, {size_expr(k.shape[-2])} keys): a real query row may see a padding key")
            if causal and ctx.causal_ok:
                ctx.because("causal_sdpa" if _arg(node, 5, "is_causal", False) is True else "causal_mask_sdpa")
                break  # row i sees rows <= i; the padding sits after every real row
            if _pad_keys_masked(mask, ctx):
                ctx.because("key_mask_sdpa")
                break  # the mask is False at every padding key (ANDed with a zero-padded attention mask)
            if ctx.causal_ok and not causal and _additive_causal_mask(mask, q, t, ctx):
                ctx.because("additive_causal_mask_sdpa")
                break  # a float mask adding <= -1e30 at every later key: softmax weight exactly 0 there
            why = " without is_causal or a mask proven causal" if ctx.causal_ok else ""
            return t.dim() - 2, "attention over the padded sequence" + why
    return _value_use(node, ctx)


def _rows_aligned(q: Any, k: Any, ctx: ProofContext) -> bool:
    """Causality along the padded dim needs the query and key rows to line up: query ``i`` may see keys ``j <= i``,
    and that keeps a real query row off the padding keys only when there are at least as many real keys as real
    queries. Both rows start at row 0 of their tensors (anything else is refused where it is sliced), so that holds
    when both dims have the same padded length (the same size expression). A key tensor that is a shifted slice of
    the queries' rows (``h[:, :, 1:]``, ``L - 1`` rows against ``L``) or static queries over padded keys do not."""
    return isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2 and k.dim() >= 2 \
        and ctx.same_size(q.shape[-2], k.shape[-2])


def _additive_causal_mask(mask: Any, q: Any, k: Any, ctx: ProofContext) -> bool:
    """A float ``attn_mask`` that is a :class:`NegMask` on its last two dims (queries, keys), sized like the
    query and key sequences: the kernel adds it to the finite scores, so every real query row ``i`` gets a value
    ``<= -1e30`` at each key ``j > i`` (the padding keys among them) and a finite one on its diagonal; the softmax
    weight of every later key is then exactly 0, as in the hand-written softmax the :class:`NegMask` proof covers
    (doge's dynamic mask: ``dt_states.masked_fill(mask != 0, finfo.min)``)."""
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    m = example_of(mask)
    if not (isinstance(fact, NegMask) and fact.tail == 0 and isinstance(m, torch.Tensor) and m.dim() >= 2
            and m.dtype in _NEG_MASK_DTYPES and (fact.q, fact.k) == (m.dim() - 2, m.dim() - 1)
            and isinstance(q, torch.Tensor) and q.dim() >= 2 and isinstance(k, torch.Tensor) and k.dim() >= 2
            and ctx.same_size(m.shape[-2], q.shape[-2]) and ctx.same_size(m.shape[-1], k.shape[-2])
            and _rows_aligned(q, k, ctx)):
        return False
    ctx.relied_on.update(fact.needs)
    return True


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
        return "is a boolean mask: rows chosen by tensor values" if v.dtype == torch.bool else \
            "is a tensor: rows chosen by tensor values"
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
                    for g in (list(u.users) if _op_name(u) == "max" else [u])):
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
    ctx.table_reads.append(TableRead(f"{_label(node)} at node {node.name}{f' ({where})' if where else ''}",
                                     getattr(table, "name", str(table)), rows, length - 1 + fact.offset))


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
    stride, padding, dilation = (_dims(_arg(node, i, kw, dflt)) for i, kw, dflt in (
        (3, "stride", 1), (4, "padding", 0), (5, "dilation", 1)))
    k = _static_int(w.shape[-1])
    causal = (ctx.causal_ok and k is not None and stride is not None and padding is not None and dilation is not None
              and stride[0] == 1 and padding[0] >= (k - 1) * dilation[0])
    if not causal and ctx.causal_ok and _valid_conv(stride, padding, dilation, k):
        return _value_use(node, ctx)
    if not causal:
        return pads[0], f"{name} along the padded dim reads later rows (not stride 1 with padding >= (kernel - 1) * dilation)"
    extra = 2 * padding[0] - (k - 1) * dilation[0]
    if extra > 0:
        bad = _unsliced_extra_rows(node, x.dim() - 1, x.shape[-1], ctx)
        if bad is not None:
            return pads[0], (f"{name}'s {extra} output rows past the input's length read its zero padding unpadded and "
                             f"padding rows bucketed; {_label(bad)} at node {bad.name} reads them (only a slice "
                             "[..., :length] may, before anything else)")
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
            if name in ("narrow", "slice") and _static_int(_arg(u, 1, "dim", None)) in (dim, dim - example_of(n).dim()) \
                    and _starts_at_row_0(_arg(u, 2, "start", None)) \
                    and ctx.same_size(_arg(u, 3, "length" if name == "narrow" else "end", None), length) \
                    and _static_int(_arg(u, 4, "step", 1)) in (1, None):
                continue
            others = [a for a in _iter_nodes((u.args, u.kwargs)) if a is not n and ctx.padded(a)]
            if name in POINTWISE and not others and isinstance(out, torch.Tensor) \
                    and out.dim() == example_of(n).dim() and ctx.same_size(out.shape[dim], example_of(n).shape[dim]):
                todo.append(u)
                continue
            return u
    return None


def _prefix_slice_of(node: torch.fx.Node, dim: int, length: Any, ctx: ProofContext) -> bool:
    """``node`` is ``x[..., :length]`` along ``dim`` of ``x`` (a full slice or an Ellipsis on every other dim)."""
    t = example_of(node.args[0])
    idx = node.args[1] if len(node.args) > 1 else None
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if not isinstance(t, torch.Tensor) or any(i is None or isinstance(example_of(i), torch.Tensor) for i in items) \
            or sum(1 for i in items if i is Ellipsis) > 1:
        return False
    d, found = 0, False
    for item in items:
        if item is Ellipsis:
            d += t.dim() - (len(items) - 1)
            continue
        if not isinstance(item, slice):
            return False
        if d == dim:
            found = _starts_at_row_0(item.start) and item.step in (None, 1) and item.stop is not None \
                and ctx.same_size(item.stop, length)
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
    return (k is not None and stride is not None and padding is not None and dilation is not None
            and len(stride) == len(padding) == len(dilation) == 1 and stride[0] == 1 and padding[0] == 0)


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


def _identity_index(item: Any, size: Any, ctx: ProofContext) -> bool:
    """``item`` holds ``0 .. size - 1`` along the dim it broadcasts on (row ``i`` reads row ``i``)."""
    fact = ctx.facts.get(item) if isinstance(item, torch.fx.Node) else None
    if not isinstance(fact, Positions) or fact.offset != 0 or fact.base is not None:
        return False
    return ctx.same_size(example_of(item).shape[fact.dim], size)


def _pad_keys_masked(mask: Any, ctx: ProofContext) -> bool:
    """A boolean attention mask that is False at every padding key (dim -1): no query reads them."""
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    t = example_of(mask)
    return isinstance(fact, (ZeroPad, KeysOnly)) and isinstance(t, torch.Tensor) and t.dtype == torch.bool \
        and fact.dim == t.dim() - 1


def _causal_mask(mask: Any, ctx: ProofContext) -> bool:
    """An attention mask proven true only where key index (dim -1) <= query index (dim -2)."""
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    t = example_of(mask)
    return isinstance(fact, Causal) and fact.shift is None and isinstance(t, torch.Tensor) \
        and t.dtype == torch.bool and (fact.q, fact.k) == (t.dim() - 2, t.dim() - 1)



@op_rule(*LAYOUT, *META, name="layout")
def _check_layout(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding | None:
    """Dim-wise layout ops (:data:`.tables.LAYOUT`) and size queries (:data:`.tables.META`): always safe."""
    return None


def _unknown(node: torch.fx.Node, name: str | None, ctx: ProofContext) -> _Finding | None:
    return None, f"unknown op {_label(node)}: cannot prove row independence"


#: The conservative default: an op without a rule (a name not in :data:`.registry.OP_RULES`, a custom op, a
#: higher-order op) whose input or output has a padded dim is a violation.
UNKNOWN_OP = OpRule("unknown_op", _unknown)
