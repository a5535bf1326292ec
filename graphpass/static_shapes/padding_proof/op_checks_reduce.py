"""Op rules of the padding proof: reductions and scans along a dim (a masked softmax, a causal scan, a
zero-padded count), matmuls and einsums (a causal product), norms. See :mod:`.op_checks`."""

from __future__ import annotations

from typing import Any

import sympy
import torch

from ...fx_utils import example_of, size_expr
from .facts import NegKeys, NegMask, ZeroAbove, ZeroKeys, ZeroPad, ZeroPadIf
from .nodes import _MISSING, _arg, _dims, _is_int_tensor, _is_tensor_arg, _norm_dim, _op_name
from .op_checks_base import _Finding, _value_use
from .registry import ProofContext, op_rule
from .tables import _ALL, _MIX, _SOFTMAXES, ALONG_DIM, CAUSAL_SCANS, MATMULS, NORMS


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
        if (
            d in pads
            and not _causal_scan(node, name, ctx)
            and not _masked_softmax(node, name, d, ctx)
            and not _zero_padded_count(node, name, d, ctx)
            and not _split_at_length(node, name, d, t, ctx)
        ):
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
    if (
        not ctx.causal_ok
        or name not in ("sum", "count_nonzero", "any")
        or not isinstance(fact, (ZeroPad, ZeroPadIf))
        or fact.dim != d
        or not (t.dtype == torch.bool or _is_int_tensor(t))
        or _arg(node, -1, "dtype", None) not in (None, torch.int64)
    ):
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
    if not (
        ctx.causal_ok
        and name in _SOFTMAXES
        and isinstance(fact, NegMask)
        and fact.k == d
        and ctx.same_size(t.shape[fact.q], size_expr(t.shape[fact.k]) - fact.tail)
    ):
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
    if (
        isinstance(fact, ZeroKeys)
        and name in ("matmul", "bmm")
        and isinstance(tb, torch.Tensor)
        and tb.dim() >= 2
        and fact.k == ta.dim() - 1
    ):
        ctx.relied_on.update(fact.needs)
        ctx.because("key_masked_product")
        return True  # the padding value rows are multiplied by exact zeros
    if not (
        ctx.causal_ok
        and name in ("matmul", "bmm")
        and isinstance(fact, ZeroAbove)
        and fact.tail == 0
        and isinstance(tb, torch.Tensor)
        and tb.dim() >= 2
        and (fact.q, fact.k) == (ta.dim() - 2, ta.dim() - 1)
        and ctx.same_size(ta.shape[-2], ta.shape[-1])
    ):
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
