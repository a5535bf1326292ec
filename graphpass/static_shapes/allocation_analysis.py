"""The allocation audit's analysis (see :mod:`.allocation_audit`): the aten graphs Dynamo and AOTAutograd traced,
read node by node: which nodes allocate, their symbolic sizes and bounds, and each one's verdict (:data:`RULES`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy
import torch

from ..fx_utils import op_name, returns_alias, shape_env_hints, size_expr, source_frame, tensors_of
from ..tensor_utils import shape_env_of
from ..torch_compat import source_name
from .allocation_rows import AllocationRow, AuditReport, DynamicDim

if TYPE_CHECKING:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.node import Target
    from torch.utils._sympy.value_ranges import ValueRanges

# Ops whose output size comes from tensor values (torch 2.13 gives them unbacked symbols u0, ...;
# the list also catches them where a torch version gives a size an unbacked symbol elsewhere).
_DATA_DEPENDENT = {
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "repeat_interleave",
    "argwhere",
    "bincount",
    "histc",
}

_MASK_WHY = "as many elements as the mask selects (boolean-mask index)"
_DATA_DEPENDENT_WHY = {
    "nonzero": "nonzero returns one row per nonzero value",
    "argwhere": "argwhere returns one row per nonzero value",
    "masked_select": "masked_select returns as many elements as the mask selects",
    "repeat_interleave": "repeat_interleave's length is the sum of the repeat values",
    "bincount": "bincount's length is the largest value + 1",
    "histc": "histc's bins come from its arguments",
}
for _u in ("unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"):
    _DATA_DEPENDENT_WHY[_u] = f"{_u} returns one element per distinct value"

# View ops (and in-place / out= ops) allocate nothing: graphpass.fx_utils.returns_alias says which.

# torch 2.13 tags every node of a non-reentrant checkpoint region with ``ac_graph_id`` and a
# ``recompute`` policy (PREFER_RECOMPUTE by default). The partitioner also stamps ``recompute=MUST_SAVE``
# on nodes it saves for backward (the region's inputs among them), so the key alone proves nothing.
_RECOMPUTE_POLICIES = {"PREFER_RECOMPUTE", "MUST_RECOMPUTE"}


# ---------------------------------------------------------------------------------- analysis


def _op_name(target: Target) -> str:
    """``aten.add.Tensor`` for an overload, a callable's name otherwise (its repr when it has none)."""
    name = op_name(target)
    if isinstance(target, torch._ops.OpOverload):
        return str(name)
    return name.name or str(target)


def _packet(target: Target) -> str:
    return op_name(target).name or str(target)


def _source(node: torch.fx.Node) -> tuple[str, str]:
    """``("file.py:LINE", code)`` of the innermost user frame in the node's stack trace (``"-"``: unknown)."""
    frame = source_frame(node)
    return (str(frame), frame.code) if frame is not None else ("-", "")


# Dynamo gives sizes without a user maximum an upper end of sys.maxsize - 1 (not int_oo): any bound
# at that scale means "no bound", and is reported as unbounded rather than as 9.2e18 elements.
_NO_BOUND = 2**62


def _is_int_bound(v: sympy.Basic) -> bool:
    from torch.utils._sympy.numbers import int_oo

    if v in (int_oo, -int_oo, sympy.oo, -sympy.oo) or not getattr(v, "is_number", False):
        return False
    return abs(int(v)) < _NO_BOUND


