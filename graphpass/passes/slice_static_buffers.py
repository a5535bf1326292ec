"""Static buffers: replaces each factory op with a symbolic size (``torch.arange(s0)``,
``torch.zeros(b, s0)``, ``torch.ones``, ``torch.full``, ``torch.empty``, ``x.new_zeros(...)``,
``torch.arange(start, s0 + k, step)``, ...) by a slice of a constant max-size buffer, so the graph
no longer allocates a tensor of a new size on every call.

What it inserts, per replaced factory:

* a ``get_attr`` of a non-persistent buffer registered on the GraphModule
  (``_graphpass_static_<i>``), built once at pass time on the op's device and dtype with the max
  shape (each size's upper end over the bounds, ``bound_sympy``): ``torch.arange(start, max_end, step)`` for
  ``arange``, a filled buffer for ``zeros`` / ``ones`` / ``full`` / ``new_*`` and a zero-filled one
  for ``empty``. Factories with equal contents share one buffer;
* ``torch.narrow(buf, 0, 0, length)`` when only the leading dim varies (``arange``, ``zeros(s0, 4)``),
  where ``length`` is the original SymInt size node (for ``arange(start, end, step)`` with other
  than ``0, end, 1``: a few SymInt arithmetic nodes computing ``ceil((end - start) / step)``);
* otherwise ``buf.view(-1)`` narrowed to the runtime element count and ``view``-ed to the runtime
  sizes. Fills are uniform, so this is the same tensor as a fresh one, contiguous with the same
  strides (narrowing a max-shape buffer along an inner dim would give other strides, and ``view``
  on it could fail).

The replacement carries the old node's ``example_value``, ``stack_trace`` and ``nn_module_stack``.

Left as they are, each with a reason in the returned :class:`SlicedFactory` list (slices share the
buffer's memory, so nothing may write into them): factories whose result or a view of it is
mutated in place in the graph (``*_`` methods, ``out=``, ``inplace=True``, ``x[i] = v``, ``+=``,
or a version counter bumped while Dynamo traced), ``requires_grad=True`` / ``pin_memory=True`` /
``out=`` factories, sizes that mention a symbol without a bound or a data-dependent (unbacked)
symbol, a bound below the size the graph was traced with, fill values or ``arange`` start/step
computed at run time, floating ``arange`` values that are not exact in their dtype (``arange(0.1,
n, 0.1)``, bfloat16 above 256: the kernel rounds those differently for different lengths, so a
prefix of the long one is not the short one bit for bit), and non-strided layouts. Factories whose
size is fixed are not listed.

Assumes a Dynamo-level graph (``meta["example_value"]`` FakeTensors with SymInt sizes) and that
every call stays within the bounds: a bigger size makes ``narrow`` raise (it never returns wrong
values). A slice returned from the graph is memory the caller (or, after a graph break, the next
graph) could write into; ``slice_outputs=False`` leaves such factories alone.

The pass takes its bounds from ``ctx.static_bounds`` (a
:data:`graphpass.static_shapes.plan.StaticBounds`, set from the bucket plan by
:mod:`plan_static_shapes`) when it is not empty, else from the ``bounds`` callable given to the
constructor; with neither it does nothing.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

import sympy
import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from ..fx_utils import AliasIndex, example_of, op_name, shape_env_hints, size_expr as _expr, writes_into
from ..tensor_utils import fake_mode_of, shape_env_of
from .base import GraphPass, PassContext

BUFFER_PREFIX = "_graphpass_static_"

_FILLS: dict[Any, float | None] = {torch.zeros: 0, torch.ones: 1, torch.empty: 0, torch.full: None}
_NEW_FILLS: dict[str, float | None] = {"new_zeros": 0, "new_ones": 1, "new_empty": 0, "new_full": None}


@dataclass
class SlicedFactory:
    """One factory op with a symbolic size, and what the pass did with it."""

    node: str  # the factory node's name
    op: str  # "arange", "zeros", "new_full", ...
    shape: str  # its symbolic shape, e.g. "[s77, s27]"
    max_shape: tuple[int, ...] | None  # the largest shape within the bounds (None: unknown)
    buffer: str | None  # the buffer it now slices (None when skipped)
    bytes: int  # the buffer's size in bytes (0 when skipped)
    skipped_reason: str | None = None  # None when replaced

    def line(self) -> str:
        if self.skipped_reason is not None:
            return f"{self.node} ({self.op} {self.shape}): skipped, {self.skipped_reason}"
        return (
            f"{self.node} ({self.op} {self.shape}): slice of {self.buffer} "
            f"{list(self.max_shape or ())} ({self.bytes:,} bytes)"
        )


class _Skip(Exception):
    """Raised while examining a factory: leave it as it is, for this reason."""


@dataclass
class _Factory:
    op: str
    sizes: list[Any] | Node | None  # fills: the size items (or one Node holding a torch.Size)
    fill: Any = 0  # fills: the value
    start: Any = 0  # arange
    end: Any = None
    step: Any = 1


# --------------------------------------------------------------------------------------------
# Reading a factory call
# --------------------------------------------------------------------------------------------


def _parse(node: Node) -> _Factory | None:
    """The factory ``node`` calls, or None when it is not one of the handled factories."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if node.op == "call_function" and node.target is torch.arange:
        if "end" in kwargs or len(args) >= 2:
            start = kwargs.get("start", args[0] if args else 0)
            end = kwargs.get("end", args[1] if len(args) > 1 else None)
        else:
            start, end = 0, kwargs.get("end", args[0] if args else None)
        step = kwargs.get("step", args[2] if len(args) > 2 else 1)
        return _Factory("arange", None, start=start, end=end, step=step)
    if node.op == "call_function" and node.target in _FILLS:
        op = op_name(node.target).name
        if op == "full":
            return _Factory(
                op,
                kwargs.get("size", args[0] if args else None),
                fill=kwargs.get("fill_value", args[1] if len(args) > 1 else None),
            )
        return _Factory(op, _size_arg(args, kwargs), fill=_FILLS[node.target])
    if node.op == "call_method" and node.target in _NEW_FILLS:
        rest = args[1:]
        if node.target == "new_full":
            return _Factory(
                node.target,
                kwargs.get("size", rest[0] if rest else None),
                fill=kwargs.get("fill_value", rest[1] if len(rest) > 1 else None),
            )
        return _Factory(node.target, _size_arg(rest, kwargs), fill=_NEW_FILLS[node.target])
    return None


