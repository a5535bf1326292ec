"""The graph toolkit: every graph question more than one pass or analysis asks, answered once.

* values: :func:`example_of`, :func:`is_tensor_node`, :func:`tensors_of`;
* order and look-up: :func:`node_order`, :func:`find_calls` (``Graph.find_nodes`` by target);
* graphpass's own ops: :func:`is_graphpass_op`, :func:`is_graphpass_node`, :func:`graphpass_op_name`;
* op naming: :func:`op_name` (namespace, name, overload of any target: the one answer), :func:`schema_position`;
* op libraries: :func:`op_library`, :func:`is_custom_op`, :func:`aten_decomposition`,
  :func:`non_aten_nodes` (what a compiler that takes aten only can lower);
* copies: :func:`copy_graph`;
* views and aliases: :func:`is_view`, :func:`returns_alias`, :func:`views_of`, :class:`AliasIndex`;
* writes: :func:`writes_into` (in place methods and functions, ``out=``, ``operator.i*``,
  ``inplace=True``, ``copy_``, ``index_put_``, ``x[i] = v``, mutable schemas) and :func:`find_write` / :func:`iter_writes`;
* the user's source frame of a node: :func:`source_frame`;
* symbolic sizes: :func:`size_expr`, :func:`mentions_symbol`;
* model structure: :func:`repeated_blocks` (the container of numbered children, shared by trap
  assignment and the offload planner) and :func:`inner_tensor_fields`.

Functions here read graphs and tensors; they never change them. They work on Dynamo-level graphs
(``example_value``, ``call_method`` and Python callables) and on aten-level graphs (``val``,
``OpOverload`` targets) alike.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, NamedTuple

import sympy
import torch
from torch.fx import Graph, Node

# The tensor questions live in tensor_utils; re-exported here for callers that import them from the toolkit.
from .tensor_utils import (
    flatten_wrappers,
    is_dtensor,
    is_wrapper_subclass,
    local_tensor,
    subclass_fields,
    unflatten_wrappers,
    with_spec_of,
    wrapper_fields,
    wrapper_inner_tensors,
)

# --------------------------------------------------------------------------------------------
# Values and order
# --------------------------------------------------------------------------------------------


def example_of(node: Any) -> Any:
    """A node's example value (Dynamo's ``example_value``, else AOTAutograd's ``val``); a non-node
    is returned as it is."""
    if isinstance(node, Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def is_tensor_node(node: Node) -> bool:
    return isinstance(example_of(node), torch.Tensor)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in a value (a node's example value, a tensor, or nested lists/tuples of them)."""
    value = example_of(value)
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def node_order(graph: Graph) -> dict[Node, int]:
    """Position of every node in ``graph`` (take it again after inserting nodes)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def find_calls(graph: Graph, *targets: Any) -> list[Node]:
    """The ``call_function`` nodes of ``graph`` that call any of ``targets`` (an overload and its
    packet: Dynamo records the packet), from torch's ``Graph.find_nodes`` index, without a walk over
    every node: in graph order for one target, grouped by target (each group in order) for several."""
    return [n for t in targets for n in graph.find_nodes(op="call_function", target=t)]


def flat_nodes(value: Any) -> list[Node]:
    """The nodes inside an argument (a node, or lists / tuples / dicts of them)."""
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for item in value for n in flat_nodes(item)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in flat_nodes(item)]
    return []


# --------------------------------------------------------------------------------------------
# graphpass's own ops
# --------------------------------------------------------------------------------------------


def is_graphpass_op(target: object) -> bool:
    """Any op in the ``graphpass`` namespace (overload or packet)."""
    return (
        isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
        and op_name(target).namespace == "graphpass"
    )


def is_graphpass_node(node: Node) -> bool:
    return node.op == "call_function" and is_graphpass_op(node.target)


def graphpass_op_name(node: Node) -> str:
    """``trap_enter``, ``load_start``, ``capture``, ... for a graphpass op node; "" for anything else."""
    return op_name(node.target).name if is_graphpass_node(node) else ""


# --------------------------------------------------------------------------------------------
# Op libraries: what a compiler that takes aten only can lower
# --------------------------------------------------------------------------------------------

ATEN_LIBRARIES = frozenset({"aten", "prims"})


class OpName(NamedTuple):
    """How graphpass names a node's target (:func:`op_name`)."""

    namespace: str | None  # aten, prims, graphpass, a custom library; "higher_order"; None for Python callables
    name: str  # the op's base name (``add`` for ``aten.add.Tensor``), a callable's ``__name__``, a method's name
    overload: str  # ``Tensor``, ``default``; "" for anything but an overload

    def __str__(self) -> str:
        """``aten.add.Tensor``, ``aten.add``, ``higher_order.wrap``; a Python callable's bare name."""
        return ".".join(p for p in (self.namespace, self.name, self.overload) if p)


