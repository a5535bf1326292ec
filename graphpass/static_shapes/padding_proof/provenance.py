"""The fact rules of the padding proof: what each node's values are known to hold whatever the padding
(:mod:`.facts`), computed in one forward sweep over the graph (:func:`index_provenance`).

Each rule is registered by op name in :data:`.registry.FACT_RULES` with :func:`.registry.fact_rule` (at the end of
this module, in the order they are tried: the order of the ``_fact_of`` chain this table replaced). Positions come
from ``arange`` and what views, ``+ c`` and indexing by positions keep; causal masks from comparing positions
along two dims and ANDing; the additive-mask facts from ``where(causal, score, fill)``, ``score + mask`` and the
softmax of one; constants from factories, compares and selects of constants.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from ...fx_utils import example_of, size_expr, size_range
from ...tensor_utils import shape_env_of
from ..buffer_masks import is_causal_table
from .facts import (
    AllTrue,
    Causal,
    Const,
    Diag,
    KeysOnly,
    MaskedAbove,
    NegKeys,
    NegMask,
    OnePad,
    PadCount,
    Positions,
    ZeroAbove,
    ZeroKeys,
    ZeroPad,
    ZeroPadIf,
    aligned as _aligned,
    fact_dims,
    moved as _moved,
)
from .mask_facts import _huge_nodes, _is_zero, _legacy_key_mask_fact, _mask_fact
from .nodes import _arg, _is_int_tensor, _leaves, _norm_dim, _op_name, _static_int
from .registry import FACT_RULES, FactEnv, fact_rule
from .tables import (
    _ALL_TRUE_FACTORIES,
    _ANDS,
    _COMPARES,
    _CONST_COMPARES,
    _CONST_FACTORIES,
    _CONST_FILLS,
    _CONST_KEEPS,
    _KEEPS,
    _NEG_MASK_DTYPES,
    _NOTS,
    _SOFTMAXES,
    RESHAPES,
)

__all__ = ["index_provenance"]


def _arange_fact(node: torch.fx.Node, out: torch.Tensor) -> Any:
    """``arange(n)`` / ``arange(c, c + n)`` with a static integer start and step 1."""
    if out.dim() != 1 or not _is_int_tensor(out):
        return None
    args = [a for a in node.args]
    start = node.kwargs.get("start", args[0] if len(args) >= 2 else 0)
    step = node.kwargs.get("step", args[2] if len(args) >= 3 else 1)
    start, step = _static_int(start), _static_int(step)
    return Positions(0, start) if start is not None and step == 1 else None


def _starts_at_row_0(start: Any) -> bool:
    """A slice start that is 0 at every size: none, a literal 0, or a SymInt whose expression is the constant 0
    (GPT-Neo's ``key_length - query_length`` with no cache: Dynamo's ``s - s``)."""
    if start is None or _static_int(start) == 0:
        return True
    v = example_of(start)
    return isinstance(v, torch.SymInt) and size_expr(v) == 0


def _view_map(items: list[Any], ndim: int) -> Callable[[int], int | None] | None:
    """For a subscript of None / int / full-prefix slices / Ellipsis: source dim -> result dim."""
    used = sum(0 if i is None or i is Ellipsis else 1 for i in items)
    mapping: dict[int, int | None] = {}
    d = o = 0
    for item in items:
        if item is None:
            o += 1
        elif item is Ellipsis:
            for _ in range(ndim - used):
                mapping[d], d, o = o, d + 1, o + 1
        elif isinstance(item, slice) and _starts_at_row_0(item.start) and item.step in (None, 1):
            mapping[d], d, o = o, d + 1, o + 1  # a prefix keeps every position it keeps
        elif _static_int(item) is not None:
            mapping[d], d = None, d + 1
        else:
            return None
    for rest in range(d, ndim):
        mapping[rest], o = o, o + 1
    return mapping.get


def _gather_fact(
    src: torch.fx.Node,
    items: list[Any],
    facts: Mapping[torch.fx.Node, Any],
    out: torch.Tensor,
    ties: Mapping[Any, Any] = MappingProxyType({}),
) -> Any:
    """``src[i0, i1, ...]`` with integer tensor indices on its leading dims (advanced indexing)."""
    fact = facts.get(src)
    lead = 0
    while lead < len(items) and _is_int_tensor(example_of(items[lead])):
        lead += 1
    if (
        not isinstance(fact, (Positions, ZeroPad))
        or lead == 0
        or any(i not in (Ellipsis,) and not (isinstance(i, slice) and i == slice(None)) for i in items[lead:])
    ):
        return None
    nb = out.dim() - (example_of(src).dim() - lead)  # the broadcast index dims come first
    if fact.dim >= lead:
        return _moved(fact, lambda d: nb + d - lead)
    index = items[fact.dim]
    inner = facts.get(index) if isinstance(index, torch.fx.Node) else None
    if not isinstance(inner, Positions):
        return None
    at = inner.dim + nb - example_of(index).dim()
    if isinstance(fact, ZeroPad):  # rows 0 .. n - 1 read in place: the padding rows stay the zero rows
        same = (
            inner.offset == 0
            and inner.base is None
            and size_expr(example_of(index).shape[inner.dim]).xreplace(ties)
            == size_expr(example_of(src).shape[fact.dim]).xreplace(ties)
        )
        return ZeroPad(at, fact.source) if same else None
    if fact.base is not None and inner.base is not None:
        return None  # two run-time offsets: not one named base
    return Positions(at, fact.offset + inner.offset, fact.base or inner.base)


def _getitem_fact(
    node: torch.fx.Node,
    facts: Mapping[torch.fx.Node, Any],
    out: torch.Tensor,
    ties: Mapping[Any, Any] = MappingProxyType({}),
) -> Any:
    src = node.args[0]
    idx = node.args[1] if len(node.args) > 1 else None
    items = list(idx) if isinstance(idx, tuple) else [idx]
    t = example_of(src)
    if not isinstance(t, torch.Tensor) or not isinstance(src, torch.fx.Node):
        return None
    if any(isinstance(example_of(i), torch.Tensor) for i in items):
        return _gather_fact(src, items, facts, out, ties)
    where = _view_map(items, t.dim())
    fact = facts.get(src)
    if getattr(fact, "tail", 0) > 0:
        return _drop_tail(fact, items, t.dim(), where)
    return _moved(fact, where) if where is not None else None


def _drop_tail(fact: Any, items: list[Any], ndim: int, where: Callable[[int], int | None] | None) -> Any:
    """A subscript of a tensor with sink columns after its keys: ``[..., :-tail]`` drops them (tail 0), a full
    slice keeps them; any other subscript of the key dim loses the fact."""
    if where is None or sum(1 for i in items if i is Ellipsis) > 1:
        return None
    used = sum(0 if i is None or i is Ellipsis else 1 for i in items)
    d, item = 0, slice(None)
    for i in items:  # the item that subscripts dim fact.k
        if i is Ellipsis:
            d += ndim - used
        elif i is not None:
            if d == fact.k:
                item = i
                break
            d += 1
    moved = _moved(fact, where)
    if moved is None or not isinstance(item, slice) or item.step not in (None, 1) or _static_int(item.start or 0) != 0:
        return None
    if item.stop is None:
        return moved
    return replace(moved, tail=0) if _static_int(item.stop) == -fact.tail else None


def _compare_fact(node: torch.fx.Node, name: str, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """``k <= q`` (or ``k < q + 1``) on positions along two different dims."""
    flip, strict = _COMPARES[name]
    a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    if flip:
        a, b = b, a
    fa = _aligned(facts.get(a), a, out) if isinstance(a, torch.fx.Node) else None
    fb = _aligned(facts.get(b), b, out) if isinstance(b, torch.fx.Node) else None
    if isinstance(fb, Positions) and fb.base is None and _static_int(a) is not None:  # c <= i + offset, i >= 0
        return AllTrue() if _static_int(a) <= fb.offset - (1 if strict else 0) else None
    if not (isinstance(fa, Positions) and isinstance(fb, Positions)) or fa.dim == fb.dim:
        return None
    # true => j + fa.offset <= i + fb.offset (- 1 when strict) => j <= i when the slack is <= 0
    slack = fb.offset - fa.offset - (1 if strict else 0)
    if fa.base == fb.base:  # the same run-time offset on both sides cancels
        # on the diagonal (j == i) it is true exactly when the slack is >= 0
        if slack <= 0:
            return Causal(q=fb.dim, k=fa.dim, diag=frozenset() if slack == 0 else None)
        return Diag(fa.dim, fb.dim)
    # key slots from 0 against query positions that start at a run-time offset X: j <= i + X (the diagonal is
    # not proven: X's sign is not known here)
    return Causal(q=fb.dim, k=fa.dim, shift=fb.base) if fa.base is None and slack <= 0 else None


def _diag_needs(fact: Any, pair: frozenset[int]) -> frozenset[str] | None:
    """The inputs that must hold 1 for ``fact``'s tensor to be true on the diagonal of the dims ``pair``,
    or None when that is not proven."""
    if isinstance(fact, AllTrue):
        return frozenset()
    if isinstance(fact, Causal) and fact.diag is not None and {fact.q, fact.k} == pair:
        return fact.diag
    if isinstance(fact, Diag) and {fact.a, fact.b} == pair:
        return fact.needs
    if isinstance(fact, ZeroPad) and fact.source is not None and fact.dim in pair:
        return frozenset({fact.source})  # holds the input's value at (.., i): true there when it is 1
    return None


def _keys_only(found: list[Any], dim: int) -> Any:
    """The AND of all-true tensors and zero-padded inputs read in place along ``dim`` (transformers' bidirectional
    mask): false at every padding key, true at every real one when those inputs hold 1."""
    needs: set[str] = set()
    for f in found:
        if isinstance(f, (ZeroPad, KeysOnly)) and f.dim == dim and getattr(f, "source", "") is not None:
            needs |= {f.source} if isinstance(f, ZeroPad) else f.needs
        elif not isinstance(f, AllTrue):
            return None
    return KeysOnly(dim, frozenset(needs))


def _and_fact(node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """An AND only removes true entries: causal when any operand is (zero at the padding when any operand
    is); true on the diagonal when every operand is."""
    if out.dtype != torch.bool:
        return None
    operands = list(_leaves(node.args))
    found = [
        _aligned(facts.get(a), a, out) if isinstance(a, torch.fx.Node) else (AllTrue() if a is True else None)
        for a in operands
    ]
    causal = min((f for f in found if isinstance(f, Causal)), key=lambda f: f.shift is not None, default=None)
    pairs = {
        frozenset({f.q, f.k}) if isinstance(f, Causal) else frozenset({f.a, f.b})
        for f in found
        if isinstance(f, (Causal, Diag))
    }
    diag: frozenset[str] | None = None
    if len(pairs) == 1:
        needs = [_diag_needs(f, next(iter(pairs))) for f in found]
        diag = frozenset().union(*needs) if all(n is not None for n in needs) else None
    if causal is not None:
        return replace(causal, diag=diag)  # an unshifted operand's, when any: the tighter bound
    zero = next((f for f in found if isinstance(f, (ZeroPad, KeysOnly))), None)
    if zero is not None:
        return _keys_only(found, zero.dim) or ZeroPad(zero.dim)
    if diag is not None:
        a, b = sorted(next(iter(pairs)))
        return Diag(a, b, diag)
    return AllTrue() if found and all(isinstance(f, AllTrue) for f in found) else None


def _reshape_fact(src: Any, fact: Any, out: torch.Tensor) -> Any:
    """A reshape that only adds or drops dims of size 1 keeps the other dims in order; one that keeps the
    trailing dims from the fact's first dim on (merging or splitting only dims before them) keeps those."""
    t = example_of(src)
    if fact is None or not isinstance(t, torch.Tensor):
        return None
    kept_in = [d for d, s in enumerate(t.shape) if not (isinstance(s, int) and s == 1)]
    kept_out = [d for d, s in enumerate(out.shape) if not (isinstance(s, int) and s == 1)]
    if [size_expr(t.shape[d]) for d in kept_in] == [size_expr(out.shape[d]) for d in kept_out]:
        return _moved(fact, dict(zip(kept_in, kept_out)).get)
    dims = [getattr(fact, f) for f in fact_dims(fact) or ()]
    if not dims:
        return None
    tail = t.dim() - min(dims)  # the trailing dims the fact is about
    if tail > out.dim() or [size_expr(s) for s in t.shape[t.dim() - tail :]] != [
        size_expr(s) for s in out.shape[out.dim() - tail :]
    ]:
        return None
    return _moved(fact, lambda d: d + out.dim() - t.dim())


