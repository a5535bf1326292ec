"""``graphpass.audit``: which variable-size allocations could become fixed-size preallocated buffers.

Dynamo traces ``fn(*inputs)`` with the dims named in ``dynamic=`` marked dynamic; every graph is
lowered to aten by AOTAutograd (forward and, in training mode, backward); every aten node that
allocates a tensor with a symbolic size, or a size only known from tensor values, becomes one
:class:`AllocationRow` with its source line, symbolic shape, upper bound and a verdict:

``YES``      the size depends only on input sizes and has a finite bound: one max-size buffer,
             sliced per call, works.
``PARTIAL``  bounded, but a max-size buffer is a poor fit (see :data:`RULES`).
``NO``       data-dependent size, no upper bound, or inside an activation-checkpoint region.

The graphs run eagerly on the example inputs (to get past graph breaks); nothing is compiled.
"""

from __future__ import annotations

import inspect
import itertools
import re
import threading
import types
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import sympy
import torch
from tabulate import tabulate

from ..errors import ConfigError
from ..formatting import fmt_bytes
from ..fx_utils import op_name, shape_env_hints, returns_alias, size_expr, source_frame, tensors_of
from ..tensor_utils import shape_env_of
from ..torch_compat import source_name

if TYPE_CHECKING:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.node import Target
    from torch.utils._sympy.value_ranges import ValueRanges

__all__ = ["audit", "AuditReport", "AllocationRow", "VERDICTS", "RULES"]

VERDICTS = ("YES", "PARTIAL", "NO")

#: The verdict rules, first match wins. Documented in docs/static-shapes.md.
RULES = (
    ("NO", "data-dependent", "the size depends on tensor values (an unbacked symbol u*, or nonzero/masked_select/"
     "unique/repeat_interleave/bool-mask index), or it is randperm over a variable count"),
    ("NO", "checkpoint", "the node lies in an activation-checkpoint region"),
    ("NO", "unbounded", "a dynamic dim in the size has no upper bound (give max in dynamic= or max_sizes=)"),
    ("PARTIAL", "product", "the size grows with a product of dynamic dims (s0*s1, s0**2)"),
    ("PARTIAL", "ratio", "the bound is more than partial_factor (16) times the size at the example inputs"),
    ("PARTIAL", "cat", "a cat along a dynamic dim of pieces that are themselves variable-size allocations"),
    ("YES", "bounded", "the size depends only on input sizes and has a finite bound"),
)

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



# ----------------------------------------------------------------------------------------- rows


@dataclass
class AllocationRow:
    """One allocating aten node of one graph."""

    graph: str  # "<dynamo graph>/<forward|backward|inference>", e.g. "0/forward"
    node: str  # the node's name in that aten graph
    op: str  # e.g. "aten.cat.default"
    source: str  # "file.py:LINE" of the user's frame that made it, "-" when unknown
    shape: str  # sympy shape, e.g. "[s0, 4*s1 + 1, 16]"; several outputs joined by "; "
    bound_elems: int | None  # upper bound on elements over the dims' ranges (None: unbounded)
    bound_bytes: int | None
    verdict: str  # YES | PARTIAL | NO
    reason: str
    rule: str = ""  # which rule of RULES decided the verdict
    code: str = ""  # the source line's code
    example_elems: int | None = None  # elements at the example inputs (None: data-dependent)


@dataclass
class DynamicDim:
    """One dim named in ``dynamic=`` and the symbol Dynamo gave it."""

    input: str
    dim: int
    example: int
    min: int | None
    max: int | None
    symbol: str | None = None  # None: the code specialized it (see notes)
    range: tuple[int | None, int | None] | None = None  # the range the bounds used (None: unbounded above)


