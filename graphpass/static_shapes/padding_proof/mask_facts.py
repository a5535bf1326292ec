"""The additive-mask facts of the padding proof (see :mod:`.provenance`, which registers the rules that use them):
``where(causal, score, fill)``, ``score + mask`` and the softmax of one, a sink logit appended after the keys, and
the legacy ``(1 - m) * finfo.min`` key mask; which nodes may hold a huge fill value (:func:`_huge_nodes`)."""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Mapping

import torch

from ...fx_utils import example_of
from .facts import Causal, KeysOnly, MaskedAbove, NegKeys, NegMask, OnePad, ZeroAbove, ZeroKeys, ZeroPad
from .facts import aligned as _aligned
from .nodes import _arg, _leaves, _norm_dim, _op_name, _static_int
from .tables import _BOUNDED, _HUGE, _NEG_MASK_DTYPES, _SOFTMAXES, ATTENTION, FACTORIES


def _is_zero(value: Any) -> bool:
    """A constant 0: a Python 0 or a ``zeros`` / ``zeros_like`` / ``new_zeros`` node, or a ``full`` / ``full_like`` /
    ``new_full`` one whose fill value is a Python 0 (doge's ``torch.full((), 0.0)``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if not (isinstance(value, torch.fx.Node) and value.op in ("call_function", "call_method")):
        return False
    name = _op_name(value)
    if name in FACTORIES and FACTORIES[name] and name != "arange":  # full, full_like, new_full: the fill value
        pos, kw = FACTORIES[name][0]
        fill = _arg(value, pos, kw, None)
        return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill == 0
    return name in ("zeros", "zeros_like", "new_zeros")


def _huge_value(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and (v != v or abs(v) >= _HUGE)


def _huge_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes that may hold a fill value (a constant of magnitude >= 1e30, or not finite) or a sum with one: a
    mask, not a score. A softmax or a sigmoid ends it (their values lie in [0, 1] for any input but NaN; granite_swa's
    sink scale is ``sigmoid(logsumexp(scores + mask) - sink)``), and so does an attention kernel whose query, key
    and value hold none (softmax weights times the values)."""
    huge: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or _op_name(node) in _BOUNDED:
            continue
        if _op_name(node) in ATTENTION and not any(
            isinstance(a, torch.fx.Node) and a in huge
            for a in (_arg(node, i, kw, None) for i, kw in ((0, "query"), (1, "key"), (2, "value")))
        ):
            continue  # softmax weights times the values: a fill value in the mask does not reach the result
        leaves = list(_leaves((node.args, node.kwargs)))
        if any(_huge_value(v) or (isinstance(v, torch.fx.Node) and v in huge) for v in leaves):
            huge.add(node)
    return huge