def op_name(target: object) -> OpName:
    """The one answer to "which op is this": namespace, base name and overload of an op overload
    or packet, a higher-order op, a Python callable (``torch.softmax``, ``operator.add``) or a
    ``call_method`` target (a string). Unnamed targets get ``name=""``."""
    if isinstance(target, torch._ops.OpOverload):
        return OpName(target.namespace, target.overloadpacket.__name__, target._overloadname)
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        return OpName(namespace, name, "")
    if isinstance(target, str):
        return OpName(None, target, "")
    name = getattr(target, "__name__", "")
    namespace = "higher_order" if isinstance(target, torch._ops.HigherOrderOperator) else None
    return OpName(namespace, name if isinstance(name, str) else "", "")


def op_library(target: object) -> str | None:
    """The library an op belongs to (``aten``, ``prims``, ``graphpass``, ``transformers``, ...;
    ``higher_order`` for a higher-order op); None for a Python function, method or ``operator`` call."""
    return None if isinstance(target, str) else op_name(target).namespace


def schema_position(target: object, argument: str) -> int | None:
    """Where op overload ``target``'s schema takes ``argument``: its position, -1 when keyword-only,
    None when the schema has no such argument or ``target`` is not an overload."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    for i, a in enumerate(target._schema.arguments):
        if a.name == argument:
            return -1 if a.kwarg_only else i
    return None


def is_custom_op(target: object) -> bool:
    """An op (overload or packet) of a library other than aten, prims and graphpass."""
    lib = op_library(target)
    return lib not in (None, "graphpass", "higher_order") and lib not in ATEN_LIBRARIES


def aten_decomposition(target: object) -> dict | None:
    """How AOTAutograd can lower custom op ``target`` to aten without running it: ``{}`` when every
    overload has a ``CompositeImplicitAutograd`` kernel (traced through on its own), the entries of
    torch's decomposition table (``torch._decomp.register_decomposition``) otherwise; None when an
    overload has neither: only its kernel can run it."""
    from torch._decomp import decomposition_table

    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, name) for name in target.overloads()]
    else:
        overloads = [target]
    table = {}
    for op in overloads:
        if op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
            continue
        if op not in decomposition_table:
            return None
        table[op] = decomposition_table[op]
    return table


def non_aten_nodes(graph: Graph) -> list[Node]:
    """The nodes of an aten-level graph a compiler that takes aten/prims ops only would refuse:
    calls of anything but an aten/prims overload (custom ops, higher-order ops, Python callables)
    and ``operator.getitem``, and ``call_method`` / ``call_module`` nodes."""
    out = []
    for n in graph.nodes:
        if n.op in ("call_method", "call_module"):
            out.append(n)
        elif (
            n.op == "call_function"
            and n.target is not operator.getitem
            and not (isinstance(n.target, torch._ops.OpOverload) and op_name(n.target).namespace in ATEN_LIBRARIES)
        ):
            out.append(n)
    return out


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph (each node's ``meta`` a shallow copy): a
    delegate or a split may change the copy without changing ``gm``."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = torch.fx.GraphModule(gm, graph)
    if hasattr(gm, "_param_name_to_source"):  # AOTAutograd reads it on Dynamo graphs
        new._param_name_to_source = dict(gm._param_name_to_source)
    return new


# --------------------------------------------------------------------------------------------
# Views and aliases
# --------------------------------------------------------------------------------------------

# Names of ops, methods and functions whose result may share memory with their first argument.
# Most aten views also say so in their schema (``OpOverload.is_view``); these are listed because
# a Dynamo-level graph calls them as Python methods / functions, or their schema does not say so.
VIEW_NAMES = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "_unsafe_view",
        "_reshape_alias",
        "alias",
        "lift_fresh",
        "t",
        "transpose",
        "swapaxes",
        "swapdims",
        "permute",
        "movedim",
        "moveaxis",
        "expand",
        "expand_as",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "narrow",
        "select",
        "slice",
        "as_strided",
        "diagonal",
        "unfold",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "tensor_split",
        "detach",
        "real",
        "imag",
        "view_as_real",
        "view_as_complex",
    }
)


def _target_name(node: Node) -> str:
    if node.op == "call_method" and not isinstance(node.target, str):
        return ""
    return op_name(node.target).name


def is_view(node: Node) -> bool:
    """May ``node``'s result alias its first argument (a view, or an item of a split / unbind)?"""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    if isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        return True
    return _target_name(node) in VIEW_NAMES