class _Bounds:
    """Upper bounds and example values of the size expressions of one aten graph: the ranges its
    ShapeEnv knows, narrowed by the user's ranges for the dynamic dims."""

    def __init__(self, env: ShapeEnv, user_rng: dict[sympy.Symbol, ValueRanges]) -> None:
        self.env = env
        self.user_rng = user_rng
        self.hints = dict(shape_env_hints(env))

    def ranges_for(self, expr: sympy.Expr) -> dict[sympy.Symbol, ValueRanges]:
        """The range of every free symbol of ``expr``."""
        from torch.utils._sympy.value_ranges import ValueRanges

        out = {}
        for s in expr.free_symbols:
            vr = self.env.var_to_range.get(s, ValueRanges(0, _int_oo()))
            if s in self.user_rng:
                vr = vr & self.user_rng[s]
            out[s] = vr
        return out

    def bound(self, expr: sympy.Expr) -> int | None:
        """The upper bound of ``expr`` over the ranges (None: unbounded)."""
        from torch.utils._sympy.value_ranges import bound_sympy

        if not expr.free_symbols:
            return int(expr)
        hi = bound_sympy(expr, self.ranges_for(expr)).upper
        return int(hi) if _is_int_bound(hi) else None

    def example(self, expr: sympy.Expr) -> int | None:
        """The value of ``expr`` at the example inputs (None: it depends on tensor values)."""
        v = expr.xreplace(self.hints)
        return int(v) if not v.free_symbols and _is_int_bound(v) else None


@dataclass
class _GraphScan:
    """The state of the walk over the nodes of one aten graph."""

    label: str  # the graph's label, e.g. "0/forward"
    bounds: _Bounds  # the graph's ranges, bounds and example values
    factor: float  # partial_factor: the bound-to-example ratio above which a bounded size is PARTIAL
    born: dict[sympy.Symbol, str] = field(default_factory=dict)  # unbacked symbol -> "op at file.py:LINE" that made it
    allocating: set[str] = field(default_factory=set)  # names of the allocating nodes seen so far
    view_base: dict[str, torch.fx.Node] = field(default_factory=dict)  # view node's name -> the node it views


@dataclass
class _Allocation:
    """What :func:`_verdict` reads about one allocating node."""

    node: torch.fx.Node  # the allocating aten node
    packet: str  # its op's overload packet name, e.g. "cat"
    data_dep: bool  # an op of _DATA_DEPENDENT or a boolean-mask index
    randperm_var: bool  # randperm over a symbolic count
    unbacked: set[sympy.Symbol]  # the unbacked symbols (u0, ...) in the output sizes
    shapes: list[list[sympy.Expr]]  # the symbolic shape of each output tensor
    numels: list[sympy.Expr]  # the element count of each output tensor
    bound_elems: int | None  # upper bound on the elements of all outputs (None: unbounded)
    bound_bytes: int | None  # upper bound on their bytes (None: unbounded)
    example_elems: int | None  # the elements at the example inputs (None: data-dependent)
    scan: _GraphScan  # the graph it lies in: ranges, unbacked symbols' origins, allocations so far


def _resolve_dims(env: ShapeEnv, dims: list[DynamicDim], names: list[str]) -> dict[sympy.Symbol, ValueRanges]:
    """Find the symbol of each dim of ``dims`` in ``env`` (by Dynamo source) and fill in its
    ``symbol`` and ``range`` where not yet known; return the user's ranges by symbol."""
    from torch.utils._sympy.value_ranges import ValueRanges

    user_rng: dict[sympy.Symbol, ValueRanges] = {}
    for sym, sources in getattr(env, "var_to_sources", {}).items():
        target = env.replacements.get(sym, sym)
        for src in sources:
            key = _source_key(source_name(src), names)
            if key is None:
                continue
            for d in dims:
                if (d.input, d.dim) == key:
                    if isinstance(target, sympy.Symbol) and d.symbol is None:
                        d.symbol = str(target)
                    lo = d.min if d.min is not None else 0
                    hi = d.max if d.max is not None else _int_oo()
                    if isinstance(target, sympy.Symbol):
                        user_rng[target] = user_rng.get(target, ValueRanges(0, _int_oo())) & ValueRanges(lo, hi)
    for d in dims:
        sym = next((v for v in env.var_to_range if str(v) == d.symbol), None) if d.symbol else None
        if d.range is None and sym is not None:
            vr = env.var_to_range[sym] & user_rng.get(sym, ValueRanges(0, _int_oo()))
            d.range = (int(vr.lower), int(vr.upper) if _is_int_bound(vr.upper) else None)
    return user_rng