def _mask_fact(
    node: torch.fx.Node, name: str, facts: Mapping[torch.fx.Node, Any], huge: set[torch.fx.Node], out: torch.Tensor
) -> Any:
    """The additive-mask facts: ``where(causal, score, fill)`` and ``score + mask`` (a :class:`NegMask`), a softmax
    of one over its keys (a :class:`ZeroAbove`)."""
    if name == "where" and len(node.args) == 3 and out.dtype in _NEG_MASK_DTYPES:
        return _where_fact(node, facts, huge, out)
    if name == "masked_fill" and len(node.args) == 3 and out.dtype in _NEG_MASK_DTYPES:
        x, cond, fill = node.args
        fact = _aligned(facts.get(cond), cond, out) if isinstance(cond, torch.fx.Node) else None
        x_ok = isinstance(x, torch.fx.Node) and x not in huge
        if isinstance(fact, MaskedAbove) and x_ok and isinstance(fill, (int, float)) and fill <= -_HUGE:
            return NegMask(fact.q, fact.k, fact.needs)
        return None
    if name == "cat":
        return _sink_cat_fact(node, facts, huge, out)
    if name in ("max", "maximum") and len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args):
        for m, c in (node.args, node.args[::-1]):  # max(scores + mask, full((), finfo.min)): xglm's clamp
            fact = _aligned(facts.get(m), m, out)
            if isinstance(fact, NegMask) and _is_negative_constant(c):
                return fact  # the fill values stay <= -1e30, the finite scores are unchanged
        return None
    if name == "sub" and len(node.args) == 2 and isinstance(node.args[0], torch.fx.Node):
        fact = facts.get(node.args[0])
        if isinstance(fact, NegMask) and _row_max_of(node.args[1], node.args[0], fact.k):
            return fact  # minus the row's own max (finite for a real row): the fill values stay <= -1e30
        return None
    if name == "add" and len(node.args) == 2 and out.dtype in _NEG_MASK_DTYPES and "alpha" not in node.kwargs:
        both = _neg_mask_sum(node, facts, out)
        if both is not None:
            return both
        for m, x in (node.args, node.args[::-1]):
            fact = _aligned(facts.get(m), m, out) if isinstance(m, torch.fx.Node) else None
            if (
                isinstance(fact, (NegMask, NegKeys))
                and isinstance(x, torch.fx.Node)
                and x not in huge
                and isinstance(example_of(x), torch.Tensor)
                and example_of(x).dtype.is_floating_point
            ):
                return (
                    replace(fact, pure=False) if isinstance(fact, NegMask) else fact
                )  # plus scores: not 0 on the diagonal
        return None
    if name in _SOFTMAXES:
        src = node.args[0]
        fact = facts.get(src) if isinstance(src, torch.fx.Node) else None
        dim = _static_int(_arg(node, 1, "dim", None))
        if isinstance(fact, NegMask) and dim is not None and _norm_dim(dim, out.dim()) == fact.k:
            return ZeroAbove(fact.q, fact.k, fact.needs, fact.tail)
        if isinstance(fact, NegKeys) and dim is not None and _norm_dim(dim, out.dim()) == fact.k:
            return ZeroKeys(fact.k, fact.needs)
    return None


def _where_fact(
    node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], huge: set[torch.fx.Node], out: torch.Tensor
) -> Any:
    """``where(causal, score, fill)`` with a fill value <= -1e30 and a score holding none: a :class:`NegMask`
    (a :class:`NegKeys` for a keys-only condition)."""
    cond, keep, fill = (_aligned(facts.get(a), a, out) if isinstance(a, torch.fx.Node) else None for a in node.args)
    fill_value = node.args[2]
    huge_fill = (
        isinstance(fill_value, (int, float)) and not isinstance(fill_value, bool) and fill_value <= -_HUGE
    ) or (
        isinstance(fill_value, torch.fx.Node)
        and fill_value in huge
        and fill_value.op == "call_function"
        and _is_negative_constant(fill_value)
    )
    keep_ok = not (isinstance(node.args[1], torch.fx.Node) and node.args[1] in huge) and not _huge_value(node.args[1])
    if isinstance(cond, Causal) and cond.diag is not None and huge_fill and keep_ok:
        return NegMask(cond.q, cond.k, cond.diag, pure=_is_zero(node.args[1]))
    if isinstance(cond, KeysOnly) and huge_fill and keep_ok:
        return NegKeys(cond.dim, cond.needs)
    return None