@dataclass
class AuditReport:
    """The result of :func:`audit`."""

    rows: list[AllocationRow]
    graphs: list[str]
    dims: list[DynamicDim]
    training: bool
    partial_factor: float
    notes: list[str] = field(default_factory=list)

    def by_verdict(self) -> dict[str, list[AllocationRow]]:
        out: dict[str, list[AllocationRow]] = {v: [] for v in VERDICTS}
        for r in self.rows:
            out[r.verdict].append(r)
        return out

    def table(self) -> str:
        rows = [
            [
                r.graph,
                r.source,
                r.op.removeprefix("aten."),
                r.shape,
                _fmt_int(r.bound_elems),
                "unbounded" if r.bound_bytes is None else fmt_bytes(r.bound_bytes),
                r.verdict,
                r.reason,
            ]
            for r in self.rows
        ]
        headers = ["graph", "source", "op", "shape", "bound (elems)", "bound (bytes)", "verdict", "reason"]
        return tabulate(rows, headers=headers, maxcolwidths=[None] * 7 + [72], disable_numparse=True)

    def __str__(self) -> str:
        mode = "training (forward + backward)" if self.training else "inference (no_grad)"
        dims = ", ".join(
            f"{d.symbol or '(specialized)'} = {d.input}.size({d.dim}) in "
            f"[{_fmt_int((d.range or (d.min, d.max))[0], '?')}, {_fmt_int((d.range or (d.min, d.max))[1])}] (example {d.example})"
            for d in self.dims
        )
        lines = [
            f"graphpass audit: {len(self.rows)} variable-size allocation(s) in {len(self.graphs)} aten graph(s), {mode}",
            f"dynamic: {dims or '-'}",
            "",
            self.table() if self.rows else "(no variable-size allocations)",
            "",
        ]
        groups = self.by_verdict()
        meaning = {
            "YES": "a fixed max-size buffer, sliced per call, works",
            "PARTIAL": "bounded, but a max-size buffer is a poor fit (buckets or producer rewrites first)",
            "NO": "data-dependent, unbounded or inside activation checkpointing",
        }
        for v in VERDICTS:
            rows = groups[v]
            total = sum(r.bound_bytes or 0 for r in rows if r.bound_bytes is not None)
            extra = f", {fmt_bytes(total)} at the bounds" if v != "NO" and rows else ""
            lines.append(f"{v}: {len(rows)} ({meaning[v]}{extra})")
        lines += self.notes
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "training": self.training,
            "partial_factor": self.partial_factor,
            "graphs": list(self.graphs),
            "dynamic": [asdict(d) for d in self.dims],
            "counts": {v: len(rs) for v, rs in self.by_verdict().items()},
            "rows": [asdict(r) for r in self.rows],
            "notes": list(self.notes),
        }


def _fmt_int(n: int | None, none: str = "unbounded") -> str:
    return none if n is None else f"{n:,}"


# ------------------------------------------------------------------------- argument checking


