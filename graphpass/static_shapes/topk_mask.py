"""Top-k key selection that only narrows a causal attention mask (sparse-attention indexers).

DeepSeek-V3.2's sparse attention (DSA) and the models that copy it (GLM-MoE-DSA, A.X-K2, dots3, HY-V4) score
every key for every query with a small indexer, mask the scores with the attention mask, keep the top ``k`` keys
per query row and AND the attention mask with "is one of the kept keys"::

    S = scores.masked_fill(~M1, -inf)                                # M1 = attention_mask[:, 0]: causal
    picked = new_ones(S.shape, dtype=bool).scatter(-1, S.topk(k, dim=-1).indices, False)   # True: not kept
    mask = M2 & ~picked.unsqueeze(1)                                 # M2 = attention_mask, the same elements

The ``topk`` reads the whole key row and the ``scatter`` writes positions chosen by tensor values, so the op-by-op
rules refuse both. This module proves the pattern as a whole, when it is safe, and says when it is not.

**Why it is exact when ``k`` is at least the padded length.** Take a real query row ``i < L``. ``M1`` is false at
every key ``j > i`` (a causal fact, :class:`~graphpass.static_shapes.padding_safety.Causal`) or at every padding key
(a bidirectional mask), so row ``i`` of ``S`` holds at most ``L`` values that are not ``-inf``: finite scores (values
are assumed finite, as in every other proof). ``topk`` with ``k >= L`` keeps ``k`` entries of the row, and an entry
that is strictly larger than ``k`` or more entries of the row is always among them; every finite value is strictly
larger than all the ``-inf`` ones, of which there are at least ``n - L >= n - k`` (``n`` the row's length), so
every unmasked key is kept, whatever the order in which ties are broken. The masked keys it also keeps (ties at
``-inf``, broken differently with and without padding) do not matter: ``M2 & kept`` at ``(i, j)`` is ``M2[i, j]``
where ``M2`` is true (that key is unmasked in ``M1``, the same element, so kept), and false where ``M2`` is false.
So the combined mask equals ``M2`` on every real row, padded or not, and the attention that reads it is proven by
the attention-mask rules as before. The padded rows are sliced off.

**Why it is refused otherwise.** When a real row has more than ``k`` unmasked keys, ``topk`` chooses among finite
scores, and an exact tie at the ``k``-th value (common: the indexer sums ``relu``'d head scores, so every key all of
whose heads are negative scores exactly 0) is broken by the implementation, differently for a row of another
length (CPU: ``nth_element`` over the whole row, trailing ``-inf`` included, or a heap when ``64 k <= n``; CUDA: radix
select). Measured on the tiny conformance models (``index_topk = 4``, lengths 5 to 14): 1 (DeepSeek-V3.2) and 2
(GLM-MoE-DSA) of 48 real rows had a tie at the 4th value, and padded rows with ties pick another key set in 1073 of
2800 random cases. A different kept key is a different attention row, not a rounding difference. ``k`` itself may
depend on the length (``min(index_topk, seq_len)``): the proof evaluates ``k`` at each bucket ``b`` and needs
``k(b) >= b`` (then ``k >= L`` for every call padded to ``b``) and ``k(L) >= L`` for every length ``L`` landing in ``b``
(so the unpadded run keeps every unmasked key too); the other buckets run unpadded
(``BucketPlan.invalid_buckets``), and a plan with no such bucket is refused, naming the ``topk``.

What is checked on the graph (anything else keeps the op-by-op verdict, i.e. the refusal):

* ``topk(S, k, dim=-1, largest=True)``; ``S = masked_fill(X, ~M1, v)`` with ``v <= -1e30`` (or ``-inf``) and ``X``
  holding no fill value; ``M1`` causal along its last two dims (without a run-time offset) or false at every padding
  key, with the padded key dim last.
* every use of ``topk`` is its indices (``[1]``, ``.indices``), through dtype conversions only, as the index of
  ``scatter(B, -1, idx, False)`` where ``B`` is an all-true boolean factory of exactly ``S``'s sizes;
* every use of the scatter result is, through size-1 views (``unsqueeze``, ``[:, None]``), a NOT, and every use of
  that is an AND with a mask ``M2`` whose elements are those of ``M1`` at the same output index: ``M1`` and ``M2``
  are views of one node (int indices only on size-1 dims, no transposes), and each dim of the AND maps to the same
  dim of that node through both operands (or to none, where the dim has size 1).

The float-mask path of the same code (eager attention: ``S = X + M1f``, ``M2f.masked_fill(not_kept, finfo.min)``) is
proven the same way when ``M1f`` and ``M2f`` are size-1-views of one ``where(cond, 0, v <= -1e30)`` (every entry exactly 0
or a fill value, so after adding finite scores the unmasked entries are strictly above the masked ones) whose fact puts
a fill value at every key after the query (``NegMask``) or at every padding key (``NegKeys``). On every real row the
narrowed mask then equals ``M2f`` except that some fill values become ``finfo.min`` (still fill values), so it carries
``M2f``'s fact (``TopkMask.facts``; ``index_provenance(..., proven=)``) into the additive-mask softmax proof.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import sympy
import torch

from ..fx_utils import example_of, size_expr
from .padding_proof import NotProven, PaddingProof, ProofContext
from .padding_proof.facts import Causal, KeysOnly, NegKeys, NegMask, ZeroPad
from .padding_proof.nodes import _arg, _is_int_tensor, _label, _leaves, _norm_dim, _op_name, _source, _static_int
from .padding_proof.mask_facts import _huge_value, _is_negative_constant, _is_zero
from .padding_proof.tables import _ALL_TRUE_FACTORIES, _ANDS, _HUGE, _KEEPS, _NEG_MASK_DTYPES, _NOTS, _SOFTMAXES

__all__ = ["TOPK_MASKS", "TopkBuckets", "TopkMask", "TopkMaskRule", "topk_masks", "topk_invalid_buckets"]


@dataclass(frozen=True)
class TopkMask:
    """A proven top-k selection: the nodes the op-by-op check skips, and ``k`` (an expression in the size
    symbols), which must be at least the bucket at every bucket the plan pads to."""

    topk: torch.fx.Node
    k: sympy.Expr
    nodes: frozenset[torch.fx.Node]
    # float-mask path: the ``M2f.masked_fill(not_kept, fill)`` nodes -> the fact of ``M2f`` they carry (equal to
    # ``M2f`` on every real row up to fill values, at the buckets the proof holds)
    facts: tuple[tuple[torch.fx.Node, Any], ...] = ()

    @property
    def bucket_checks(self) -> tuple["TopkBuckets", ...]:
        """The buckets this proof holds at are those where ``k`` covers the length (:func:`topk_invalid_buckets`)."""
        return (TopkBuckets(self),)


@dataclass(frozen=True)
class TopkBuckets:
    """The buckets at which a proven top-k keeps fewer keys than the bucket's length (a :class:`~.padding_proof.BucketCheck`)."""

    proof: TopkMask
    name: str = "topk_mask"

    def mark(self, proof: PaddingProof, names: set[str], buckets: tuple[int, ...]) -> None:
        topk_invalid_buckets(proof, names, buckets, [self.proof])