def _neg_mask_sum(node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """``a + b`` of two :class:`NegMask` on the same dims (GPT-Neo: ``where(tril_buffer, scores, min)`` plus
    transformers' additive mask): at a key after a real row's query both are ``<= -1e30``, so their sum is (or is
    ``-inf``, whose softmax weight is 0 as well); on the diagonal both are finite, so the sum is (exactly 0 when both
    are 0). Needs every input either needs."""
    a, b = (_aligned(facts.get(x), x, out) if isinstance(x, torch.fx.Node) else None for x in node.args)
    if not (isinstance(a, NegMask) and isinstance(b, NegMask)) or (a.q, a.k) != (b.q, b.k) or a.tail or b.tail:
        return None
    return NegMask(a.q, a.k, a.needs | b.needs, pure=a.pure and b.pure)


def _row_max_of(value: Any, src: torch.fx.Node, k: int) -> bool:
    """``value`` is ``src.max(dim=k, keepdim=True).values`` (or ``amax``)."""
    if not isinstance(value, torch.fx.Node):
        return False
    if (
        value.op == "call_function"
        and value.target in (operator.getitem, getattr)
        and len(value.args) == 2
        and value.args[1] in (0, "values")
        and isinstance(value.args[0], torch.fx.Node)
    ):
        value = value.args[0]
        if _op_name(value) != "max":
            return False
    elif _op_name(value) != "amax":
        return False
    t = example_of(src)
    dim = _static_int(_arg(value, 1, "dim", None))
    return (
        value.args[0] is src
        and dim is not None
        and _norm_dim(dim, t.dim()) == k
        and _arg(value, 2, "keepdim", False) is True
    )


def _sink_cat_fact(
    node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], huge: set[torch.fx.Node], out: torch.Tensor
) -> Any:
    """``cat([scores + mask, sinks], dim=k)``: static columns of finite values after the masked keys."""
    pieces = _arg(node, 0, "tensors", ())
    d = _static_int(_arg(node, 1, "dim", 0))
    if (
        not isinstance(pieces, (list, tuple))
        or len(pieces) < 2
        or d is None
        or not isinstance(pieces[0], torch.fx.Node)
    ):
        return None
    fact = facts.get(pieces[0])
    if not (isinstance(fact, NegMask) and fact.tail == 0 and _norm_dim(d, out.dim()) == fact.k):
        return None
    widths = [
        _static_int(example_of(p).shape[fact.k]) if isinstance(example_of(p), torch.Tensor) else None
        for p in pieces[1:]
    ]
    if any(w is None for w in widths) or any(p in huge for p in pieces[1:]):
        return None
    return replace(fact, tail=sum(widths), pure=False)


def _is_negative_constant(node: torch.fx.Node) -> bool:
    """``torch.tensor(v)`` / ``full(..., v)`` with a static ``v <= -1e30``: a fill value."""
    values = [v for v in _leaves((node.args, node.kwargs)) if isinstance(v, float)]
    return _op_name(node) in ("tensor", "full", "scalar_tensor") and bool(values) and all(v <= -_HUGE for v in values)


def _legacy_key_mask_fact(node: torch.fx.Node, name: str, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """``1 - m`` (``rsub(m, 1)``) of a zero-padded input ``m`` read in place: a :class:`OnePad` (1 at the padding,
    ``1 - m`` elsewhere, so 0 where ``m`` holds 1); that times a static fill ``<= -1e30``: a :class:`NegKeys` (the
    fill at every padding key, ``-0.0`` at every real key where ``m`` holds 1)."""
    if len(node.args) != 2 or node.kwargs or out.dtype == torch.bool or out.dtype.is_complex:
        return None
    a, b = node.args
    if name in ("sub", "rsub"):
        one, m = (a, b) if name == "sub" else (b, a)
        fact = _aligned(facts.get(m), m, out) if isinstance(m, torch.fx.Node) else None
        if (
            isinstance(one, (int, float))
            and not isinstance(one, bool)
            and one == 1
            and isinstance(fact, ZeroPad)
            and fact.source is not None
        ):
            return OnePad(fact.dim, frozenset({fact.source}))
        return None
    for x, c in ((a, b), (b, a)):
        fact = _aligned(facts.get(x), x, out) if isinstance(x, torch.fx.Node) else None
        if (
            isinstance(fact, OnePad)
            and isinstance(c, (int, float))
            and not isinstance(c, bool)
            and c <= -_HUGE
            and out.dtype in _NEG_MASK_DTYPES
        ):
            return NegKeys(fact.dim, fact.needs)
    return None