def _size_arg(args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``zeros(2, s0)``, ``zeros((2, s0))``, ``zeros(size=...)`` and ``zeros(x.size())`` alike."""
    if "size" in kwargs:
        return kwargs["size"]
    if len(args) == 1 and (isinstance(args[0], (list, tuple)) or isinstance(_value(args[0]), (list, tuple))):
        return args[0]  # a sequence, or a node holding a torch.Size
    return list(args)


def _value(v: Any) -> Any:
    """A constant itself, a node's example value (a SymInt for size nodes)."""
    return example_of(v) if isinstance(v, Node) else v


def _is_const(v: Any) -> bool:
    return isinstance(v, (int, float, bool))


# --------------------------------------------------------------------------------------------
# Safety: nothing may write into a slice of a shared buffer
# --------------------------------------------------------------------------------------------


def _unsafe_use(node: Node, slice_outputs: bool, index: AliasIndex) -> str | None:
    """Why the result of ``node`` must not be a slice of a shared buffer, or None."""
    ev = example_of(node)
    # the factory's result and every node that may alias it: its views, and nodes sharing its storage
    for alias in index.aliases(node):
        for user in alias.users:
            if writes_into(user, alias):
                what = f"{alias.name}, a view of it" if alias is not node else "it"
                return f"{user.name} ({user.op} {op_name(user.target).name or user.target}) writes into {what}"
            if user.op == "output" and not slice_outputs:
                return "it (or a view of it) is a graph output and slice_outputs=False"
    if isinstance(ev, torch.Tensor) and ev._version > 0:  # a write the checks above do not know
        return "mutated in place in the graph (its version counter moved while Dynamo traced it)"
    return None


# --------------------------------------------------------------------------------------------
# Bounds
# --------------------------------------------------------------------------------------------


def _finite_int(v: Any) -> int | None:
    if v in (int_oo, -int_oo, sympy.oo, -sympy.oo) or not getattr(v, "is_number", False):
        return None
    return int(v) if getattr(v, "is_integer", False) else None


class _Bounder:
    """Upper (and lower) bounds of size expressions, from the user's bounds and the shape env."""

    def __init__(self, bounds: dict[sympy.Symbol, int], example: torch.Tensor):
        self.bounds = bounds
        self.env = shape_env_of(example)

    def ranges(self, exprs: list[sympy.Expr]) -> dict[sympy.Symbol, Any]:
        """Value ranges of every symbol in ``exprs``; raises :class:`_Skip` when one has no bound."""
        free = sorted({s for e in exprs for s in e.free_symbols}, key=str)
        unbacked = [s for s in free if free_unbacked_symbols(s)]
        if unbacked:
            raise _Skip(f"data-dependent size ({', '.join(map(str, unbacked))}): no max shape")
        missing = [str(s) for s in free if s not in self.bounds]
        if missing:
            raise _Skip(f"no bound for {', '.join(missing)}")
        out = {}
        for s in free:
            env_range = self.env.var_to_range.get(s) if self.env is not None else None
            lower = env_range.lower if env_range is not None else 0
            hint = self._hint(s)
            if hint is not None and hint > self.bounds[s]:
                raise _Skip(f"bound {s} <= {self.bounds[s]} is below the traced size {s} = {hint}")
            if self.bounds[s] < lower:
                raise _Skip(f"bound {s} <= {self.bounds[s]} is below its lower end {lower}")
            out[s] = ValueRanges(lower, self.bounds[s])
        return out

    def _hint(self, s: sympy.Symbol) -> int | None:
        if self.env is None:
            return None
        hints = shape_env_hints(self.env)
        return _finite_int(hints.get(s))

    def range_of(self, expr: sympy.Expr) -> tuple[Any, Any]:
        """Lower and upper end of ``expr`` over the symbols' ranges (sound also where it decreases)."""
        vr = bound_sympy(expr, self.ranges([expr]))
        return vr.lower, vr.upper

    def max_int(self, expr: sympy.Expr) -> int:
        upper = _finite_int(self.range_of(expr)[1])
        if upper is None:
            raise _Skip(f"no integer upper bound for {expr}")
        return upper


# --------------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------------


def slice_static_buffers(
    gm: GraphModule, bounds: dict[sympy.Symbol, int], *, slice_outputs: bool = True, recompile: bool = True
) -> list[SlicedFactory]:
    """Replace every factory with a symbolic size in ``gm`` by a slice of a constant max-size buffer.

    ``bounds`` maps each size symbol (``s0``: ``placeholder.meta["example_value"].node.expr``) to the
    largest value it takes. Returns one record per factory with a symbolic size, replaced or not.
    With ``recompile=False`` (the pipeline's runner lints and recompiles) ``gm`` is left to the caller.
    """
    graph = gm.graph
    index = AliasIndex(graph)
    records: list[SlicedFactory] = []
    buffers: dict[tuple, str] = {}  # buffer contents -> name, so equal buffers are shared
    for node in list(graph.nodes):
        spec = _parse(node)
        ev = example_of(node)
        if spec is None or not isinstance(ev, torch.Tensor):
            continue
        shape = [_expr(d) for d in ev.shape]
        if not any(e.free_symbols for e in shape):
            continue  # a fixed size: nothing to do
        rec = SlicedFactory(node.name, spec.op, str(shape), None, None, 0)
        records.append(rec)
        try:
            _check(node, spec, ev, slice_outputs, index)
            bounder = _Bounder(bounds, ev)
            rec.max_shape = tuple(bounder.max_int(e) for e in shape)
            contents, make = _contents(spec, ev, rec.max_shape, bounder)
            if contents not in buffers:
                buf = make()
                buffers[contents] = name = _free_name(gm)
                _register(gm, name, buf)
            rec.buffer = buffers[contents]
            buf = gm.get_buffer(rec.buffer)
            rec.bytes = buf.numel() * buf.element_size()
            _replace(gm, node, spec, shape, rec.buffer)
        except _Skip as why:
            rec.skipped_reason = str(why)
            rec.buffer, rec.bytes = None, 0
    if recompile and any(r.skipped_reason is None for r in records):
        graph.lint()
        gm.recompile()
    return records


def _check(node: Node, spec: _Factory, ev: torch.Tensor, slice_outputs: bool, index: AliasIndex) -> None:
    if node.kwargs.get("requires_grad") or ev.requires_grad:
        raise _Skip("requires_grad=True: a fresh leaf tensor is expected")
    if node.kwargs.get("pin_memory"):
        raise _Skip("pin_memory=True: the buffer would not be pinned")
    if node.kwargs.get("out") is not None:
        raise _Skip("out=: writes into a given tensor")
    if ev.layout != torch.strided:
        raise _Skip(f"layout {ev.layout}: only strided tensors are sliced")
    if spec.op == "arange":
        if not (_is_const(spec.start) and _is_const(spec.step)):
            raise _Skip("arange start/step computed at run time: only constants are handled")
        if spec.step == 0:
            raise _Skip("arange step 0")
    else:
        if not _is_const(spec.fill):
            raise _Skip("fill value computed at run time")
        items = spec.sizes
        if not isinstance(items, Node) and not all(
            i < len(items or ()) and isinstance(items[i], Node)
            for i, d in enumerate(ev.shape)
            if isinstance(d, torch.SymInt)
        ):
            raise _Skip(f"cannot find the size nodes in {items}")
    unsafe = _unsafe_use(node, slice_outputs, index)
    if unsafe:
        raise _Skip(unsafe)


def _contents(
    spec: _Factory, ev: torch.Tensor, max_shape: tuple[int, ...], bounder: _Bounder
) -> tuple[tuple, Callable[[], torch.Tensor]]:
    """A key for the buffer's contents, and how to build it."""
    like = {"dtype": ev.dtype, "device": ev.device}
    if spec.op != "arange":
        fill = spec.fill
        return ("full", fill, max_shape, ev.dtype, ev.device), lambda: torch.full(max_shape, fill, **like)
    end_value = _value(spec.end)
    if not isinstance(end_value, (int, float, torch.SymInt, torch.SymFloat)):
        raise _Skip(f"arange end {spec.end} has no known value")
    lower, upper = bounder.range_of(_expr(end_value))
    end = upper if spec.step > 0 else lower
    if _finite_int(end) is not None:
        max_end: int | float = int(end)
    elif getattr(end, "is_number", False) and bool(end.is_finite):
        max_end = float(end)
    else:
        raise _Skip("no finite bound for the arange end")
    start, step = spec.start, spec.step

    def make() -> torch.Tensor:
        buf = torch.arange(start, max_end, step, **like)
        if buf.shape[0] < max_shape[0]:
            raise _Skip(f"arange({start}, {max_end}, {step}) is shorter than the bound {max_shape[0]}")
        if not _exact_arange(start, step, buf.shape[0], ev.dtype):
            raise _Skip(
                f"arange({start}, ..., {step}) in {ev.dtype} has values that are not exact in that dtype: "
                "the kernel rounds them differently for different lengths, so a prefix may differ"
            )
        return buf

    return ("arange", start, max_end, step, ev.dtype, ev.device), make


def _exact_arange(start: int | float, step: int | float, n: int, dtype: torch.dtype) -> bool:
    """Whether every value of ``arange`` up to ``n`` elements is exact in ``dtype``.

    Only then is a prefix of a longer ``arange`` bit-identical to a shorter one: the CPU kernel
    computes elements on its vector and scalar paths with different roundings (``arange(0.1, n, 0.1)``
    in float32, or bfloat16 values above 256, differ in the last bit between lengths).
    """
    if not dtype.is_floating_point:
        return isinstance(start, int) and isinstance(step, int)  # int64 arithmetic, exact
    first, last = Fraction(start), Fraction(start) + (n - 1) * Fraction(step)
    grain = max(Fraction(start).denominator, Fraction(step).denominator)  # a power of two: floats are dyadic
    digits = 1 - int(math.log2(torch.finfo(dtype).eps))  # 24 for float32, 8 for bfloat16
    # every multiple of 1/grain with magnitude up to 2**digits / grain is representable
    return max(abs(first), abs(last)) * grain <= 2**digits


def _register(gm: GraphModule, name: str, buf: torch.Tensor) -> None:
    gm.register_buffer(name, buf, persistent=False)
    sources = getattr(gm, "_param_name_to_source", None)
    if isinstance(sources, dict):
        # A Dynamo graph: AOTAutograd asks for a source for every parameter and buffer. A copy, so
        # Dynamo's own dict is left as it was.
        from torch._dynamo.source import ConstantSource

        gm._param_name_to_source = {**sources, name: ConstantSource(name)}


def _free_name(gm: GraphModule) -> str:
    taken = {name for name, _ in gm.named_buffers()} | set(dir(gm))
    i = 0
    while f"{BUFFER_PREFIX}{i}" in taken:
        i += 1
    return f"{BUFFER_PREFIX}{i}"


# --------------------------------------------------------------------------------------------
# Rewriting
# --------------------------------------------------------------------------------------------


def _replace(gm: GraphModule, node: Node, spec: _Factory, shape: list[sympy.Expr], buffer: str) -> None:
    graph = gm.graph
    ev = example_of(node)
    keep = {k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta}
    with graph.inserting_before(node):

        def call(kind: str, target: Any, *args: Any) -> Node:
            n = graph.create_node(kind, target, tuple(args))
            n.meta.update(keep)
            value = _fake_value(n)
            if value is not None:
                n.meta["example_value"] = value
            return n

        buf = call("get_attr", buffer)
        fake_mode = fake_mode_of(ev)
        if fake_mode is not None:
            buf.meta["example_value"] = fake_mode.from_tensor(gm.get_buffer(buffer), static_shapes=True)
        if spec.op == "arange":
            out = call("call_function", torch.narrow, buf, 0, 0, _arange_length(call, spec))
        else:
            sizes = _dims(call, spec.sizes, shape, ev)
            if all(not e.free_symbols for e in shape[1:]):
                out = call("call_function", torch.narrow, buf, 0, 0, sizes[0])
            else:
                numel = sizes[0]
                for s in sizes[1:]:
                    numel = (
                        numel * s
                        if isinstance(s, int) and isinstance(numel, int)
                        else call("call_function", operator.mul, numel, s)
                    )
                flat = call("call_function", torch.narrow, call("call_method", "view", buf, -1), 0, 0, numel)
                out = call("call_method", "view", flat, *sizes)
    out.meta["example_value"] = ev  # the same shape and strides as the fresh tensor it replaces
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _dims(call: Callable[..., Node], sizes: Any, shape: list[sympy.Expr], ev: torch.Tensor) -> list[Any]:
    """Runtime size of each dim: the int for fixed dims, the SymInt node for symbolic ones."""
    items = sizes if isinstance(sizes, Node) else list(sizes or [])
    out: list[Any] = []
    for i, e in enumerate(shape):
        if not e.free_symbols:
            out.append(int(e))
        elif isinstance(items, Node):
            out.append(call("call_function", operator.getitem, items, i))
        else:
            out.append(items[i])  # a SymInt node (checked by _check)
    return out


def _arange_length(call: Callable[..., Node], spec: _Factory) -> Any:
    """``len(arange(start, end, step))`` as graph nodes: the end itself for ``arange(end)``."""
    start, end, step = spec.start, spec.end, spec.step
    if start == 0 and step == 1 and isinstance(_value(end), torch.SymInt):
        return end
    if all(isinstance(_value(v), (int, torch.SymInt)) for v in (start, end, step)):
        # ceil((end - start) / step) == -((start - end) // step) for integers, any sign of step
        return call(
            "call_function",
            operator.neg,
            call("call_function", operator.floordiv, call("call_function", operator.sub, start, end), step),
        )
    diff = call("call_function", operator.sub, end, start)
    return call("call_function", math.ceil, call("call_function", operator.truediv, diff, step))


def _fake_value(node: Node) -> Any:
    """The example value of a new node, computed on the fake values of its inputs (None if it cannot)."""
    if node.op == "get_attr":
        return None  # set by the caller, from the graph's fake mode
    args = [example_of(a) if isinstance(a, Node) else a for a in node.args]
    if any(a is None for a in args):
        return None
    fake = next((a for a in args if isinstance(a, torch._subclasses.FakeTensor)), None)
    env = shape_env_of(fake)
    try:
        if node.op == "call_method":
            fn = getattr(args[0], node.target)
            args = args[1:]
        else:
            fn = node.target
        if env is not None:
            with env.suppress_guards():  # the graph's guards are final; add none
                return fn(*args)
        return fn(*args)
    except Exception:  # noqa: BLE001 - example values are best effort
        return None


def _symbolic(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in v.shape)
    return isinstance(v, torch.SymInt)


class SliceStaticBuffers(GraphPass):
    """Slices constant max-size buffers in place of factory ops with symbolic sizes.

    Bounds: ``ctx.static_bounds`` when it is not empty, else
    ``bounds(ctx)``; with neither the pass does not run.
    """

    name = "slice_static_buffers"
    requires = ("plan_static_shapes",)  # in the pipeline, the bounds come from its plan

    def __init__(
        self,
        bounds: Callable[[PassContext], dict[sympy.Symbol, int]] | None = None,
        *,
        slice_outputs: bool = True,
    ):
        self.bounds = bounds
        self.slice_outputs = slice_outputs

    def _bounds(self, ctx: PassContext) -> dict[sympy.Symbol, int]:
        if ctx.static_bounds:
            return ctx.static_bounds
        return (self.bounds(ctx) or {}) if self.bounds is not None else {}

    def should_run(self, ctx: PassContext) -> bool:
        """Only for graphs with symbolic sizes, and only when bounds are known."""
        return any(_symbolic(example_of(n)) for n in ctx.gm.graph.nodes) and bool(self._bounds(ctx))

    def run(self, ctx: PassContext) -> bool:
        records = slice_static_buffers(ctx.gm, self._bounds(ctx), slice_outputs=self.slice_outputs, recompile=False)
        ctx.log.extend(f"{self.name}: {r.line()}" for r in records)
        if not records:
            ctx.log.append(f"{self.name}: no factory with a symbolic size")
        return any(r.skipped_reason is None for r in records)