def returns_alias(target: Any) -> bool:
    """Does the aten op ``target`` return (views of) existing tensors, allocating nothing: a view
    op, or an in-place / ``out=`` op whose every return aliases an argument?"""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if op_name(target).name in VIEW_NAMES or target.is_view:
        return True
    rets = target._schema.returns
    return bool(rets) and all(r.alias_info is not None for r in rets)


def views_of(node: Node) -> list[Node]:
    """``node`` and every node that may alias it through views (views of views, split items)."""
    out: list[Node] = []
    seen: set[Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        out.append(n)
        todo.extend(u for u in n.users if is_view(u) and u.args and u.args[0] is n)
    return out


def storage_key(value: Any) -> int | None:
    """An id of the storage ``value`` (a real or fake tensor) holds its elements in: equal for two tensors that
    share memory; None for no tensor, or one without a storage of its own."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - no storage of its own (sparse, DTensor, ...): aliases nothing we track
        return None


class AliasIndex:
    """Which nodes of one graph may share memory: through views (:func:`views_of`) and, where the
    example values are real or fake tensors, through their storage. Built once per graph."""

    def __init__(self, graph: Graph) -> None:
        self._by_storage: dict[int, list[Node]] = {}
        for n in graph.nodes:
            key = storage_key(example_of(n))
            if key is not None:
                self._by_storage.setdefault(key, []).append(n)

    def aliases(self, node: Node) -> list[Node]:
        """``node`` first, then every node that may alias it, in graph order where known."""
        out = dict.fromkeys(views_of(node))
        key = storage_key(example_of(node))
        if key is not None:
            out.update(dict.fromkeys(self._by_storage.get(key, ())))
        return list(out)


# --------------------------------------------------------------------------------------------
# Writes
# --------------------------------------------------------------------------------------------

INPLACE_OPERATORS = frozenset(
    {
        operator.setitem,
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.imatmul,
    }
)
_INPLACE_DUNDER = re.compile(r"^__i[a-z]+__$")  # __iadd__, __imul__, ... (__init__ is no write: excluded below)


def _inplace_name(name: str) -> bool:
    """``add_``, ``copy_``, ``index_put_`` (not ``__dunder__``), or ``__iadd__``-style augmented assignment."""
    if name.endswith("_") and not name.endswith("__"):
        return True
    return bool(_INPLACE_DUNDER.match(name)) and name not in ("__init__", "__iter__", "__index__", "__int__")


def writes_into(user: Node, alias: Node) -> bool:
    """Does ``user`` write into ``alias`` (one of its arguments)?

    Recognized: ``out=`` (any nesting), ops whose schema marks the argument written (aten ``add_``,
    ``index_put_``, ``copy_``, mutating custom ops), in-place methods and functions (``x.add_()``,
    ``torch.relu_(x)``, ``x.copy_(y)``, ``x.__iadd__(y)``), ``operator.iadd`` and friends (``x += 1``),
    ``x[i] = v`` (``operator.setitem``), and ``inplace=True`` (``F.relu(x, inplace=True)``).
    """
    if alias in flat_nodes(user.kwargs.get("out")):
        return True
    if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload):
        return _schema_writes(user.target, user, alias)
    if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverloadPacket):
        # a packet says nothing until an overload is chosen, unless it has only one (custom ops called as
        # ``torch.ops.ns.op(out, x)``, as vLLM's are): that one's schema says what it writes, in whichever
        # argument (vLLM's CPU all-reduce ``torch.ops._C.shm_allreduce(handle, data)`` writes its second)
        only = user.target.overloads()
        if len(only) == 1:
            return _schema_writes(getattr(user.target, only[0]), user, alias)
        return bool(user.args) and user.args[0] is alias and _inplace_name(op_name(user.target).name)
    if not user.args or user.args[0] is not alias:
        return False
    if user.op == "call_method":
        return isinstance(user.target, str) and _inplace_name(user.target)
    if user.op != "call_function":
        return False
    if user.target in INPLACE_OPERATORS or user.kwargs.get("inplace") is True:
        return True
    return _inplace_name(op_name(user.target).name)


def _schema_writes(op: torch._ops.OpOverload, user: Node, alias: Node) -> bool:
    """Does ``user`` (a call of ``op``) pass ``alias`` as an argument that ``op``'s schema marks written?"""
    schema = op._schema
    if schema.is_mutable:
        for i, arg in enumerate(schema.arguments):
            value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
            if alias in flat_nodes(value) and arg.alias_info is not None and arg.alias_info.is_write:
                return True
    return False


def is_noop_data_swap(node: Node) -> bool:
    """Is ``node`` ``t.data = t.to(...)`` where the ``to`` changes nothing (same dtype, device,
    shape and strides, no ``copy=True``)? ``Tensor.to`` then returns ``t`` itself, so the swap gives
    ``t`` its own data back: no write. Dynamo records ``module.to(dtype)`` on a module that already
    has that dtype this way (``nn.Module._apply`` sets ``param.data``), for example the router of
    transformers' NLLB-MoE and Switch, which casts its classifier on every forward."""
    if node.op != "call_function" or not isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    name = op_name(node.target)  # by name: aten.shallow_copy_data_ exists only from torch 2.14 (Dynamo's op)
    if (name.namespace, name.name) != ("aten", "shallow_copy_data_"):
        return False
    if len(node.args) != 2 or not isinstance(node.args[0], Node):
        return False
    dst, src = node.args
    if src is dst:
        return True
    if not isinstance(src, Node) or not src.args or src.args[0] is not dst or src.kwargs.get("copy"):
        return False
    if not (src.op == "call_method" and src.target == "to") and src.target is not torch.Tensor.to:
        return False
    if any(a is True for a in src.args[1:]):  # copy=True (or non_blocking) given positionally: not proven
        return False
    a, b = example_of(dst), example_of(src)
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def find_write(node: Node, index: AliasIndex | None = None) -> tuple[Node, Node] | None:
    """The first ``(writer, alias)`` where ``writer`` writes into ``node`` or a view of it, or None.
    With an :class:`AliasIndex`, nodes sharing ``node``'s storage count as views too."""
    return next(iter_writes(node, index), None)


def iter_writes(node: Node, index: AliasIndex | None = None) -> Iterator[tuple[Node, Node]]:
    """Every ``(writer, alias)`` where ``writer`` writes into ``node`` or a view of it (aliases as for
    :func:`find_write`), alias by alias: an ``out=`` / mutating op filling a buffer allocated earlier
    (``torch.empty`` then ``op(out, ...)``), in-place updates, ``x[i] = v``."""
    aliases = index.aliases(node) if index is not None else views_of(node)
    for alias in aliases:
        for user in alias.users:
            if writes_into(user, alias):
                yield user, alias


# --------------------------------------------------------------------------------------------
# Where in the user's code a node came from
# --------------------------------------------------------------------------------------------

_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)(?:, in (.+?))?\s*$')
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MODELS_DIR = os.path.join(_PACKAGE_DIR, "models") + os.sep  # graphpass's bundled models are user code