def _allocation(node: torch.fx.Node, scan: _GraphScan) -> _Allocation | None:
    """The sizes and bounds of ``node``'s outputs, or None when it allocates nothing variable-size."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    outs = tensors_of(node.meta.get("val"))
    if not outs:
        return None
    shapes = [[size_expr(s) for s in t.shape] for t in outs]
    exprs = [e for shape in shapes for e in shape]
    unbacked = set().union(*(free_unbacked_symbols(e) for e in exprs)) if exprs else set()
    packet = _packet(node.target)
    data_dep = packet in _DATA_DEPENDENT or _is_bool_index(node)
    randperm_var = packet == "randperm" and bool(size_expr(node.args[0]).free_symbols)
    symbolic = any(e.free_symbols for e in exprs)
    if not (symbolic or data_dep):
        return None
    numels = [sympy.Mul(*shape) if shape else sympy.Integer(1) for shape in shapes]
    b_elems = [scan.bounds.bound(e) for e in numels]
    bound_elems = None if any(b is None for b in b_elems) else sum(b_elems)
    bound_bytes = None if bound_elems is None else sum(b * t.dtype.itemsize for b, t in zip(b_elems, outs))
    ex = [scan.bounds.example(e) for e in numels]
    example_elems = None if any(v is None for v in ex) else sum(ex)
    return _Allocation(
        node=node,
        packet=packet,
        data_dep=data_dep,
        randperm_var=randperm_var,
        unbacked=unbacked,
        shapes=shapes,
        numels=numels,
        bound_elems=bound_elems,
        bound_bytes=bound_bytes,
        example_elems=example_elems,
        scan=scan,
    )


def _row_for(node: torch.fx.Node, scan: _GraphScan) -> AllocationRow | None:
    """The row of one aten node, or None when it allocates nothing variable-size (a view is noted
    in ``scan.view_base``)."""
    # getitem only picks one result of a multi-output op (which has its row); plain Python
    # callables compute SymInts
    if node.op != "call_function" or not isinstance(
        node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)
    ):
        return None
    if returns_alias(node.target):
        base = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if base is not None:
            scan.view_base[node.name] = scan.view_base.get(base.name, base)
        return None
    alloc = _allocation(node, scan)
    if alloc is None:
        return None
    src, code = _source(node)
    for s in alloc.unbacked:
        scan.born.setdefault(s, f"{_op_name(node.target)} at {src}")
    scan.allocating.add(node.name)
    verdict, rule, reason = _verdict(alloc)
    return AllocationRow(
        graph=scan.label,
        node=node.name,
        op=_op_name(node.target),
        source=src,
        shape="; ".join("[" + ", ".join(str(e) for e in shape) + "]" for shape in alloc.shapes),
        bound_elems=alloc.bound_elems,
        bound_bytes=alloc.bound_bytes,
        verdict=verdict,
        rule=rule,
        reason=reason,
        code=code,
        example_elems=alloc.example_elems,
    )


def _analyze(
    rec: Any,  # the audit's _Recorder: the graphs it traced
    named: dict[str, Any],
    dyn: dict[str, dict[int, tuple[int | None, int | None]]],
    training: bool,
    factor: float,
    notes: list[str],
) -> AuditReport:
    names = list(named)
    rows: list[AllocationRow] = []
    dims = [
        DynamicDim(name, d, int(named[name].shape[d]), lo, hi) for name, ds in dyn.items() for d, (lo, hi) in ds.items()
    ]
    for graph in rec.graphs:
        env = shape_env_of([tensors_of(n.meta.get("val")) for n in graph.gm.graph.nodes])
        if env is None:
            continue
        scan = _GraphScan(graph.label, _Bounds(env, _resolve_dims(env, dims, names)), factor)
        for node in graph.gm.graph.nodes:
            row = _row_for(node, scan)
            if row is not None:
                rows.append(row)

    for d in dims:
        if d.symbol is None:
            notes.append(
                f"note: {d.input}.size({d.dim}) was specialized to {d.example} by the code: nothing varies with it"
            )
    if len(rec.dynamo_graphs) > 1:
        notes.append(
            f"note: {len(rec.dynamo_graphs)} Dynamo graphs (graph breaks): code between them ran eagerly and is not audited"
        )
    if not training and any(_has_checkpoint_hop(g) for g in rec.dynamo_graphs):
        notes.append(
            "note: the code uses activation checkpointing, but the audit ran without grad, where checkpointing "
            "does nothing; pass train=True (CLI: --train) to audit the training graphs"
        )
    return AuditReport(
        rows=rows,
        graphs=[g.label for g in rec.graphs],
        dims=dims,
        training=training,
        partial_factor=factor,
        notes=notes,
    )


def _int_oo() -> sympy.Expr:
    from torch.utils._sympy.numbers import int_oo

    return int_oo


def _source_key(name: str, names: list[str]) -> tuple[str, int] | None:
    """``L['args'][1].size()[0]`` (the audit wrapper) or ``L['x'].size()[0]`` -> ``("x", 0)``."""
    m = re.fullmatch(r"L\['args'\]\[(\d+)\]\.size\(\)\[(\d+)\]", name)
    if m:
        i = int(m.group(1))
        return (names[i], int(m.group(2))) if i < len(names) else None
    m = re.fullmatch(r"L\['([^']+)'\]\.size\(\)\[(\d+)\]", name)
    if m and m.group(1) in names:
        return m.group(1), int(m.group(2))
    return None


def _has_checkpoint_hop(gm: torch.fx.GraphModule) -> bool:
    return any(
        n.op == "call_function" and op_name(n.target).name == "tag_activation_checkpoint" for n in gm.graph.nodes
    )


def _recomputed(node: torch.fx.Node, label: str) -> bool:
    """In an activation-checkpoint region and recomputed in backward (not saved by a selective policy).
    Never in an inference graph (``label`` ``"N/inference"``): there is no backward to recompute in, though
    torch 2.9 still tags the region's nodes there."""
    if label.endswith("/inference") or "ac_graph_id" not in node.meta:
        return False
    policy = node.meta.get("recompute")
    return policy is None or getattr(policy, "name", str(policy)) in _RECOMPUTE_POLICIES