def _keeps(fact: Any, out: torch.Tensor) -> bool:
    """Whether a dtype conversion to ``out``'s dtype keeps ``fact``."""
    if isinstance(fact, Positions):
        return _is_int_tensor(out)
    if isinstance(fact, (Causal, Diag, AllTrue, MaskedAbove, KeysOnly)):
        return out.dtype == torch.bool
    if isinstance(fact, (NegMask, NegKeys)):
        return out.dtype in _NEG_MASK_DTYPES
    if isinstance(fact, (ZeroAbove, ZeroKeys)):
        return out.dtype.is_floating_point
    if isinstance(fact, OnePad):
        return out.dtype != torch.bool and not out.dtype.is_complex
    if isinstance(fact, PadCount):  # a count up to the length: integer types whose range _values_fit checks
        return out.dtype in _INT_DTYPES
    return True


def _count_fact(node: torch.fx.Node, name: str, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """``cumsum`` of a zero-padded input read in place along its padded dim (a :class:`PadCount`), and that count
    compared equal to 0 (a :class:`ZeroPadIf`): llama4's chunked mask counts left-padding tokens as
    ``(attention_mask.cumsum(-1) == 0).sum(-1)``."""
    src = node.args[0] if node.args else None
    fact = facts.get(src) if isinstance(src, torch.fx.Node) else None
    if name == "cumsum" and isinstance(fact, ZeroPad) and fact.source is not None and _is_int_tensor(out):
        d = _static_int(_arg(node, 1, "dim", None))
        if d is not None and _norm_dim(d, out.dim()) == fact.dim:
            return PadCount(fact.dim, frozenset({fact.source}))  # padding row: the sum of the real rows, L >= 1
        return None
    if name == "eq" and out.dtype == torch.bool and len(node.args) == 2:
        for a, b in (node.args, node.args[::-1]):
            f = _aligned(facts.get(a), a, out) if isinstance(a, torch.fx.Node) else None
            if isinstance(f, PadCount) and _is_zero(b):
                return ZeroPadIf(f.dim, f.needs)
    return None


def _fact_of(
    node: torch.fx.Node,
    facts: Mapping[torch.fx.Node, Any],
    huge: set[torch.fx.Node] = frozenset(),
    ties: Mapping[Any, Any] = MappingProxyType({}),
    upper: Mapping[str, int] | None = None,
) -> Any:
    """The fact of ``node``: its name's fact rules (:data:`.registry.FACT_RULES`) tried in order, the first fact
    found; None when none is (or when a ``final`` rule applies and finds none). An integer fact (positions, a pad
    count) is kept only where every value it stands for fits the node's dtype at every size (:func:`_values_fit`):
    a fact derived in a wider type, or in this one before it wrapped, says nothing about a value that wrapped
    (``arange(L).to(torch.int8)`` past 127)."""
    out = example_of(node)
    name = _op_name(node) if node.op in ("call_function", "call_method") else None
    if name is None or not isinstance(out, torch.Tensor):
        return None
    env = FactEnv(facts, huge, ties)
    for rule in FACT_RULES.get(name, ()):
        found = rule.rule(node, name, out, env)
        if found is not None or rule.final:
            if isinstance(found, (Positions, PadCount)) and not _values_fit(found, out, upper):
                return None
            return found
    return None


#: The integer dtypes whose every value a 64-bit index holds exactly (a position or count that fits survives).
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64)