@dataclass(frozen=True)
class TopkMaskRule:
    """:func:`topk_masks` as a whole-pattern rule of the padding proof (:class:`~.padding_proof.PatternRule`)."""

    name: str = "topk_mask"
    needs_causal: bool = True

    def prove(self, gm: torch.fx.GraphModule, ctx: ProofContext) -> list[TopkMask]:
        return topk_masks(gm, ctx.facts, ctx.same_size, ctx.padded)


#: The rule ``plan_static_shapes`` passes to ``prove_padding(rules=)``.
TOPK_MASKS = TopkMaskRule()


#: ``x.new_*(size)``: a factory that reads only ``x``'s dtype and device, not its values.
_METADATA_FACTORIES = frozenset("new_ones new_zeros new_empty new_full".split())


def _fill_tainted(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes that may hold a fill value (a constant of magnitude >= 1e30, or not finite), like
    ``padding_proof.provenance._huge_nodes``, except that an integer or boolean tensor holds none (top-k indices, masks), so
    the scores of a later layer, computed through a boolean attention mask, are not tainted by an earlier layer's
    ``masked_fill(..., -inf)``."""
    tainted: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or _op_name(node) in _SOFTMAXES:
            continue
        out = example_of(node)
        if isinstance(out, torch.Tensor) and (out.dtype == torch.bool or _is_int_tensor(out)):
            continue
        leaves = list(_leaves((node.args, node.kwargs)))
        if any(_huge_value(v) or (isinstance(v, torch.fx.Node) and v in tainted) for v in leaves):
            tainted.add(node)
    return tainted


def topk_masks(
    gm: torch.fx.GraphModule,
    facts: Mapping[torch.fx.Node, Any],
    same_size: Callable[[Any, Any], bool],
    padded: Callable[[Any], tuple[int, ...]],
) -> list[TopkMask]:
    """Every ``topk`` of ``gm`` proven to only narrow a causal mask (see the module docstring)."""
    huge = _fill_tainted(gm)
    found = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and _op_name(node) == "topk":
            proof = _prove(node, facts, huge, same_size, padded)
            if proof is not None:
                found.append(proof)
    return found


def _only_users(node: torch.fx.Node, ok: Callable[[torch.fx.Node], bool]) -> list[torch.fx.Node] | None:
    users = list(node.users)
    return users if users and all(ok(u) for u in users) else None


def _prove(topk: torch.fx.Node, facts, huge, same_size, padded) -> TopkMask | None:
    s = _arg(topk, 0, "input")
    ts = example_of(s)
    if not isinstance(s, torch.fx.Node) or not isinstance(ts, torch.Tensor) or ts.dim() < 2:
        return None
    dim = _static_int(_arg(topk, 2, "dim", -1))
    if dim is None or _norm_dim(dim, ts.dim()) != ts.dim() - 1 or ts.dim() - 1 not in padded(ts):
        return None
    if _arg(topk, 3, "largest", True) is not True:
        return None
    k = example_of(_arg(topk, 1, "k", None))
    if not isinstance(k, (int, torch.SymInt)) or isinstance(k, bool):
        return None
    found = _masked_scores_mask(s, ts, facts, huge, same_size)
    if found is None:
        return None
    m1, additive = found
    nodes = {topk}
    carried: list[tuple[torch.fx.Node, Any]] = []
    # the indices, through dtype conversions, into scatters
    idx = _only_users(
        topk, lambda u: u.op == "call_function" and _op_name(u) == "getitem" and len(u.args) == 2 and u.args[1] == 1
    )
    if idx is None:
        return None
    scatters: list[torch.fx.Node] = []
    todo = list(idx)
    while todo:
        n = todo.pop()
        nodes.add(n)
        for u in n.users:
            name = _op_name(u) if u.op in ("call_function", "call_method") else None
            if name in _KEEPS and u.args and u.args[0] is n and len(u.args) <= 2:
                todo.append(u)
            elif name == "scatter" and _arg(u, 2, "index", None) is n:
                scatters.append(u)
            elif (
                name in _METADATA_FACTORIES
                and u.args
                and u.args[0] is n
                and n not in u.args[1:]
                and n not in u.kwargs.values()
            ):
                continue  # idx.new_ones(...): reads the dtype and device only
            else:
                return None
    if not scatters:
        return None
    for sc in scatters:
        chain = _scatter_picked_mask(sc, ts, m1, same_size, additive, facts)
        if chain is None:
            return None
        nodes |= chain[0]
        carried += chain[1]
    return TopkMask(topk, size_expr(k), frozenset(nodes), tuple(carried))


def _masked_scores_mask(
    s: torch.fx.Node, ts: torch.Tensor, facts, huge, same_size
) -> tuple[torch.fx.Node, bool] | None:
    """``S = masked_fill(X, ~M1, v <= -1e30)`` with ``M1`` false at every key after the query (or at every padding
    key) along ``S``'s last two dims: ``(M1, False)``; ``S = X + M1f`` with ``M1f`` an additive mask of 0 and fill values
    (:func:`_additive_mask`): ``(M1f, True)``; else None."""
    if _op_name(s) == "add" and len(s.args) == 2 and not s.kwargs:
        for x, m in (s.args, s.args[::-1]):
            tx = example_of(x)
            if (
                isinstance(x, torch.fx.Node)
                and x not in huge
                and isinstance(tx, torch.Tensor)
                and tx.dtype.is_floating_point
                and isinstance(m, torch.fx.Node)
                and _additive_mask(m, ts, facts, same_size)
            ):
                return m, True
        return None
    if _op_name(s) != "masked_fill" or len(s.args) != 3 or s.kwargs:
        return None
    x, notm, fill = s.args
    if not (isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= -_HUGE):
        return None
    if (
        not isinstance(x, torch.fx.Node)
        or x in huge
        or not isinstance(notm, torch.fx.Node)
        or _op_name(notm) not in _NOTS
        or len(notm.args) != 1
        or not isinstance(notm.args[0], torch.fx.Node)
    ):
        return None
    m1 = notm.args[0]
    t = example_of(m1)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool or t.dim() < 2 or t.dim() > ts.dim():
        return None
    if not (same_size(t.shape[-1], ts.shape[-1]) and same_size(t.shape[-2], ts.shape[-2])):
        return None  # the mask must not be broadcast along the query or key dim
    fact = facts.get(m1)
    causal = isinstance(fact, Causal) and fact.shift is None and (fact.q, fact.k) == (t.dim() - 2, t.dim() - 1)
    keys = isinstance(fact, (KeysOnly, ZeroPad)) and fact.dim == t.dim() - 1
    return (m1, False) if causal or keys else None


def _additive_mask(m: torch.fx.Node, ts: torch.Tensor, facts, same_size) -> bool:
    """``m`` is a size-1-view of ``where(cond, 0, v <= -1e30)`` (every entry exactly 0 or a fill value: after adding
    finite scores the unmasked entries are strictly above the masked ones) with a fact that puts a fill value at every
    key after the query (:class:`NegMask`) or at every padding key (:class:`NegKeys`), on ``S``'s last two dims."""
    t = example_of(m)
    if not isinstance(t, torch.Tensor) or t.dtype not in _NEG_MASK_DTYPES or t.dim() < 2 or t.dim() > ts.dim():
        return False
    if not (same_size(t.shape[-1], ts.shape[-1]) and same_size(t.shape[-2], ts.shape[-2])):
        return False
    root, _ = _root(m)
    if _op_name(root) != "where" or len(root.args) != 3 or not _is_zero(root.args[1]):
        return False
    fill = root.args[2]
    if not (
        (isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= -_HUGE)
        or (isinstance(fill, torch.fx.Node) and _is_negative_constant(fill))
    ):
        return False
    fact = facts.get(m)
    return (isinstance(fact, NegMask) and fact.tail == 0 and (fact.q, fact.k) == (t.dim() - 2, t.dim() - 1)) or (
        isinstance(fact, NegKeys) and fact.k == t.dim() - 1
    )


def _scatter_picked_mask(
    sc: torch.fx.Node, ts: torch.Tensor, m1: torch.fx.Node, same_size, additive: bool, facts
) -> tuple[set[torch.fx.Node], list[tuple[torch.fx.Node, Any]]] | None:
    """``scatter(ones_bool, -1, idx, False)`` of ``S``'s sizes, used only through size-1 views, a NOT and an AND with
    a mask holding ``M1``'s elements (boolean masks), or, for an additive mask, as the condition of
    ``M2f.masked_fill(not_kept, v <= -1e30)`` with ``M2f`` holding ``M1f``'s elements: the nodes from the scatter to
    the NOT, and the masked_fill nodes with the fact they carry (``M2f``'s); else None."""
    base = sc.args[0] if sc.args else None
    tb = example_of(base)
    dim = _static_int(_arg(sc, 1, "dim", None))
    value = _arg(sc, 3, "value", _arg(sc, 3, "src", None))
    if not (
        isinstance(base, torch.fx.Node)
        and isinstance(tb, torch.Tensor)
        and tb.dtype == torch.bool
        and _op_name(base) in _ALL_TRUE_FACTORIES
        and len(base.users) == 1
        and dim is not None
        and _norm_dim(dim, tb.dim()) == tb.dim() - 1
        and value is False
        and "reduce" not in sc.kwargs
        and len(sc.args) <= 4
        and tb.dim() == ts.dim()
        and all(same_size(a, b) for a, b in zip(tb.shape, ts.shape))
    ):
        return None
    nodes = {sc}
    cur = sc
    while True:  # size-1 views, then the NOT
        users = list(cur.users)
        if additive:
            return _fill_consumers(cur, sc, ts, m1, facts, nodes)
        if len(users) != 1:
            return None
        u = users[0]
        name = _op_name(u) if u.op in ("call_function", "call_method") else None
        if name in _NOTS and len(u.args) == 1:
            nodes.add(u)
            notp = u
            break
        if _dim_map(u) is None:
            return None
        nodes.add(u)
        cur = u
    if not _anded_with_m1(notp, sc, ts, m1):
        return None
    return nodes, []


def _anded_with_m1(notp: torch.fx.Node, sc: torch.fx.Node, ts: torch.Tensor, m1: torch.fx.Node) -> bool:
    """The NOT of the picked mask is used only in boolean ANDs, each with a mask holding ``M1``'s elements."""
    ands = _only_users(
        notp,
        lambda a: (
            a.op in ("call_function", "call_method")
            and _op_name(a) in _ANDS
            and len(a.args) == 2
            and not a.kwargs
            and example_of(a).dtype == torch.bool
        ),
    )
    if ands is None:
        return False
    for a in ands:
        other = a.args[1] if a.args[0] is notp else a.args[0]
        if (
            other is notp
            or not isinstance(other, torch.fx.Node)
            or not _same_elements(a, notp.args[0], other, sc, ts, m1)
        ):
            return False
    return True


def _fill_consumers(
    cur: torch.fx.Node, sc: torch.fx.Node, ts: torch.Tensor, m1f: torch.fx.Node, facts, nodes: set[torch.fx.Node]
) -> tuple[set[torch.fx.Node], list[tuple[torch.fx.Node, Any]]] | None:
    """From the scatter ``cur`` on: size-1 views, then only ``M2f.masked_fill(view, v <= -1e30)`` with ``M2f`` holding
    ``M1f``'s elements (and of its shape)."""
    while True:
        users = list(cur.users)
        if len(users) == 1 and _dim_map(users[0]) is not None:
            cur = users[0]
            nodes.add(cur)
            continue
        break
    carried = []
    for u in users:
        if not (
            u.op in ("call_function", "call_method")
            and _op_name(u) == "masked_fill"
            and len(u.args) == 3
            and not u.kwargs
            and u.args[1] is cur
            and isinstance(u.args[0], torch.fx.Node)
        ):
            return None
        m2f, fill = u.args[0], u.args[2]
        if not (isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= -_HUGE):
            return None
        tu, tm2 = example_of(u), example_of(m2f)
        if not (
            isinstance(tm2, torch.Tensor)
            and tu.dim() == tm2.dim()
            and all(size_expr(a) == size_expr(b) for a, b in zip(tu.shape, tm2.shape))
        ):
            return None
        if not _same_elements(u, cur, m2f, sc, ts, m1f):
            return None
        fact = facts.get(m2f)
        if fact is not None:
            carried.append((u, fact))
    return (nodes, carried) if users else None


def _dim_map(node: torch.fx.Node) -> tuple[torch.fx.Node, list[int | None]] | None:
    """``node`` as a view of its input that keeps dims in order: (input, per output dim the input dim or None for
    an inserted size-1 dim). Only ``unsqueeze`` and subscripts of None, full slices, Ellipsis and ints on size-1 dims."""
    name = _op_name(node) if node.op in ("call_function", "call_method") else None
    src = node.args[0] if node.args else None
    t, out = example_of(src), example_of(node)
    if not isinstance(src, torch.fx.Node) or not isinstance(t, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if name == "unsqueeze":
        at = _static_int(_arg(node, 1, "dim", None))
        if at is None:
            return None
        at %= out.dim()
        return src, [None if d == at else d - (d > at) for d in range(out.dim())]
    if name != "getitem" or len(node.args) != 2:
        return None
    idx = node.args[1]
    items = list(idx) if isinstance(idx, tuple) else [idx]
    used = sum(0 if i is None or i is Ellipsis else 1 for i in items)
    if sum(1 for i in items if i is Ellipsis) > 1 or used > t.dim():
        return None
    res: list[int | None] = []
    d = 0
    for item in items:
        if item is None:
            res.append(None)
        elif item is Ellipsis:
            for _ in range(t.dim() - used):
                res.append(d)
                d += 1
        elif isinstance(item, slice) and item == slice(None):
            res.append(d)
            d += 1
        elif isinstance(item, int) and not isinstance(item, bool) and _static_int(t.shape[d]) == 1 and item in (0, -1):
            d += 1  # the only index of a size-1 dim
        else:
            return None
    res += list(range(d, t.dim()))
    return (src, res) if len(res) == out.dim() else None


def _root(node: torch.fx.Node) -> tuple[torch.fx.Node, list[int | None]]:
    """The node ``node`` is a size-1-view chain of, and per dim of ``node`` that node's dim (None: size 1)."""
    t = example_of(node)
    dims: list[int | None] = list(range(t.dim()))
    while True:
        step = _dim_map(node)
        if step is None:
            break
        node, inner = step
        dims = [None if d is None else inner[d] for d in dims]
    return node, _drop_ones(node, dims)


def _drop_ones(node: torch.fx.Node, dims: list[int | None]) -> list[int | None]:
    t = example_of(node)
    return [None if d is None or _is_one(t.shape[d]) else d for d in dims]


def _is_one(size: Any) -> bool:
    return _static_int(size) == 1


def _same_elements(
    a: torch.fx.Node, picked: torch.fx.Node, m2: torch.fx.Node, sc: torch.fx.Node, ts: torch.Tensor, m1: torch.fx.Node
) -> bool:
    """At every element of the AND ``a``, the kept-key operand (``~picked``, a size-1-view chain of the scatter,
    whose elements are ``S``'s, masked by ``M1`` broadcast from the right) and ``M2`` read the same element of one
    node: so ``M2`` true implies that the key was unmasked in ``M1``."""
    out = example_of(a)
    r1, m1dims = _root(m1)
    r2, m2dims = _root(m2)
    if r1 is not r2:
        return False
    # ~picked -> the scatter's dims (== S's dims) -> M1's dims (right-aligned) -> the root's
    sc_node, pdims = _root(picked)
    if sc_node is not sc:
        return False
    tm1 = example_of(m1)
    shift = ts.dim() - tm1.dim()
    via_p = [None if d is None or d - shift < 0 else m1dims[d - shift] for d in pdims]
    # align both operands with the AND's output (from the right)
    lhs = [None] * (out.dim() - len(via_p)) + via_p
    rhs = [None] * (out.dim() - len(m2dims)) + m2dims
    if len(lhs) != out.dim() or len(rhs) != out.dim():
        return False
    return lhs == rhs


def topk_invalid_buckets(plan: Any, syms: set, buckets: tuple[int, ...], proofs: list[TopkMask]) -> None:
    """Mark ``plan.invalid_buckets`` where a proven top-k keeps fewer than the bucket's length of keys (``k(b) < b``,
    or not decided): there a real row may have more unmasked keys than ``k``, and which of them ``topk`` keeps on a
    tie is not the same with padding. Every bucket marked: the plan is refused, naming the ``topk``."""
    names = {str(s) for s in syms}
    for proof in proofs:
        where = _source(proof.topk)
        what = f"{_label(proof.topk)} at node {proof.topk.name}{f' ({where})' if where else ''}"
        for prev, b in zip((0, *sorted(buckets)), sorted(buckets)):
            if b in plan.invalid_buckets:
                continue
            k = _k_at(proof.k, b, names)
            # the padded run (k at b) and the unpadded one (k at L) must both keep every unmasked key of each real row:
            # k(b) >= b, and k(L) >= L for every length L landing in this bucket (prev < L <= b)
            ok = (
                k is not None
                and k >= b
                and b - prev <= _MAX_CHECKED
                and all((kl := _k_at(proof.k, n, names)) is not None and kl >= n for n in range(prev + 1, b))
            )
            if not ok:
                plan.invalid_buckets[b] = NotProven(
                    f"{what} keeps k = {proof.k} keys per query row, {k} at bucket {b}: a real row with more "
                    "unmasked keys than k picks among them, and a tie at the k-th score is broken differently with padding"
                )
        if len(plan.invalid_buckets) == len(buckets):
            k0 = proof.k.xreplace({s: sympy.Integer(buckets[0]) for s in proof.k.free_symbols if str(s) in names})
            plan.refused.append(
                f"{what}: top-k of the masked index scores keeps k = {proof.k} keys per query row ({k0} at bucket "
                f"{buckets[0]}), fewer than the bucket's length at every bucket: a real row with more unmasked keys than "
                "k picks among them, and a tie at the k-th score is broken differently with padding (proven only for "
                "buckets <= k)"
            )
            return


#: The most lengths one bucket's check evaluates ``k`` at; a wider bucket is not proven.
_MAX_CHECKED = 1 << 16


def _k_at(k: sympy.Expr, n: int, names: set[str]) -> int | None:
    """``k`` with every padded size set to ``n``, or None when it still depends on another size."""
    v = k.xreplace({s: sympy.Integer(n) for s in k.free_symbols if str(s) in names})
    return int(v) if not v.free_symbols and v.is_integer else None