@dataclass(frozen=True)
class SourceFrame:
    """The innermost user frame of a node's stack trace."""

    file: str  # basename of the file
    line: int
    code: str = ""  # that line's code, when the trace shows it
    function: str = ""  # the function the frame is in, when the trace names it

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def torch_relative(path: str) -> str | None:
    """``path`` (a source file, as a frame names it) relative to torch's package folder (``_dynamo/utils.py``), links
    resolved; None for a file outside torch."""
    real, root = os.path.realpath(path), os.path.realpath(_TORCH_DIR) + os.sep
    return real[len(root) :] if real.startswith(root) else None


def _internal(path: str) -> bool:
    return path.startswith(_TORCH_DIR) or (path.startswith(_PACKAGE_DIR) and not path.startswith(_MODELS_DIR))


# Bounded: traces repeat across nodes of one graph, and a long-lived process sees many graphs.
@functools.lru_cache(maxsize=4096)
def _frame_of_trace(trace: str) -> SourceFrame | None:
    lines = trace.splitlines()
    best = None
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if not m or _internal(os.path.abspath(m.group(1))):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
        best = SourceFrame(os.path.basename(m.group(1)), int(m.group(2)), code, m.group(3) or "")
    return best


def source_frame(node: Node) -> SourceFrame | None:
    """The innermost frame of ``node``'s stack trace outside torch and graphpass (graphpass's
    bundled models count as user code), or None when the node carries no trace."""
    trace = node.meta.get("stack_trace") or ""
    return _frame_of_trace(trace) if trace else None