def _is_bool_index(node: torch.fx.Node) -> bool:
    if _packet(node.target) != "index" or len(node.args) < 2:
        return False
    for idx in node.args[1] or ():
        v = idx.meta.get("val") if isinstance(idx, torch.fx.Node) else None
        if isinstance(v, torch.Tensor) and v.dtype == torch.bool:
            return True
    return False


def _dyn_degree(numel: sympy.Expr, ranges: dict[sympy.Symbol, ValueRanges]) -> int:
    """Degree of ``numel`` in its non-constant symbols (2 for s0*s1 or s0**2; 1 for 4*s0 + 4)."""
    syms = [s for s in numel.free_symbols if not ranges[s].is_singleton()]
    if not syms:
        return 0
    expr = numel
    try:
        return sympy.Poly(sympy.expand(expr), *syms).total_degree()
    except sympy.PolynomialError:
        # Min/Max/FloorDiv: count the factors that vary
        factors = sympy.Mul.make_args(expr)
        return sum(1 for f in factors if any(s in f.free_symbols for s in syms))


def _verdict(a: _Allocation) -> tuple[str, str, str]:
    """``(verdict, rule, reason)`` for one allocation: the first rule of :data:`RULES` that matches."""
    node, numels, ranges_for = a.node, a.numels, a.scan.bounds.ranges_for
    found = _data_dependent_verdict(a)
    if found is not None:
        return found
    if _recomputed(node, a.scan.label):
        return (
            "NO",
            "checkpoint",
            "inside an activation-checkpoint region: a persistent buffer would keep alive the memory "
            "that checkpointing frees after forward and recomputes in backward",
        )
    bound_elems = a.bound_elems
    if bound_elems is None:
        free = sorted({str(s) for e in numels for s in e.free_symbols if not _bounded(ranges_for(e)[s])})
        return (
            "NO",
            "unbounded",
            f"no upper bound for {', '.join(free) or 'the size'}: give a max in dynamic= or max_sizes=",
        )
    degree = max(_dyn_degree(e, ranges_for(e)) for e in numels)
    ratio = (bound_elems / a.example_elems) if a.example_elems else None
    if degree >= 2:
        prod = ", ".join(str(e) for e in numels if _dyn_degree(e, ranges_for(e)) >= 2)
        return (
            "PARTIAL",
            "product",
            f"size grows with a product of dynamic dims ({prod}): a max-size buffer is the product of the "
            f"maxima ({bound_elems:,} elems{_ratio_txt(ratio)}); bucket the dims instead",
        )
    factor = a.scan.factor
    if ratio is not None and ratio > factor:
        return (
            "PARTIAL",
            "ratio",
            f"bounded, but the bound is {ratio:.0f}x the size at the example inputs (> {factor:g}x): "
            "a max-size buffer would mostly sit idle; bucket the length",
        )
    if a.packet == "cat":
        found = _cat_verdict(a)
        if found is not None:
            return found
    return (
        "YES",
        "bounded",
        f"size depends only on input sizes: preallocate {bound_elems:,} elems once and slice per call"
        f"{_ratio_txt(ratio)}",
    )