def _target(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn.forward if isinstance(fn, torch.nn.Module) else fn


def _bind_inputs(fn: Callable[..., Any], inputs: tuple) -> dict[str, Any]:
    try:
        sig = inspect.signature(_target(fn))
    except (TypeError, ValueError) as exc:
        raise ConfigError("dynamic", fn, f"cannot read the parameter names of {fn!r}: {exc}") from None
    try:
        bound = sig.bind(*inputs)
    except TypeError as exc:
        raise ConfigError("inputs", inputs, f"the example inputs do not fit {sig}: {exc}") from None
    return {
        name: value
        for name, value in bound.arguments.items()
        if sig.parameters[name].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _normalize_dynamic(dynamic: Any, named: dict[str, Any], names: list[str]) -> dict[str, dict[int, tuple]]:
    """``{"x": 0}``, ``{"x": (0, 1)}``, ``{"x": {0: (2, 1024)}}`` -> ``{"x": {0: (2, 1024)}}``."""
    if not isinstance(dynamic, dict) or not dynamic:
        raise ConfigError("dynamic", dynamic, "expected a non-empty dict {input name: dim | dims | {dim: (min, max)}}")
    out: dict[str, dict[int, tuple]] = {}
    for name, spec in dynamic.items():
        entry = {name: spec}
        if name not in named:
            known = ", ".join(names) or "none"
            raise ConfigError("dynamic", entry, f"{name!r} is not an input of the function (inputs: {known})")
        t = named[name]
        if not isinstance(t, torch.Tensor):
            raise ConfigError("dynamic", entry, f"{name!r} is a {type(t).__name__}, not a tensor")
        if _is_int(spec):
            dims: dict[Any, Any] = {spec: None}
        elif isinstance(spec, (tuple, list)) and spec and all(_is_int(d) for d in spec):
            dims = {d: None for d in spec}
        elif isinstance(spec, dict) and spec:
            dims = dict(spec)
        else:
            raise ConfigError("dynamic", entry, "expected a dim, a tuple of dims, or {dim: (min, max)}")
        norm: dict[int, tuple] = {}
        for dim, rng in dims.items():
            if not _is_int(dim) or not -t.dim() <= dim < t.dim():
                raise ConfigError("dynamic", entry, f"dim {dim!r} is out of range for {name!r} of shape {tuple(t.shape)}")
            d = dim % t.dim()
            lo, hi = _range(rng, entry)
            size = t.shape[d]
            if (lo is not None and size < lo) or (hi is not None and size > hi):
                raise ConfigError("dynamic", entry, f"the example {name}.size({d}) = {size} is outside [{lo}, {hi}]")
            norm[d] = (lo, hi)
        out[name] = norm
    return out


def _range(rng: Any, entry: dict) -> tuple[int | None, int | None]:
    if rng is None:
        return None, None
    if isinstance(rng, (tuple, list)) and len(rng) == 2 and all(v is None or _is_int(v) for v in rng):
        lo, hi = rng
        if lo is not None and lo < 0:
            raise ConfigError("dynamic", entry, f"min {lo} is negative")
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError("dynamic", entry, f"min {lo} is larger than max {hi}")
        return lo, hi
    raise ConfigError("dynamic", entry, f"a range must be (min, max) of ints or None, got {rng!r}")


def _normalize_max_sizes(max_sizes: Any, dyn: dict[str, dict[int, tuple]], named: dict[str, Any]) -> dict[tuple[str, int], int]:
    """``{"x": 1024}`` (every dynamic dim of x) or ``{"x": {0: 1024}}`` -> ``{("x", 0): 1024}``."""
    if max_sizes is None:
        return {}
    if not isinstance(max_sizes, dict):
        raise ConfigError("max_sizes", max_sizes, "expected {input name: max | {dim: max}}")
    out: dict[tuple[str, int], int] = {}
    for name, spec in max_sizes.items():
        entry = {name: spec}
        if name not in dyn:
            raise ConfigError("max_sizes", entry, f"{name!r} has no dim in dynamic=")
        items = {d: spec for d in dyn[name]} if _is_int(spec) else spec
        if not isinstance(items, dict):
            raise ConfigError("max_sizes", entry, "expected a max (int) or {dim: max}")
        for dim, hi in items.items():
            if not _is_int(hi) or hi < 0:
                raise ConfigError("max_sizes", entry, f"max {hi!r} is not a non-negative int")
            ndim = named[name].dim()
            if not _is_int(dim) or not -ndim <= dim < ndim or dim % ndim not in dyn[name]:
                raise ConfigError("max_sizes", entry, f"dim {dim!r} of {name!r} is not marked in dynamic=")
            size = named[name].shape[dim % ndim]
            if hi < size:
                raise ConfigError("max_sizes", entry, f"max {hi} is below the example {name}.size({dim % ndim}) = {size}")
            out[(name, dim % ndim)] = hi
    return out


# ----------------------------------------------------------------------------------- tracing


@dataclass
class _Graph:
    label: str
    gm: torch.fx.GraphModule


class _Recorder:
    """The Dynamo backend: lower each graph with AOTAutograd and keep the aten graphs."""

    def __init__(self) -> None:
        self.graphs: list[_Graph] = []
        self.dynamo_graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

        index = len(self.dynamo_graphs)
        self.dynamo_graphs.append(gm)

        def record(kind: str):
            def compiler(g: torch.fx.GraphModule, _inputs):
                self.graphs.append(_Graph(f"{index}/{kind}", g))
                return make_boxed_func(g.forward)

            return compiler

        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=record("forward"),
            bw_compiler=record("backward"),
            inference_compiler=record("inference"),
        )


# Names for fresh entry code objects: unique per process, so two audits (two threads, two models)
# never share Dynamo's cache entry. itertools.count's __next__ is atomic; the lock makes it explicit.
_ENTRY_NAMES = itertools.count(1)
_ENTRY_LOCK = threading.Lock()


def _fresh_entry(fn: Callable[..., Any]) -> types.FunctionType:
    """A wrapper with a code object of its own, so Dynamo's cache of earlier audits never answers."""

    def entry(*args):
        return fn(*args)

    with _ENTRY_LOCK:
        n = next(_ENTRY_NAMES)
    code = entry.__code__.replace(co_name=f"graphpass_audit_{n}")
    return types.FunctionType(code, entry.__globals__, code.co_name, None, entry.__closure__)


def _run(fn: Callable[..., Any], inputs: tuple, dyn: dict, names: list[str], training: bool, strict: bool) -> _Recorder:
    # fresh tensor objects: the marks must not stick to the caller's tensors
    args = [
        t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs
    ]
    for name, dims in dyn.items():
        t = args[names.index(name)]
        for d, (lo, hi) in dims.items():
            if strict and (lo, hi) == (None, None):
                torch._dynamo.mark_dynamic(t, d)
            elif strict:  # torch 2.13 fails on a range with one end None
                torch._dynamo.mark_dynamic(t, d, min=0 if lo is None else lo, max=_int_oo() if hi is None else hi)
            else:
                torch._dynamo.maybe_mark_dynamic(t, d)
    rec = _Recorder()
    compiled = torch.compile(_fresh_entry(fn), backend=rec, dynamic=False)
    patch = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)
    with patch, torch.set_grad_enabled(training):
        compiled(*args)
    return rec