@functools.lru_cache(maxsize=4096)
def _functions_of_trace(trace: str) -> frozenset[tuple[str, str]]:
    out = set()
    for line in trace.splitlines():
        m = _FRAME.match(line)
        if m and m.group(3):
            out.add((os.path.abspath(m.group(1)).replace(os.sep, "/"), m.group(3)))
    return frozenset(out)


def ran_inside(node: Node, path_suffix: str, function: str) -> bool:
    """Whether ``node`` was traced while ``function`` of a file whose path ends with ``path_suffix``
    (``"transformers/integrations/moe.py"``) was on the Python stack (read off its stack trace)."""
    return ran_inside_file(node, path_suffix, function) is not None


def ran_inside_file(node: Node, path_suffix: str, function: str) -> str | None:
    """Like :func:`ran_inside`, but the absolute path of the matching file (``None``: not inside), so a
    caller can read the function's source."""
    trace = node.meta.get("stack_trace") or ""
    if not trace:
        return None
    for p, f in _functions_of_trace(trace):
        if f == function and (p == path_suffix or p.endswith("/" + path_suffix)):
            return p
    return None


def ran_inside_path(node: Node, path_suffix: str) -> bool:
    """Whether any function of a file whose path ends with ``path_suffix`` was on the Python stack when
    ``node`` was traced (read off its stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    return any(p == path_suffix or p.endswith("/" + path_suffix) for p, _ in _functions_of_trace(trace))


# --------------------------------------------------------------------------------------------
# Symbolic sizes
# --------------------------------------------------------------------------------------------


_SIZE_CANON: contextvars.ContextVar[Callable[[sympy.Basic], sympy.Basic] | None] = contextvars.ContextVar(
    "graphpass_size_canon", default=None
)


@contextlib.contextmanager
def canonical_sizes(canon: Callable[[sympy.Basic], sympy.Basic] | None) -> Iterator[None]:
    """Within the block, :func:`size_expr` returns ``canon(expr)`` (the padding proof's sizes under what Dynamo's
    guards require of the length: ``padding_proof.guards``); None: as traced."""
    token = _SIZE_CANON.set(canon)
    try:
        yield
    finally:
        _SIZE_CANON.reset(token)


def size_expr(size: Any) -> sympy.Expr:
    """A size (int, SymInt, SymFloat, a node holding one, a sympy expression) as a sympy expression
    (in the canonical form set by :func:`canonical_sizes`, if any)."""
    size = example_of(size)
    if isinstance(size, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        expr = sympy.sympify(size.node.expr)
    elif isinstance(size, bool):
        return sympy.Integer(int(size))
    else:
        expr = sympy.sympify(size)
    canon = _SIZE_CANON.get()
    return canon(expr) if canon is not None else expr


def shape_env_hints(env: Any) -> dict:
    """Symbol -> the value it had when traced (``backed_var_to_val``; older torch: ``var_to_val``,
    a deprecated alias once the new name exists, so it is read only when the new one is missing)."""
    hints = getattr(env, "backed_var_to_val", None)
    if hints is None:
        hints = getattr(env, "var_to_val", {})
    return hints


def size_range(expr: Any, env: Any = None, upper: "Mapping[str, int] | None" = None) -> tuple[Any, Any]:
    """The lower and upper end of a size expression (an int, a SymInt, a sympy expression) over its symbols'
    ranges: each symbol's range in the shape env ``env`` (``var_to_range``; ``[0, oo]`` when it has none),
    narrowed by ``upper`` (symbol name -> a largest value, e.g. the largest bucket). Torch's own value-range
    analysis (``bound_sympy``) computes it, so it is sound where the expression decreases too. The ends are sympy
    numbers; an unbounded end is ``int_oo`` / ``-int_oo``."""
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    expr = size_expr(expr)
    if not expr.free_symbols:
        return expr, expr
    known = getattr(env, "var_to_range", None) or {}
    ranges = {}
    for s in expr.free_symbols:
        vr = known.get(s)
        if vr is None:
            vr = next((r for k, r in known.items() if str(k) == str(s)), None)
        if vr is None:
            vr = ValueRanges(0, sympy.oo)
        if upper and str(s) in upper:
            vr = vr & ValueRanges(vr.lower, upper[str(s)])
        ranges[s] = vr
    vr = bound_sympy(expr, ranges)
    return vr.lower, vr.upper


def is_symbolic(size: Any) -> bool:
    return isinstance(example_of(size), (torch.SymInt, torch.SymFloat, torch.SymBool))


def mentions_symbol(value: Any, names: frozenset[str]) -> bool:
    """Whether a size / scalar (int, SymInt, SymFloat, SymBool, sympy expression) mentions one of
    the symbols named in ``names`` (matched by name: ``sympy.Symbol("s27")`` finds Dynamo's ``s27``)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        value = value.node.expr
    if isinstance(value, sympy.Basic):
        return any(str(s) in names for s in value.free_symbols)
    return False


# --------------------------------------------------------------------------------------------
# Model structure
# --------------------------------------------------------------------------------------------


def numbered_containers(paths: Iterable[str]) -> dict[str, list[str]]:
    """Containers of numbered children among module paths: ``layers.3.mlp`` gives ``layers`` ->
    ``[layers.3]`` (and ``layers.3.experts.1`` also ``layers.3.experts`` -> ``[...experts.1]``)."""
    out: dict[str, dict[str, None]] = {}
    for path in paths:
        segs = path.split(".") if path else []
        for j, seg in enumerate(segs):
            if seg.isdigit():
                out.setdefault(".".join(segs[:j]), {})[".".join(segs[: j + 1])] = None
    return {c: list(children) for c, children in out.items()}


def _dot_prefixes(path: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``: the paths ``path`` lies under."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def repeated_blocks(paths: Iterable[str], weights: Iterable[tuple[int, Iterable[str]]]) -> tuple[str | None, list[str]]:
    """The repeated blocks: among the containers of numbered children in ``paths``, the one whose
    children hold the most weight bytes, and its children (in first-seen order).

    ``weights``: ``(nbytes, module paths that hold or read it)`` per distinct tensor; a tensor
    counts once for a container when any of its paths lies under one of the container's children.
    Ties go to the container with more children, then to the shorter (outer) name. This is the
    one rule both the default traps (:mod:`graphpass.passes.assign_traps`) and the offload
    planner (:mod:`graphpass.offloading.planning`) use.
    """
    candidates = numbered_containers(paths)
    if not candidates:
        return None, []
    score = dict.fromkeys(candidates, 0)
    container_of: dict[str, list[str]] = {}  # child -> the containers listing it
    for c, children in candidates.items():
        for ch in children:
            container_of.setdefault(ch, []).append(c)
    for nbytes, owners in weights:
        # a path lies under a child when it is the child or inside it, i.e. the child is one of its
        # dot-prefixes: looked up, not tested against every child of every container (quadratic)
        hit = {c for o in owners for prefix in _dot_prefixes(o) for c in container_of.get(prefix, ())}
        for c in hit:
            score[c] += nbytes
    best = max(candidates, key=lambda c: (score[c], len(candidates[c]), -len(c)))
    return best, candidates[best]


def inner_tensor_fields(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Tensors a parameter or buffer carries as plain attributes (``weight.scale`` of a quantized
    weight), in attribute order. Private names (``_x``) are bookkeeping, not weights: skipped."""
    if not hasattr(t, "__dict__"):
        return []
    return [(k, v) for k, v in vars(t).items() if isinstance(v, torch.Tensor) and not k.startswith("_")]


def tensor_keys(t: Any) -> list[Hashable]:
    """Keys that identify the tensor object ``t`` and the memory it views (data pointer, shape,
    dtype, device): the same parameter reaches a compiled graph as itself or as another tensor
    object over the same memory (AOTAutograd, a delegate)."""
    keys: list[Hashable] = [("id", id(t))]
    try:
        if t.device.type != "meta" and not isinstance(t, torch._subclasses.FakeTensor):
            ptr = t.data_ptr()
            if ptr:
                keys.insert(0, ("ptr", ptr, tuple(t.shape), t.dtype, t.device))
    except Exception:  # a wrapper subclass without storage of its own: its identity only
        pass
    return keys


def owned_tensors(model: torch.nn.Module) -> dict[Hashable, list[str]]:
    """key -> FQNs for every parameter and buffer of ``model`` (tied ones under each name) and the
    inner tensors of tensor subclasses (a DTensor's local shard)."""
    out: dict[Hashable, list[str]] = {}

    def add(t: Any, fqn: str) -> None:
        for k in held_keys(t):
            names = out.setdefault(k, [])
            if fqn not in names:
                names.append(fqn)

    for fqn, p in model.named_parameters(remove_duplicate=False):
        add(p, fqn)
    for fqn, b in model.named_buffers(remove_duplicate=False):
        add(b, fqn)
    return out


def held_keys(t: Any, depth: int = 0) -> list[Hashable]:
    """:func:`tensor_keys` of a parameter or buffer ``t`` and of its inner tensors (a tensor
    subclass: a DTensor's local shard), nested up to 4 deep; ``[]`` for a non-tensor."""
    if not isinstance(t, torch.Tensor):
        return []
    keys = tensor_keys(t)
    if depth < 4:
        for _, inner in subclass_fields(t):
            keys += held_keys(inner, depth + 1)
    return keys


def tensor_at(model: torch.nn.Module, fqn: str) -> torch.Tensor | None:
    """The parameter or buffer ``model`` holds at ``fqn`` now (plain dict look-ups, no
    ``__getattr__``: cheap enough for every call of a capture op), or None."""
    *path, leaf = fqn.split(".")
    mod: Any = model
    for part in path:
        mod = mod._modules.get(part)
        if mod is None:
            return None
    t = mod._parameters.get(leaf)
    return t if t is not None else mod._buffers.get(leaf)


def holds_at(model: torch.nn.Module, fqn: str, t: torch.Tensor) -> bool:
    """Does ``model`` hold ``t`` (itself, or a tensor over the same memory, or as the inner tensor
    of a subclass) at ``fqn`` now? ``owned_tensors(model)[key]`` for one FQN, without the walk."""
    held = tensor_at(model, fqn)
    if held is None:
        return False
    if held is t:
        return True
    mine = held_keys(held)
    return any(k in mine for k in tensor_keys(t))


def relocated(name: str, owner_fqn: str, fqns: list[str]) -> list[str]:
    """Where module ``name`` sits now, when the weight traced at ``owner_fqn`` sits at ``fqns``:
    the same path relative to the module the two names have in common (a graph Dynamo traced for
    one block and runs for another). Every distinct candidate, in order; one is the answer."""
    n_parts, w_parts = name.split("."), owner_fqn.split(".")
    k = 0
    while k < min(len(n_parts), len(w_parts) - 1) and n_parts[k] == w_parts[k]:
        k += 1
    tail = ".".join(w_parts[k:])
    found = []
    for f in fqns:
        if f == tail:
            base = ""
        elif f.endswith("." + tail):
            base = f[: -len(tail) - 1]
        else:
            continue
        found.append(".".join(p for p in (base, *n_parts[k:]) if p))
    return list(dict.fromkeys(found))