def _values_fit(fact: Any, out: Any, upper: Mapping[str, int] | None) -> bool:
    """Whether every value ``fact`` says ``out`` holds lies in ``out``'s dtype at every size the graph runs at.

    :class:`Positions` holds ``i + offset`` at index ``i < n`` (``n`` the size of its dim) plus a run-time ``base``;
    :class:`PadCount` holds counts ``0 .. n``. The ends come from torch's value-range analysis
    (:func:`~graphpass.fx_utils.size_range`) over the symbols' ranges, capped by ``upper`` (symbol name -> the largest
    bucket, the largest size a padded call runs at). A run-time base has no known range: only ``int64`` keeps it."""
    if not isinstance(out, torch.Tensor) or out.dtype not in _INT_DTYPES:
        return False
    if out.dtype == torch.int64:
        return True  # no size reaches 2**63
    if getattr(fact, "base", None) is not None:
        return False
    n = size_expr(out.shape[fact.dim])
    if isinstance(fact, Positions):
        lo, hi = size_range(n - 1 + fact.offset, shape_env_of(out), upper)
        lo = min(lo, fact.offset)
    else:
        lo, hi = 0, size_range(n, shape_env_of(out), upper)[1]
    info = torch.iinfo(out.dtype)
    try:
        return bool(lo >= info.min) and bool(hi <= info.max)
    except TypeError:  # an end sympy cannot order (a symbol left over)
        return False