def audit(
    fn: Any,
    *inputs: Any,
    dynamic: dict[str, int | tuple[int, ...] | dict],
    max_sizes: dict | None = None,
    train: bool | None = None,
    partial_factor: float = 16.0,
    **kw: Any,
) -> AuditReport:
    """Trace ``fn(*inputs)`` with the ``dynamic`` dims symbolic and report every variable-size allocation.

    ``dynamic`` maps a parameter name of ``fn`` (or ``fn.forward``) to the dim(s) that vary:
    ``{"x": 0}``, ``{"x": (0, 1)}``, ``{"x": {0: (2, 1024)}}`` (a range ``(min, max)``, either may be
    ``None``). ``max_sizes`` gives upper bounds where ``dynamic`` has no max: ``{"x": 1024}`` or
    ``{"x": {0: 1024}}``. ``train``: trace forward and backward with grad enabled; the default is
    training when an input requires grad or ``fn`` is a module in training mode with trainable
    parameters, else inference under ``no_grad``. ``partial_factor``: bound-to-example ratio above
    which a bounded allocation is PARTIAL. Bad arguments raise :class:`~graphpass.ConfigError`
    before anything runs.
    """
    if kw:
        key = next(iter(kw))
        raise ConfigError(key, kw[key], "unknown option of graphpass.audit (known: dynamic, max_sizes, train, partial_factor)")
    if not callable(fn):
        raise ConfigError("fn", fn, "expected a module or a function")
    if isinstance(partial_factor, bool) or not isinstance(partial_factor, (int, float)) or partial_factor < 1:
        raise ConfigError("partial_factor", partial_factor, "expected a number >= 1")
    if train is not None and not isinstance(train, bool):
        raise ConfigError("train", train, "expected True, False or None")
    named = _bind_inputs(fn, inputs)
    names = list(named)
    dyn = _normalize_dynamic(dynamic, named, names)
    user_max = _normalize_max_sizes(max_sizes, dyn, named)
    # max_sizes fills in the max where dynamic= gave none
    dyn = {
        name: {d: (lo, hi if hi is not None else user_max.get((name, d))) for d, (lo, hi) in dims.items()}
        for name, dims in dyn.items()
    }
    if train is None:
        train = any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs) or (
            isinstance(fn, torch.nn.Module) and fn.training and any(p.requires_grad for p in fn.parameters())
        )

    notes: list[str] = []
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    try:
        rec = _run(fn, inputs, dyn, names, train, strict=True)
    except ConstraintViolationError as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip().startswith("-")), str(exc).splitlines()[0])
        notes.append(
            "note: the code narrows or specializes a dim marked in dynamic= (mark_dynamic refused: "
            f"{first.lstrip('- ')}); audited again with maybe_mark_dynamic, the declared ranges applied to the bounds"
        )
        rec = _run(fn, inputs, dyn, names, train, strict=False)

    return _analyze(rec, named, dyn, train, float(partial_factor), notes)


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
        node=node, packet=packet, data_dep=data_dep, randperm_var=randperm_var, unbacked=unbacked,
        shapes=shapes, numels=numels, bound_elems=bound_elems, bound_bytes=bound_bytes,
        example_elems=example_elems, scan=scan,
    )


