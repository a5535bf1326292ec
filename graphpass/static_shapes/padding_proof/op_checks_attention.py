"""Op rule of the padding proof: attention (causal, masked keys, additive causal masks). See :mod:`.op_checks`."""

from __future__ import annotations

from typing import Any

import torch

from ...fx_utils import example_of, size_expr
from .facts import Causal, KeysOnly, NegMask, ZeroPad
from .nodes import _arg
from .op_checks_base import _Finding, _value_use
from .registry import ProofContext, op_rule
from .tables import _NEG_MASK_DTYPES, ATTENTION


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
                return t.dim() - 2, (
                    "causal attention whose queries and keys do not have the same padded length "
                    f"({size_expr(q.shape[-2]) if isinstance(q, torch.Tensor) and q.dim() >= 2 else '?'} "
                    f"queries, {size_expr(k.shape[-2])} keys): a real query row may see a padding key"
                )
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
    return (
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and q.dim() >= 2
        and k.dim() >= 2
        and ctx.same_size(q.shape[-2], k.shape[-2])
    )


def _additive_causal_mask(mask: Any, q: Any, k: Any, ctx: ProofContext) -> bool:
    """A float ``attn_mask`` that is a :class:`NegMask` on its last two dims (queries, keys), sized like the
    query and key sequences: the kernel adds it to the finite scores, so every real query row ``i`` gets a value
    ``<= -1e30`` at each key ``j > i`` (the padding keys among them) and a finite one on its diagonal; the softmax
    weight of every later key is then exactly 0, as in the hand-written softmax the :class:`NegMask` proof covers
    (doge's dynamic mask: ``dt_states.masked_fill(mask != 0, finfo.min)``)."""
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    m = example_of(mask)
    if not (
        isinstance(fact, NegMask)
        and fact.tail == 0
        and isinstance(m, torch.Tensor)
        and m.dim() >= 2
        and m.dtype in _NEG_MASK_DTYPES
        and (fact.q, fact.k) == (m.dim() - 2, m.dim() - 1)
        and isinstance(q, torch.Tensor)
        and q.dim() >= 2
        and isinstance(k, torch.Tensor)
        and k.dim() >= 2
        and ctx.same_size(m.shape[-2], q.shape[-2])
        and ctx.same_size(m.shape[-1], k.shape[-2])
        and _rows_aligned(q, k, ctx)
    ):
        return False
    ctx.relied_on.update(fact.needs)
    return True


def _pad_keys_masked(mask: Any, ctx: ProofContext) -> bool:
    """A boolean attention mask that is False at every padding key (dim -1): no query reads them."""
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    t = example_of(mask)
    return (
        isinstance(fact, (ZeroPad, KeysOnly))
        and isinstance(t, torch.Tensor)
        and t.dtype == torch.bool
        and fact.dim == t.dim() - 1
    )


def _causal_mask(mask: Any, ctx: ProofContext) -> bool:
    """An attention mask proven true only where key index (dim -1) <= query index (dim -2)."""
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    t = example_of(mask)
    return (
        isinstance(fact, Causal)
        and fact.shift is None
        and isinstance(t, torch.Tensor)
        and t.dtype == torch.bool
        and (fact.q, fact.k) == (t.dim() - 2, t.dim() - 1)
    )