def _source_fact(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    """What an op keeps of its first input's fact: positions plus a constant or a run-time offset, the negation of
    a causal mask, the nonzero entries of a pure additive mask, dtype conversions, broadcasts and reshapes."""
    facts = env.facts
    src = node.args[0] if node.args else None
    fact = facts.get(src) if isinstance(src, torch.fx.Node) else None
    if fact is None:
        return None
    if name in ("add", "sub") and isinstance(fact, Positions) and _is_int_tensor(out):
        c = _static_int(node.args[1]) if len(node.args) > 1 else None
        if c is None and name == "add" and fact.base is None and len(node.args) > 1:
            base = _scalar_tensor_root(node.args[1])  # + a 0-d integer tensor (a cache's length)
            return None if base is None else _aligned(Positions(fact.dim, fact.offset, base), src, out)
        return (
            None
            if c is None
            else _aligned(Positions(fact.dim, fact.offset + (c if name == "add" else -c), fact.base), src, out)
        )
    if isinstance(fact, Causal) and fact.diag is not None and name in _NOTS:
        return MaskedAbove(fact.q, fact.k, fact.diag)
    if (
        isinstance(fact, NegMask)
        and fact.pure
        and out.dtype == torch.bool
        and name in ("ne", "not_equal")
        and len(node.args) == 2
        and _is_zero(node.args[1])
    ):
        return _aligned(MaskedAbove(fact.q, fact.k, fact.needs), src, out)  # mask != 0: what .bool() gives (doge)
    if isinstance(fact, NegMask) and fact.pure and out.dtype == torch.bool and name in _KEEPS:
        return _aligned(MaskedAbove(fact.q, fact.k, fact.needs), src, out)  # nonzero: the fill values
    if name in _KEEPS or (name == "dropout" and isinstance(fact, (ZeroAbove, ZeroKeys))):  # dropout keeps zeros zero
        return _aligned(fact, src, out) if _keeps(fact, out) and example_of(src).dim() == out.dim() else None
    if name in ("expand", "expand_as", "broadcast_to"):
        return _aligned(fact, src, out)
    if name == "unsqueeze":
        at = _static_int(_arg(node, 1, "dim", None))
        return None if at is None else _moved(fact, lambda d: d + (d >= at % out.dim()))
    if name in RESHAPES:
        return _reshape_fact(src, fact, out)
    return None


def _const_value(value: Any, facts: Mapping[torch.fx.Node, Any]) -> tuple[bool, Any]:
    """``(True, v)`` when ``value`` is a static number or a node holding :class:`Const` ``v``."""
    if isinstance(value, torch.fx.Node):
        fact = facts.get(value)
        if isinstance(fact, AllTrue):
            return True, True
        return (True, fact.value) if isinstance(fact, Const) else (False, None)
    if isinstance(value, (bool, int, float)):
        return True, value
    return False, None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` as an element of ``dtype`` (None when it has no such value: an infinity or NaN as an integer)."""
    if not dtype.is_floating_point and dtype != torch.bool and (value != value or abs(value) == float("inf")):
        return None
    try:
        return torch.tensor(value).to(dtype).item()  # rounded (float16 0.1) or wrapped (int8 300) as torch does
    except (RuntimeError, OverflowError, TypeError, ValueError):
        return None


def _const_of(value: Any, dtype: torch.dtype) -> Any:
    v = _cast(value, dtype)
    return None if v is None else Const(v)


def _const_fact(node: torch.fx.Node, name: str, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """:class:`Const` facts: constant factories, what keeps a constant's elements, compares and ``where`` of
    constants, ``x & False``; ``x | False`` is ``x`` (any fact of ``x``, broadcast). Complex dtypes are left alone."""
    if out.dtype.is_complex:
        return None
    args = node.args
    if name in _CONST_FACTORIES:
        value = _cast(_CONST_FACTORIES[name], out.dtype)
        return None if value is True else Const(value)  # an all-true one is an AllTrue (and_masks' start)
    if name in _CONST_FILLS:
        ok, v = _const_value(_arg(node, _CONST_FILLS[name], "fill_value", None), facts)
        return _const_of(v, out.dtype) if ok else None
    if not args or not isinstance(args[0], torch.fx.Node):
        return None
    src = facts.get(args[0])
    if name in _CONST_KEEPS and isinstance(src, Const):
        return _const_of(src.value, out.dtype)
    if name in _CONST_COMPARES and len(args) == 2:
        (ok_a, a), (ok_b, b) = _const_value(args[0], facts), _const_value(args[1], facts)
        exact = not isinstance(a, float) and not isinstance(b, float)  # a float compare depends on type promotion
        return Const(_CONST_COMPARES[name](a, b)) if ok_a and ok_b and exact else None
    if name == "where" and len(args) == 3 and isinstance(src, Const):
        ok, v = _const_value(args[1] if src.value else args[2], facts)
        return _const_of(v, out.dtype) if ok else None
    if out.dtype == torch.bool and name in ("and_", "logical_and", "bitwise_and"):
        consts = [_const_value(a, facts) for a in _leaves(args)]
        return Const(False) if any(ok and not v for ok, v in consts) else None
    if out.dtype == torch.bool and name in ("or_", "logical_or", "bitwise_or") and len(args) == 2:
        for x, other in (args, args[::-1]):
            ok, v = _const_value(other, facts)
            if (
                ok
                and not v
                and isinstance(x, torch.fx.Node)
                and isinstance(example_of(x), torch.Tensor)
                and example_of(x).dtype == torch.bool
            ):
                fact = _aligned(facts.get(x), x, out)
                return fact if fact is not None else None
    return None


def _scalar_tensor_root(value: Any) -> str | None:
    """The node a 0-d integer tensor is a copy of (through dtype / device conversions), by name: the
    identity of a run-time offset (two conversions of one length are the same offset)."""
    while isinstance(value, torch.fx.Node):
        t = example_of(value)
        if not (_is_int_tensor(t) and t.dim() == 0):
            return None
        name = _op_name(value) if value.op in ("call_function", "call_method") else None
        if name not in _KEEPS or not value.args:
            return value.name
        value = value.args[0]
    return None


def index_provenance(
    gm: torch.fx.GraphModule,
    zero_padded: Mapping[torch.fx.Node, int] | None = None,
    ties: Mapping[Any, Any] | None = None,
    values: Mapping[str, Any] | None = None,
    proven: Mapping[torch.fx.Node, Any] | None = None,
    upper: Mapping[str, int] | None = None,
) -> dict[torch.fx.Node, Any]:
    """The position and causal-mask facts of ``gm``'s nodes (see the section comment above).
    ``zero_padded``: placeholders the dispatcher pads with 0 -> their padded dim; ``ties``: size symbols padded
    together (symbol -> the one it equals on every call); ``values``: placeholder name -> the real tensor it takes
    (a module buffer), whose values may prove it a causal table (:mod:`.buffer_masks`); ``proven``: facts of nodes
    proven by a whole-pattern rule (a top-k indexer's narrowed additive mask, :mod:`.topk_mask`); ``upper``: symbol
    name -> the largest size a padded call runs at (the largest bucket), which bounds the values of integer facts
    (:func:`_values_fit`)."""
    ties = MappingProxyType(dict(ties or {}))
    facts: dict[torch.fx.Node, Any] = {n: ZeroPad(d, n.name) for n, d in (zero_padded or {}).items()}
    facts.update(_table_facts(gm, values or {}))
    facts.update(proven or {})
    huge = _huge_nodes(gm)
    for node in gm.graph.nodes:
        if node in facts:
            continue
        fact = _fact_of(node, facts, huge, ties, upper)
        if fact is not None:
            facts[node] = fact
    return facts


def _table_facts(gm: torch.fx.GraphModule, values: Mapping[str, Any]) -> dict[torch.fx.Node, Any]:
    """Placeholders whose real tensor (``values``) is a static-shape boolean table proven on its values to be false
    above the diagonal of its last two dims and true on it (GPT-Neo's ``tril`` buffer): a :class:`Causal` on those
    dims, true on the diagonal with no input needed. A prefix slice keeps it (:func:`_view_map`)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in values and is_causal_table(values[node.name]):
            nd = values[node.name].dim()
            out[node] = Causal(q=nd - 2, k=nd - 1, diag=frozenset())
    return out


# --------------------------------------------------------------------------------------------
# The fact rules, by name, in the order they are tried
# --------------------------------------------------------------------------------------------

_CONST_NAMES = (
    frozenset(_CONST_FACTORIES)
    | frozenset(_CONST_FILLS)
    | _CONST_KEEPS
    | frozenset(_CONST_COMPARES)
    | {"where", "and_", "logical_and", "bitwise_and", "or_", "logical_or", "bitwise_or"}
)
_SOURCE_NAMES = (
    frozenset({"add", "sub", "ne", "not_equal", "dropout", "expand", "expand_as", "broadcast_to", "unsqueeze"})
    | _NOTS
    | _KEEPS
    | RESHAPES
)


@fact_rule("arange", final=True)
def _arange_rule(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    return _arange_fact(node, out)


@fact_rule(*_CONST_NAMES)
def _const_rule(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    return _const_fact(node, name, env.facts, out)


@fact_rule("getitem", final=True)
def _getitem_rule(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    return _getitem_fact(node, env.facts, out, env.ties)


@fact_rule("sub", "rsub", "mul")
def _legacy_key_mask_rule(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    return _legacy_key_mask_fact(node, name, env.facts, out)


@fact_rule(*_COMPARES, final=True)
def _compare_rule(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    return _compare_fact(node, name, env.facts, out)


@fact_rule(*_ANDS, final=True)
def _and_rule(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    return _and_fact(node, env.facts, out)


@fact_rule("cumsum", "eq")
def _count_rule(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    return _count_fact(node, name, env.facts, out)


@fact_rule(*_ALL_TRUE_FACTORIES)
def _all_true_rule(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    return AllTrue() if out.dtype == torch.bool else None


def _mask_rule(node: torch.fx.Node, name: str, out: torch.Tensor, env: FactEnv) -> Any:
    return _mask_fact(node, name, env.facts, env.huge, out)


fact_rule("where", "masked_fill", "cat", "maximum", *_SOFTMAXES, final=True, name="mask_rule")(_mask_rule)
fact_rule("add", "sub", "max", name="mask_rule")(_mask_rule)  # not final: positions plus a constant next
fact_rule(*_SOURCE_NAMES, name="source_fact")(_source_fact)