def _data_dependent_verdict(a: _Allocation) -> tuple[str, str, str] | None:
    """NO (rule ``data-dependent``) for a randperm over a variable count or a size that depends on data, else None."""
    node = a.node
    if a.randperm_var:
        count = size_expr(node.args[0])
        why = f"its count {count} is data-dependent" if _has_unbacked(count) else f"its count {count} varies"
        return (
            "NO",
            "data-dependent",
            f"randperm over a variable count ({why}): a prefix of a max-size permutation is not a permutation "
            "of n, so no fixed buffer slice can stand in for it",
        )
    if a.data_dep or a.unbacked:
        if a.data_dep:
            return "NO", "data-dependent", f"data-dependent size: {_DATA_DEPENDENT_WHY.get(a.packet, _MASK_WHY)}"
        syms = sorted(a.unbacked, key=str)
        origin = "; ".join(f"{s} from {a.scan.born.get(s, 'an earlier graph or a .item()')}" for s in syms)
        return "NO", "data-dependent", f"data-dependent size: depends on {origin}"
    return None


def _cat_verdict(a: _Allocation) -> tuple[str, str, str] | None:
    """PARTIAL for a cat along a variable dim of pieces that are variable-size allocations, else None."""
    node = a.node
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    out = tensors_of(node.meta.get("val"))[0]
    dim = dim % max(out.dim(), 1)
    if size_expr(out.shape[dim]).free_symbols:
        pieces = []
        for p in node.args[0]:
            base = a.scan.view_base.get(p.name, p) if isinstance(p, torch.fx.Node) else None
            if base is not None and base.name in a.scan.allocating:
                pieces.append(base.name if base is p else f"{p.name} of {base.name}")
        if pieces:
            return (
                "PARTIAL",
                "cat",
                f"cat along variable dim {dim} of pieces that are themselves variable-size allocations "
                f"({', '.join(pieces)}): a max-size buffer helps only if their producers write into slices "
                "of it; preallocating the result alone still allocates every piece and copies it",
            )
    return None


def _ratio_txt(ratio: float | None) -> str:
    return "" if ratio is None else f", {ratio:.1f}x the example"


def _bounded(vr: ValueRanges) -> bool:
    return _is_int_bound(vr.upper)


def _has_unbacked(expr: sympy.Expr) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(expr))