def _row_for(node: torch.fx.Node, scan: _GraphScan) -> AllocationRow | None:
    """The row of one aten node, or None when it allocates nothing variable-size (a view is noted
    in ``scan.view_base``)."""
    # getitem only picks one result of a multi-output op (which has its row); plain Python
    # callables compute SymInts
    if node.op != "call_function" or not isinstance(node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
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
    rec: _Recorder, named: dict[str, Any], dyn: dict[str, dict[int, tuple[int | None, int | None]]],
    training: bool, factor: float, notes: list[str],
) -> AuditReport:
    names = list(named)
    rows: list[AllocationRow] = []
    dims = [
        DynamicDim(name, d, int(named[name].shape[d]), lo, hi)
        for name, ds in dyn.items()
        for d, (lo, hi) in ds.items()
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
            notes.append(f"note: {d.input}.size({d.dim}) was specialized to {d.example} by the code: nothing varies with it")
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
    if a.randperm_var:
        count = size_expr(node.args[0])
        why = f"its count {count} is data-dependent" if _has_unbacked(count) else f"its count {count} varies"
        return ("NO", "data-dependent",
                f"randperm over a variable count ({why}): a prefix of a max-size permutation is not a permutation "
                "of n, so no fixed buffer slice can stand in for it")
    if a.data_dep or a.unbacked:
        if a.data_dep:
            return "NO", "data-dependent", f"data-dependent size: {_DATA_DEPENDENT_WHY.get(a.packet, _MASK_WHY)}"
        syms = sorted(a.unbacked, key=str)
        origin = "; ".join(f"{s} from {a.scan.born.get(s, 'an earlier graph or a .item()')}" for s in syms)
        return "NO", "data-dependent", f"data-dependent size: depends on {origin}"
    if _recomputed(node, a.scan.label):
        return ("NO", "checkpoint",
                "inside an activation-checkpoint region: a persistent buffer would keep alive the memory "
                "that checkpointing frees after forward and recomputes in backward")
    bound_elems = a.bound_elems
    if bound_elems is None:
        free = sorted({str(s) for e in numels for s in e.free_symbols if not _bounded(ranges_for(e)[s])})
        return ("NO", "unbounded",
                f"no upper bound for {', '.join(free) or 'the size'}: give a max in dynamic= or max_sizes=")
    degree = max(_dyn_degree(e, ranges_for(e)) for e in numels)
    ratio = (bound_elems / a.example_elems) if a.example_elems else None
    if degree >= 2:
        prod = ", ".join(str(e) for e in numels if _dyn_degree(e, ranges_for(e)) >= 2)
        return ("PARTIAL", "product",
                f"size grows with a product of dynamic dims ({prod}): a max-size buffer is the product of the "
                f"maxima ({bound_elems:,} elems{_ratio_txt(ratio)}); bucket the dims instead")
    factor = a.scan.factor
    if ratio is not None and ratio > factor:
        return ("PARTIAL", "ratio",
                f"bounded, but the bound is {ratio:.0f}x the size at the example inputs (> {factor:g}x): "
                "a max-size buffer would mostly sit idle; bucket the length")
    if a.packet == "cat":
        found = _cat_verdict(a)
        if found is not None:
            return found
    return ("YES", "bounded",
            f"size depends only on input sizes: preallocate {bound_elems:,} elems once and slice per call"
            f"{_ratio_txt(ratio)}")


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
            return ("PARTIAL", "cat",
                    f"cat along variable dim {dim} of pieces that are themselves variable-size allocations "
                    f"({', '.join(pieces)}): a max-size buffer helps only if their producers write into slices "
                    "of it; preallocating the result alone still allocates every piece and copies it")
    return None


def _ratio_txt(ratio: float | None) -> str:
    return "" if ratio is None else f", {ratio:.1f}x the example"


def _bounded(vr: ValueRanges) -> bool:
    return _is_int_bound(vr.upper)


def _has_unbacked(expr: sympy.Expr) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(expr))
