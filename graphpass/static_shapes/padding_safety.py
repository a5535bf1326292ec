"""Padding-safety analysis for static-shape bucketing.

Bucketing pads a varying input dim (the sequence length ``L`` of ``input_ids``, say) up to a bucket
size, runs the static graph compiled for that bucket and slices the outputs back. That is exact
only if **every output row along the padded dim depends only on the same input row**, with the
padding rows staying at the end of the dim. :func:`check_padding_safety` proves this for a
Dynamo-level graph with dynamic shapes, or names the nodes that break it.

The rule works on shapes alone. Every node's ``meta["example_value"]`` is a FakeTensor whose sizes
are SymInts; a dim *is padded* when its size expression mentions one of the given symbols
(``L``, ``2*L``, ``B*L``, ``L - 1``). For each op node the analysis looks at the padded dims of its
tensor inputs and output and at its arguments, and decides whether the op mixes rows along a
padded dim:

* **safe** -- pointwise ops (:data:`POINTWISE`), dim-wise layout ops (:data:`LAYOUT`), reshapes that
  keep rows apart (:data:`RESHAPES`, decided by :mod:`.padding_layout`), indexing that counts from
  the start of the padded dim, factories (:data:`FACTORIES`: ``arange(L)`` gives row ``i`` the
  value ``i`` with or without padding), size queries (:data:`META`), ops along / contracting /
  normalising over dims that are not padded, ``cat`` whose padded piece is the last one, ``stack``,
  causal ops (when ``causal_ok``: row ``i`` only reads rows ``<= i`` and the padding sits at the
  end, so real rows never read padding): ``scaled_dot_product_attention`` with ``is_causal``, the
  prefix scans of :data:`CAUSAL_SCANS` (``cumsum``: transformers' position and packed-sequence
  masks) and ``diff`` without ``append``, SymInt arithmetic (no tensor in or out), and graphpass's own
  ``torch.ops.graphpass.*`` markers.
* **a violation** -- any op of :data:`ALONG_DIM` (reductions, scans, sorts, flips, rolls, diffs,
  splits, gathers) along a padded dim, or over all dims when a dim is padded; a matmul-family op
  (:data:`MATMULS`) contracting over a padded dim; a normalisation (:data:`NORMS`) over a padded
  dim; non-causal attention over a padded key/value sequence; ``cat`` / ``repeat`` / ``pad`` that
  put something after the padding; indexing from the end of a padded dim or with a tensor along
  it; a reshape that scrambles rows; the padded length used as a *value* (``x * x.size(1)``); and
  every op not in these tables whose input or output has a padded dim or whose arguments mention
  a symbol -- conservative by design. Custom ops (OpOverloads outside ``aten``/``prims``) and
  higher-order ops count as unknown.

Op names are matched by their bare name, whichever way Dynamo records them: a callable
(``torch.softmax``, ``torch.nn.functional.softmax``, ``torch._C._nn.linear``, ``operator.matmul``),
a ``call_method`` name (``"softmax"``), or an aten OpOverload (``aten.sum.dim_IntList``); for
OpOverloads arguments are read by their schema names, so aten graphs work for the ops listed too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import operator

import sympy
import torch

from .buffer_masks import CausalTable, is_causal_table
from .causal_functions import causal_function_of, check_causal_edges
from .padding_layout import layout_sweep
from .position_tables import TableRead
from ..fx_utils import (example_of, flat_nodes, mentions_symbol, op_name, ran_inside_file, schema_position, size_expr,
                        size_range, source_frame, tensors_of, writes_into)
from ..tensor_utils import shape_env_of

if TYPE_CHECKING:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.node import Target

__all__ = ["PaddingViolation", "check_padding_safety", "padded_dims"]


@dataclass
class PaddingViolation:
    node: str  # FX node name
    op: str  # readable target, e.g. "torch.softmax", "aten.sum.dim_IntList", "Tensor.cumsum"
    dim: int | None  # the padded dim the op mixes along (None for full reductions)
    reason: str  # one line: "softmax along the padded dim mixes rows", ...
    source: str  # "file.py:LINE" from node.meta["stack_trace"] (basename), or ""

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        dim = "" if self.dim is None else f" (dim {self.dim})"
        return f"{self.node} [{self.op}]{dim}: {self.reason}{where}"


# --------------------------------------------------------------------------------------------
# Op tables (bare names; in-place variants "add_" and dunders "__add__" map to their base name)
# --------------------------------------------------------------------------------------------

_ALL = "all"  # an ALONG_DIM default: no dim given means every dim (a full reduction)

#: Elementwise ops (with broadcasting) and identity-like ops: row i of the output reads row i of
#: every input. ``tril``/``triu`` depend on the position only. Symbol-valued scalar arguments
#: (``x * L``) are still violations: the value changes with the padding.
POINTWISE: frozenset[str] = frozenset(
    """add sub subtract rsub mul multiply div divide true_divide truediv floor_divide floordiv mod
    remainder fmod pow float_power neg negative pos positive abs absolute sign sgn signbit reciprocal
    sqrt rsqrt square exp exp2 expm1 log log2 log10 log1p sin cos tan asin acos atan atan2 arctan2
    sinh cosh tanh asinh acosh atanh sigmoid logit erf erfc erfinv lerp addcmul addcdiv clamp clip
    clamp_min clamp_max maximum minimum fmax fmin floor ceil round trunc frac nan_to_num hypot xlogy
    copysign eq ne lt le gt ge greater greater_equal less less_equal not_equal logical_and logical_or
    logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not and_ or_ xor invert not_
    lshift rshift isnan isinf isfinite isclose where masked_fill relu relu6 gelu silu mish elu selu
    celu leaky_relu hardtanh hardswish hardsigmoid softplus softsign tanhshrink threshold logsigmoid log_sigmoid
    prelu dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout native_dropout
    to type type_as float double half bfloat16 int long short bool byte char cpu cuda detach clone
    contiguous requires_grad_ alias lift_fresh _to_copy fill_ zero_ copy_ tril triu real imag
    view_as_real view_as_complex polar complex""".split()
)

#: Dim-wise layout ops: they move or broadcast whole dims, so padding stays at the end of each.
LAYOUT: frozenset[str] = frozenset(
    "permute transpose swapaxes swapdims movedim moveaxis t adjoint unsqueeze squeeze expand "
    "expand_as broadcast_to stack".split()
)

#: Reshapes reinterpret the row-major element order: where each padded factor lands is :mod:`.padding_layout`'s.
RESHAPES: frozenset[str] = frozenset(
    "view reshape flatten unflatten view_as reshape_as _unsafe_view ravel".split()
)

#: Size queries and other ops without a tensor result that read only metadata.
META: frozenset[str] = frozenset(
    "size dim numel stride sym_size sym_numel sym_stride sym_storage_offset is_contiguous "
    "element_size get_device is_floating_point".split()
)

#: Factories: sizes may mention the padded length (row i of ``arange(L)`` is i either way); the
#: listed arguments are *values* and must not. name -> ((position, keyword), ...).
FACTORIES: Mapping[str, tuple[tuple[int, str], ...]] = MappingProxyType({
    **{n: () for n in "zeros ones empty rand randn zeros_like ones_like empty_like rand_like "
       "randn_like new_zeros new_ones new_empty eye".split()},
    "full": ((1, "fill_value"),),
    "full_like": ((1, "fill_value"),),
    "new_full": ((2, "fill_value"),),
    "arange": (),  # start / step are checked in _check_factory
})


@dataclass(frozen=True)
class _DimSpec:
    pos: int  # position of the dim argument (counting the tensor as 0); -1: keyword only
    kw: str  # keyword name of the dim argument
    default: int | str  # dim used when none is given; _ALL for every dim
    what: str  # the reason's wording


_MIX = "along the padded dim mixes rows"
_SPLIT = "along the padded dim: the pieces' boundaries move with the padding"
_GATHER = "along the padded dim reads rows chosen by tensor values"

#: Ops that combine or reorder values along ``dim``: unsafe when that dim is padded.
ALONG_DIM: Mapping[str, _DimSpec] = MappingProxyType({
    **{n: _DimSpec(1, "dim", _ALL, _MIX) for n in (
        "sum nansum mean nanmean prod amax amin max min all any argmax argmin count_nonzero var std "
        "var_mean std_mean logsumexp median nanmedian softmax log_softmax softmin _softmax "
        "_log_softmax cumsum cumprod cummax cummin logcumsumexp").split()},
    "aminmax": _DimSpec(-1, "dim", _ALL, _MIX),
    "norm": _DimSpec(2, "dim", _ALL, _MIX),
    "linalg_vector_norm": _DimSpec(2, "dim", _ALL, _MIX),
    "linalg_norm": _DimSpec(2, "dim", _ALL, _MIX),
    "normalize": _DimSpec(2, "dim", 1, _MIX),
    "quantile": _DimSpec(2, "dim", _ALL, _MIX),
    "nanquantile": _DimSpec(2, "dim", _ALL, _MIX),
    "sort": _DimSpec(1, "dim", -1, _MIX),
    "argsort": _DimSpec(1, "dim", -1, _MIX),
    "msort": _DimSpec(-1, "", 0, _MIX),
    "mode": _DimSpec(1, "dim", -1, _MIX),
    "topk": _DimSpec(2, "dim", -1, _MIX),
    "kthvalue": _DimSpec(2, "dim", -1, _MIX),
    "glu": _DimSpec(1, "dim", -1, _MIX),
    "flip": _DimSpec(1, "dims", _ALL, _MIX),
    "fliplr": _DimSpec(-1, "", 1, _MIX),
    "flipud": _DimSpec(-1, "", 0, _MIX),
    "roll": _DimSpec(2, "dims", _ALL, _MIX),
    "diff": _DimSpec(2, "dim", -1, _MIX),
    "split": _DimSpec(2, "dim", 0, _SPLIT),
    "split_with_sizes": _DimSpec(2, "dim", 0, _SPLIT),
    "tensor_split": _DimSpec(2, "dim", 0, _SPLIT),
    "chunk": _DimSpec(2, "dim", 0, _SPLIT),
    "unbind": _DimSpec(1, "dim", 0, _SPLIT),
    **{n: _DimSpec(1, "dim", _ALL, _GATHER) for n in (
        "index_select gather scatter scatter_add scatter_reduce index_add index_copy index_fill").split()},
    "take_along_dim": _DimSpec(2, "dim", _ALL, _GATHER),
})

#: Prefix scans: row i of the output reads rows <= i along the dim, so with ``causal_ok`` (the
#: padding at the end) real rows never read padding. ``diff`` reads rows i - 1 (``prepend``) or
#: i + 1 .. i + n of its input, never past the real rows for a real output row, unless it ``append``s.
CAUSAL_SCANS: frozenset[str] = frozenset("cumsum cumprod cummax cummin logcumsumexp diff".split())


#: Matmul-family ops, with the (argument position, keyword, dim) pairs they contract over. None:
#: decided from the operands' ranks (matmul) or the equation (einsum).
MATMULS: Mapping[str, tuple[tuple[int, str, int], ...] | None] = MappingProxyType({
    "linear": ((0, "input", -1), (1, "weight", -1)),
    "matmul": None,
    "mm": ((0, "input", -1), (1, "mat2", -2)),
    "bmm": ((0, "input", -1), (1, "mat2", -2)),
    "mv": ((0, "input", -1), (1, "vec", 0)),
    "dot": ((0, "input", 0), (1, "other", 0)),
    "vdot": ((0, "input", 0), (1, "other", 0)),
    "inner": ((0, "input", -1), (1, "other", -1)),
    "addmm": ((1, "mat1", -1), (2, "mat2", -2)),
    "baddbmm": ((1, "batch1", -1), (2, "batch2", -2)),
    "addbmm": ((1, "batch1", -1), (2, "batch2", -2), (1, "batch1", 0), (2, "batch2", 0)),
    "addmv": ((1, "mat", -1), (2, "vec", 0)),
    "outer": (),
    "ger": (),
    "einsum": None,
})

#: Normalisations, with the dims they compute statistics over ("trailing": the last
#: len(normalized_shape); "from1": dims 1..; "from2": dims 2..; "batch": all but 1, in training).
NORMS: Mapping[str, str] = MappingProxyType({
    "layer_norm": "trailing",
    "native_layer_norm": "trailing",
    "rms_norm": "trailing",
    "_fused_rms_norm": "trailing",
    "group_norm": "from1",
    "native_group_norm": "from1",
    "instance_norm": "from2",
    "batch_norm": "batch",
    "native_batch_norm": "batch",
    "_native_batch_norm_legit": "batch",
    "_native_batch_norm_legit_functional": "batch",
    "_native_batch_norm_legit_no_training": "batch",
})

#: Attention kernels (query, key, value first; ``is_causal`` by keyword or, for
#: ``torch.nn.functional.scaled_dot_product_attention``, at position 5).
ATTENTION: frozenset[str] = frozenset(
    "scaled_dot_product_attention _scaled_dot_product_flash_attention "
    "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_efficient_attention "
    "_scaled_dot_product_cudnn_attention _scaled_dot_product_attention_math".split()
)

#: Ops whose padding-safety depends on where they index, concatenate, repeat or pad.
INDEXING: frozenset[str] = frozenset("getitem setitem narrow select slice".split())
CONCAT: frozenset[str] = frozenset("cat concat concatenate".split())
REPEATS: frozenset[str] = frozenset("repeat tile repeat_interleave".split())
PADS: frozenset[str] = frozenset("pad constant_pad_nd".split())
EMBEDDINGS: frozenset[str] = frozenset("embedding".split())
#: 1-d convolutions: causal along the time dim when padded by at least (kernel - 1) * dilation.
CONVS: frozenset[str] = frozenset({"conv1d"})
#: ``Tensor.unfold(dim, size, step)``: sliding windows along a dim (a "valid" convolution's reads).
WINDOWS: frozenset[str] = frozenset({"unfold"})

_KNOWN: frozenset[str] = (
    POINTWISE | LAYOUT | RESHAPES | META | ATTENTION | INDEXING | CONCAT | REPEATS | PADS | EMBEDDINGS | CONVS | WINDOWS
    | frozenset(FACTORIES) | frozenset(ALONG_DIM) | frozenset(MATMULS) | frozenset(NORMS)
)

@dataclass(frozen=True)
class RowWiseFunction:
    """A library function trusted as row-wise as a whole: its code (with ``helpers``, the same file's module-level
    functions it calls) must have ``digest`` (:func:`.causal_functions.source_digest`), so an edited or vendored copy,
    or another release's, is checked op by op again; ``reason``: why every output row depends on its own row only."""

    digest: str
    reason: str
    helpers: tuple[str, ...] = ()


#: Library functions checked as a whole instead of op by op: every output row of each, along the padded dim,
#: depends only on the same rows of its inputs, for the reason given. Their inner ops (a sort of the tokens by expert,
#: gathers, a count per expert, grouped GEMMs, the inverse permutation) are not row-wise one by one, but the function
#: is. A node is trusted when it was traced inside one of them, its innermost frame is the function or one of its
#: helpers (not a model's own ``_apply_gate`` it calls), and the file's source has the digest. (path suffix,
#: function) -> the proven code.
ROW_WISE_FUNCTIONS: Mapping[tuple[str, str], RowWiseFunction] = MappingProxyType({
    ("transformers/integrations/moe.py", "grouped_mm_experts_forward"): RowWiseFunction(
        "4b3136e0cabfa5ba",
        "dropless top-k experts: the token-expert pairs are sorted by expert, each row is multiplied by its own "
        "expert's weights (the group offsets are counted from the same sorted rows), the inverse permutation puts "
        "every row back, and a token's k results are summed in its own row; no capacity, so no token is dropped "
        "because of another",
        helpers=("_grouped_linear", "_grouped_mm", "_can_use_grouped_mm", "_default_apply_gate")),
    ("transformers/integrations/moe.py", "batched_mm_experts_forward"): RowWiseFunction(
        "2d673d4ddafb277c",
        "dropless top-k experts: each token-expert pair is multiplied by its own gathered expert weights and a "
        "token's k results are summed in its own row",
        helpers=("_batched_linear", "_default_apply_gate")),
})


def _row_wise_function(node: torch.fx.Node) -> str | None:
    """The trusted row-wise function ``node`` was traced inside (its name), or None (see :data:`ROW_WISE_FUNCTIONS`)."""
    from .causal_functions import source_digest

    for (suffix, name), fn in ROW_WISE_FUNCTIONS.items():
        path = ran_inside_file(node, suffix, name)
        if path is None:
            continue
        frame = source_frame(node)
        if frame is None or frame.file != suffix.rsplit("/", 1)[-1] or frame.function not in (name, *fn.helpers):
            continue  # a model's own code called from inside it (an overridden _apply_gate): checked op by op
        if source_digest(path, name, fn.helpers) == fn.digest:
            return name
    return None


#: Namespaces whose OpOverloads are read through the tables above; graphpass's are always safe.
_TABLE_NAMESPACES = frozenset({"aten", "prims"})
_SAFE_NAMESPACES = frozenset({"graphpass"})
#: Modules a call_function callable may come from to be matched by name (else: unknown).
_KNOWN_MODULES = ("torch", "_operator", "operator", "math", "builtins")


# --------------------------------------------------------------------------------------------
# Public helpers
# --------------------------------------------------------------------------------------------


def _symbol_names(symbols: Iterable[Any]) -> frozenset[str]:
    # matched by name: a plain sympy.Symbol("s27") finds Dynamo's s27 (which has assumptions)
    return frozenset(str(s) for s in symbols)


def padded_dims(value: Any, symbols: Iterable[Any]) -> tuple[int, ...]:
    """The dims of a (Fake)Tensor -- or of an FX node's example value -- whose size mentions one
    of ``symbols``. Anything that is not a tensor has none."""
    value = example_of(value)
    if not isinstance(value, torch.Tensor):
        return ()
    names = _symbol_names(symbols)
    return tuple(d for d, s in enumerate(value.shape) if mentions_symbol(s, names))


# --------------------------------------------------------------------------------------------
# Reading nodes
# --------------------------------------------------------------------------------------------

_MISSING = object()
def _source(node: torch.fx.Node) -> str:
    """``file.py:LINE`` of the innermost user frame of the node's stack trace, or ``""``."""
    frame = source_frame(node)
    return str(frame) if frame is not None else ""


def _namespace(target: Target) -> str | None:
    """The library of an op overload or packet; None for anything else (a higher-order op included)."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op_name(target).namespace
    return None


def _label(node: torch.fx.Node) -> str:
    """A readable name for the node's target: torch.softmax, aten.sum.dim_IntList, Tensor.cumsum."""
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if node.op == "call_module":
        return f"module {t}"
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    name = op_name(t).name
    if not name:
        return repr(t)
    mod = getattr(t, "__module__", None)
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    if getattr(torch, name, None) is t:
        return f"torch.{name}"
    if getattr(torch.nn.functional, name, None) is t:
        return f"torch.nn.functional.{name}"
    if name.startswith("linalg_") and getattr(torch.linalg, name[7:], None) is t:
        return f"torch.linalg.{name[7:]}"
    if getattr(t, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase):
        return f"Tensor.{name}"
    return f"{mod}.{name}" if mod else name


def _base_name(name: str) -> str:
    """The table name of an in-place / reflected / dunder spelling: ``add_``, ``iadd``,
    ``__radd__``, ``__iadd__`` -> ``add``; ``__and__`` -> ``and_``. Other names unchanged."""
    core = name[2:-2] if name.startswith("__") and name.endswith("__") and len(name) > 4 else name
    candidates = [core, core + "_"]
    if core.endswith("_") and not core.startswith("_"):
        candidates.append(core[:-1])  # in-place method
    for c in candidates:
        if c in _KNOWN:
            return c
    if core[:1] in ("r", "i"):  # reflected / augmented elementwise: __rsub__, iadd
        for c in (core[1:], core[1:] + "_"):
            if c in POINTWISE:
                return c
    return core


def _op_name(node: torch.fx.Node) -> str | None:
    """The bare name the tables are keyed by, or None when the target is not one we may match
    by name (a custom op, a higher-order op, a module, a callable from elsewhere)."""
    t = node.target
    if node.op == "call_method":
        return _base_name(str(t))
    if node.op != "call_function":
        return None
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _base_name(op_name(t).name) if _namespace(t) in _TABLE_NAMESPACES else None
    if isinstance(t, torch._ops.HigherOrderOperator):
        return None
    name = op_name(t).name
    mod = getattr(t, "__module__", None)
    if not name:
        return None
    if mod is not None and not any(mod == m or mod.startswith(m + ".") for m in _KNOWN_MODULES):
        return None
    return _base_name(name)


def _arg(node: torch.fx.Node, pos: int, kw: str, default: Any = _MISSING) -> Any:
    """Argument ``kw`` of ``node``: by keyword, by schema position for OpOverloads that name it,
    else at ``pos`` (-1: keyword only). The tensor itself is position 0 (``self`` of call_method
    and of aten ops, ``input`` of torch functions)."""
    if kw and kw in node.kwargs:
        return node.kwargs[kw]
    if pos == 0:
        if node.args:
            return node.args[0]
        return next((node.kwargs[k] for k in ("input", "self") if k in node.kwargs), default)
    where = schema_position(node.target, kw) if kw else None
    if where is not None:
        pos = where
    if 0 <= pos < len(node.args):
        return node.args[pos]
    return default


def _leaves(value: Any) -> Iterable[Any]:
    """Every leaf of an argument structure (lists, tuples, dicts, slices)."""
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, slice):
        for v in (value.start, value.stop, value.step):
            yield from _leaves(v)
    else:
        yield value


def _iter_nodes(value: Any) -> Iterable[torch.fx.Node]:
    return (v for v in _leaves(value) if isinstance(v, torch.fx.Node))


def _iter_values(value: Any) -> Iterable[Any]:
    """Every leaf argument, with nodes replaced by their example values."""
    return (example_of(v) for v in _leaves(value))


def _is_tensor_arg(value: Any) -> bool:
    return isinstance(example_of(value), torch.Tensor)


def _dims(value: Any) -> list[int] | None:
    """A dim argument as a list of ints; None when it is not a static int / list of ints."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def _static_int(value: Any) -> int | None:
    """A plain int argument; None for anything else (SymInts included)."""
    value = example_of(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    return None


# --------------------------------------------------------------------------------------------
# The checks: each returns (dim, reason) for a violation, or None
# --------------------------------------------------------------------------------------------

_Finding = tuple[int | None, str]


@dataclass(frozen=True)
class _Ctx:
    names: frozenset[str]
    causal_ok: bool
    facts: Mapping[torch.fx.Node, Any] = field(default_factory=dict)  # index provenance (_Positions / _Causal)
    ties: Mapping[Any, Any] = field(default_factory=dict)  # symbol -> the padded symbol it equals on every call
    relied_on: set[str] = field(default_factory=set)  # zero-padded inputs an accepted proof needs to hold 1 (filled)
    trusted: set[str] = field(default_factory=set)  # causal functions checked as a whole (filled)
    table_reads: list[TableRead] = field(default_factory=list)  # static-size tables looked up by position (filled)

    def same_size(self, a: Any, b: Any) -> bool:
        return size_expr(a).xreplace(self.ties) == size_expr(b).xreplace(self.ties)

    def is_length(self, size: Any) -> bool:
        """``size`` is a padded length itself (a padded symbol, or one tied to it)."""
        expr = size_expr(size).xreplace(self.ties)
        return isinstance(expr, sympy.Symbol) and str(expr) in self.names

    def padded(self, value: Any) -> tuple[int, ...]:
        t = example_of(value)
        if not isinstance(t, torch.Tensor):
            return ()
        return tuple(d for d, s in enumerate(t.shape) if mentions_symbol(s, self.names))


def _value_use(node: torch.fx.Node, ctx: _Ctx, args: Iterable[Any] | None = None) -> _Finding | None:
    """A scalar argument that mentions a padded length: the op computes with the length itself."""
    leaves = _iter_values(list(node.args) + list(node.kwargs.values()) if args is None else list(args))
    for v in leaves:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Basic)) and mentions_symbol(v, ctx.names):
            expr = v.node.expr if hasattr(v, "node") else v
            return None, f"uses the padded length ({expr}) as a value"
    return None


def _check_along_dim(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
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
                and not _zero_padded_count(node, name, d, ctx):
            return d, f"{name} {spec.what}"
    return None


def _zero_padded_count(node: torch.fx.Node, name: str, d: int, ctx: _Ctx) -> bool:
    """``sum`` / ``count_nonzero`` / ``any`` along ``d`` of an integer or boolean tensor that is 0 at every padding
    row along ``d`` (a zero-padded input read in place, or a :class:`_ZeroPadIf`): the padding adds exact zeros,
    so the result is the unpadded one."""
    x = _arg(node, 0, "input")
    fact = ctx.facts.get(x) if isinstance(x, torch.fx.Node) else None
    t = example_of(x)
    if not ctx.causal_ok or name not in ("sum", "count_nonzero", "any") or not isinstance(fact, (_ZeroPad, _ZeroPadIf)) \
            or fact.dim != d \
            or not (t.dtype == torch.bool or _is_int_tensor(t)) or _arg(node, -1, "dtype", None) not in (None, torch.int64):
        return False
    if isinstance(fact, _ZeroPadIf):
        ctx.relied_on.update(fact.needs)
    return True


def _causal_scan(node: torch.fx.Node, name: str, ctx: _Ctx) -> bool:
    """A prefix scan (or ``diff`` without ``append``) where causal ops count as safe."""
    if not ctx.causal_ok or name not in CAUSAL_SCANS:
        return False
    return name != "diff" or _arg(node, 4, "append", None) is None


def _masked_softmax(node: torch.fx.Node, name: str, d: int, ctx: _Ctx) -> bool:
    """A softmax over the keys ``d`` of scores plus an additive causal mask (a :class:`_NegMask` on ``d``): every
    real row's later keys, the padding among them, get exactly 0, so the row equals the unpadded one. A
    ``logsumexp`` over the same keys (granite_swa's sink scale) is the log of that softmax's denominator: its max is
    the row's finite max (the diagonal), every fill value's ``exp`` is exactly 0, so it equals the unpadded row's."""
    if name == "logsumexp":
        name = "softmax"  # the same proof: a sum of exp(v - max) over the keys, exact zeros from the fill values
    x = _arg(node, 0, "input")
    fact = ctx.facts.get(x) if isinstance(x, torch.fx.Node) else None
    t = example_of(x)
    if isinstance(fact, _NegMask) and name in ("max", "amax") and fact.k == d and ctx.causal_ok:
        ctx.relied_on.update(fact.needs)
        return True  # a real row's max is a finite score (its diagonal): the fill values never win
    if isinstance(fact, _NegKeys) and name in _SOFTMAXES and fact.k == d:
        ctx.relied_on.update(fact.needs)
        return True  # every row's padding keys get exactly 0 (no causality needed)
    if not (ctx.causal_ok and name in _SOFTMAXES and isinstance(fact, _NegMask) and fact.k == d
            and ctx.same_size(t.shape[fact.q], size_expr(t.shape[fact.k]) - fact.tail)):
        return False
    ctx.relied_on.update(fact.needs)
    return True


def _causal_product(node: torch.fx.Node, name: str, ctx: _Ctx) -> bool:
    """``matmul`` / ``bmm`` of attention weights that are 0 at every key after the query (a :class:`_ZeroAbove`
    on dims -2, -1) with the values: a real row reads value rows up to its own only."""
    a, b = _arg(node, 0, "input"), _arg(node, 1, "other" if name == "matmul" else "mat2", None)
    fact = ctx.facts.get(a) if isinstance(a, torch.fx.Node) else None
    ta, tb = example_of(a), example_of(b)
    if isinstance(fact, _ZeroKeys) and name in ("matmul", "bmm") and isinstance(tb, torch.Tensor) and tb.dim() >= 2 \
            and fact.k == ta.dim() - 1:
        ctx.relied_on.update(fact.needs)
        return True  # the padding value rows are multiplied by exact zeros
    if not (ctx.causal_ok and name in ("matmul", "bmm") and isinstance(fact, _ZeroAbove) and fact.tail == 0
            and isinstance(tb, torch.Tensor)
            and tb.dim() >= 2 and (fact.q, fact.k) == (ta.dim() - 2, ta.dim() - 1)
            and ctx.same_size(ta.shape[-2], ta.shape[-1])):
        return False
    ctx.relied_on.update(fact.needs)
    return True


def _check_matmul(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
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


def _check_einsum(node: torch.fx.Node, ctx: _Ctx) -> _Finding | None:
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


def _check_norm(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
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


def _check_attention(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
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
                break  # row i sees rows <= i; the padding sits after every real row
            if _pad_keys_masked(mask, ctx):
                break  # the mask is False at every padding key (ANDed with a zero-padded attention mask)
            if ctx.causal_ok and not causal and _additive_causal_mask(mask, q, t, ctx):
                break  # a float mask adding <= -1e30 at every later key: softmax weight exactly 0 there
            why = " without is_causal or a mask proven causal" if ctx.causal_ok else ""
            return t.dim() - 2, "attention over the padded sequence" + why
    return _value_use(node, ctx)


def _rows_aligned(q: Any, k: Any, ctx: _Ctx) -> bool:
    """Causality along the padded dim needs the query and key rows to line up: query ``i`` may see keys ``j <= i``,
    and that keeps a real query row off the padding keys only when there are at least as many real keys as real
    queries. Both rows start at row 0 of their tensors (anything else is refused where it is sliced), so that holds
    when both dims have the same padded length (the same size expression). A key tensor that is a shifted slice of
    the queries' rows (``h[:, :, 1:]``, ``L - 1`` rows against ``L``) or static queries over padded keys do not."""
    return isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2 and k.dim() >= 2 \
        and ctx.same_size(q.shape[-2], k.shape[-2])


def _additive_causal_mask(mask: Any, q: Any, k: Any, ctx: _Ctx) -> bool:
    """A float ``attn_mask`` that is a :class:`_NegMask` on its last two dims (queries, keys), sized like the
    query and key sequences: the kernel adds it to the finite scores, so every real query row ``i`` gets a value
    ``<= -1e30`` at each key ``j > i`` (the padding keys among them) and a finite one on its diagonal; the softmax
    weight of every later key is then exactly 0, as in the hand-written softmax the :class:`_NegMask` proof covers
    (doge's dynamic mask: ``dt_states.masked_fill(mask != 0, finfo.min)``)."""
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    m = example_of(mask)
    if not (isinstance(fact, _NegMask) and fact.tail == 0 and isinstance(m, torch.Tensor) and m.dim() >= 2
            and m.dtype in _NEG_MASK_DTYPES and (fact.q, fact.k) == (m.dim() - 2, m.dim() - 1)
            and isinstance(q, torch.Tensor) and q.dim() >= 2 and isinstance(k, torch.Tensor) and k.dim() >= 2
            and ctx.same_size(m.shape[-2], q.shape[-2]) and ctx.same_size(m.shape[-1], k.shape[-2])
            and _rows_aligned(q, k, ctx)):
        return False
    ctx.relied_on.update(fact.needs)
    return True


def _starts_at_zero(start: Any, size: Any, ctx: _Ctx) -> bool:
    """``x[-n:]`` where ``n`` is the dim's own length (transformers trims a mask to the last
    ``inputs_embeds.shape[1]`` positions): the slice starts at row 0 whatever the padding."""
    v = example_of(start)
    if size is None or not isinstance(v, torch.SymInt):
        return False
    return ctx.same_size(-size_expr(v), size)


def _bad_start(start: Any, ctx: _Ctx) -> str | None:
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


def _check_getitem(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
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


def _masked_scalar_write(node: torch.fx.Node, t: torch.Tensor, idx: Any, ctx: _Ctx) -> bool:
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
    node: torch.fx.Node, name: str, t: torch.Tensor, pads: tuple[int, ...], ctx: _Ctx
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


def _bad_index(item: Any, ctx: _Ctx, size: Any = None) -> str | None:
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
            if isinstance(f, (_NegMask, _ZeroAbove)):
                if f.tail > 0:
                    todo.append(u)
                continue  # tail 0: the slice that dropped the sink columns
            if _op_name(u) in ("max", "amax") and all(
                    all(isinstance(facts.get(w), _NegMask) and facts[w].tail > 0 for w in g.users)
                    for g in (list(u.users) if _op_name(u) == "max" else [u])):
                continue  # the row max, subtracted from the same rows
            return False
    return True


def _check_cat(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
    fact = ctx.facts.get(node)
    if isinstance(fact, _NegMask) and fact.tail > 0 and ctx.causal_ok and _tail_closed(node, ctx.facts):
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


def _check_repeat(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
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
            # merge of a static dim into the padded one that the layout sweep follows (llama4's MoE repeats
            # the tokens once per expert and views them back as [experts, tokens, hidden])
            continue
        if c != 1:
            return d, f"{name} along the padded dim puts padding in the middle"
    return None


def _check_pad(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
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


def _check_embedding(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
    table = _arg(node, 1, "weight", None)
    w = example_of(table)
    if isinstance(w, torch.Tensor) and w.dim() and 0 in ctx.padded(w):
        return 0, "embedding looks up rows of a table along the padded dim"
    if isinstance(w, torch.Tensor) and w.dim():
        _note_table_read(node, _arg(node, 0, "input", None), table, w.shape[0], ctx)
    return None


def _note_table_read(node: torch.fx.Node, index: Any, table: Any, rows: Any, ctx: _Ctx) -> None:
    """Record a lookup of a static-size table (``rows`` along the looked-up dim) by a position index (its value
    at row ``i`` is ``i + offset``): its padding rows read past the table at a bucket too long for it
    (:mod:`.position_tables`)."""
    fact = ctx.facts.get(index) if isinstance(index, torch.fx.Node) else None
    rows = _static_int(rows)
    if not isinstance(fact, _Positions) or fact.base is not None or rows is None:
        return
    length = size_expr(example_of(index).shape[fact.dim])
    if not mentions_symbol(length, ctx.names):
        return
    where = _source(node)
    ctx.table_reads.append(TableRead(f"{_label(node)} at node {node.name}{f' ({where})' if where else ''}",
                                     getattr(table, "name", str(table)), rows, length - 1 + fact.offset))


def _check_conv1d(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
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


def _unsliced_extra_rows(node: torch.fx.Node, dim: int, length: Any, ctx: _Ctx) -> torch.fx.Node | None:
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


def _prefix_slice_of(node: torch.fx.Node, dim: int, length: Any, ctx: _Ctx) -> bool:
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


def _check_unfold(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
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


def _check_reshape(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
    """Reshapes are decided by the layout sweep (:mod:`.padding_layout`): where each padded factor lands, and
    whether the rows come back in the same order. Here only a reshape whose sizes are values of the length."""
    return None


def _along_dims(node: torch.fx.Node, name: str | None) -> list[int] | None:
    """The dims an op of :data:`ALONG_DIM` combines values along (every dim when none is given), or None for
    another op (read as :func:`_check_along_dim` reads them)."""
    if name not in ALONG_DIM:
        return None
    t = example_of(_arg(node, 0, "input"))
    if not isinstance(t, torch.Tensor):
        return None
    if name in ("max", "min") and _is_tensor_arg(_arg(node, 1, "other", None)):
        return []
    spec = ALONG_DIM[name]
    raw = _arg(node, spec.pos, spec.kw, _MISSING)
    if node.op == "call_method" and name == "flip" and len(node.args) > 2:
        raw = list(node.args[1:])
    if raw is _MISSING or raw is None or isinstance(raw, bool):
        raw = spec.default
    dims = None if isinstance(raw, str) else _dims(raw)
    if not dims:
        return list(range(t.dim()))
    return [_norm_dim(d, t.dim()) for d in dims]


#: Ops that may read a padded dim whose rows are interleaved with another dim's (after a reshape merged them): they
#: treat every index of that dim alike (their own rules still refuse them along it).
_ROW_WISE_ANY_LAYOUT = POINTWISE | frozenset(NORMS) | frozenset(ALONG_DIM) | META | frozenset(FACTORIES) | frozenset(
    {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "stack"})


def _check_factory(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
    if name == "arange":
        if isinstance(node.target, torch._ops.OpOverload):
            values = [_arg(node, -1, "start", None), _arg(node, -1, "step", None)]
        else:
            values = [node.args[0], *node.args[2:3]] if len(node.args) >= 2 else []
            values += [node.kwargs.get("start"), node.kwargs.get("step")]
        return _value_use(node, ctx, values)
    return _value_use(node, ctx, [_arg(node, pos, kw, None) for pos, kw in FACTORIES[name]])


def _check_pointwise(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding | None:
    if name == "where" and len(node.args) + len(node.kwargs) < 3:
        return None, "where(cond) returns indices of true values: cannot prove row independence"
    return _value_use(node, ctx)


def _handler(name: str) -> Callable[[torch.fx.Node, str, _Ctx], _Finding | None] | None:
    if name in POINTWISE:
        return _check_pointwise
    if name in LAYOUT or name in META:
        return lambda node, name, ctx: None
    if name in RESHAPES:
        return _check_reshape
    if name in FACTORIES:
        return _check_factory
    if name in ALONG_DIM:
        return _check_along_dim
    if name in MATMULS:
        return _check_matmul
    if name in NORMS:
        return _check_norm
    if name in ATTENTION:
        return _check_attention
    if name in INDEXING:
        return _check_getitem
    if name in CONCAT:
        return _check_cat
    if name in REPEATS:
        return _check_repeat
    if name in PADS:
        return _check_pad
    if name in EMBEDDINGS:
        return _check_embedding
    if name in CONVS:
        return _check_conv1d
    if name in WINDOWS:
        return _check_unfold
    return None


# --------------------------------------------------------------------------------------------
# Padding rows written into a tensor that is not padded (a key/value cache's slots)
# --------------------------------------------------------------------------------------------

#: Ops that write rows of a tensor into another one: name -> (position, keyword) of the written rows.
ROW_WRITES: Mapping[str, tuple[int, str]] = MappingProxyType({
    "index_copy": (3, "source"), "index_add": (3, "source"), "index_put": (2, "values"), "scatter": (3, "src"),
    "scatter_add": (3, "src"), "scatter_reduce": (3, "src"), "setitem": (2, "value"), "masked_scatter": (2, "source"),
})
#: Ops a read of the written slots may go through before the attention that masks them: they keep the
#: slot dim and the last dim as the last two (views, broadcasts, copies).
_SLOT_KEEPS = frozenset("contiguous clone to _to_copy detach alias".split())


def _check_row_write(node: torch.fx.Node, name: str, ctx: _Ctx) -> _Finding:
    """``buf.index_copy_(d, slots, rows)`` with ``rows`` padded along ``d`` and ``buf`` not: the padding
    rows land in slots of a tensor that outlives them in this graph. Safe only when ``slots`` are the
    positions ``X + i`` (``X`` a 0-d run-time offset, or 0) and every later read of ``buf`` is the
    keys or values of an attention whose mask is proven true only where ``slot <= query index + X``:
    a real query row ``i < L`` then sees slots ``<= X + i < X + L``, never the padding rows' slots
    ``X + L ..``. Anything else is a violation (the rows would be read as data)."""
    dst, src = node.args[0], _arg(node, *ROW_WRITES[name], None)
    dim = _static_int(_arg(node, 1, "dim", None)) if name == "index_copy" else None
    t_dst, t_src = example_of(dst), example_of(src)
    if dim is None or not isinstance(t_dst, torch.Tensor) or ctx.padded(src) != (dim % t_src.dim(),):
        return None, f"{_label(node)} writes padding rows into {_label(dst)}, which is not padded: later reads may see them"
    index = _arg(node, 2, "index", None)
    fact = ctx.facts.get(index) if isinstance(index, torch.fx.Node) else None
    if not isinstance(fact, _Positions) or fact.offset != 0 or dim % t_dst.dim() != t_dst.dim() - 2:
        return dim, (f"{_label(node)} writes padding rows into {_label(dst)} at slots not proven to be "
                     f"positions after the real rows' (an arange plus a run-time offset, along the slot dim -2)")
    bad = _unmasked_slot_read(node, dst, fact.base, ctx)
    if bad is not None:
        return dim, (f"{_label(node)} writes padding rows into {_label(dst)}, and {_label(bad)} reads those slots "
                     f"without an attention mask proven to hide every slot past a query's position")
    return None


def _unmasked_slot_read(write: torch.fx.Node, buf: torch.fx.Node, shift: str | None, ctx: _Ctx) -> torch.fx.Node | None:
    """The first read of ``buf`` after ``write`` that is not proven blind to the slots past each real
    query's position, or None. Reads before the write see none of the written rows."""
    order = {n: i for i, n in enumerate(write.graph.nodes)}
    todo = [u for u in list(buf.users) + list(write.users) if u is not write and order[u] > order[write]]
    seen: set[torch.fx.Node] = set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        name = _op_name(node) if node.op in ("call_function", "call_method") else None
        if name in ATTENTION:
            if not _masks_slots(node, seen, shift, ctx):
                return node
            continue
        if not _keeps_slots(node, name):
            return node
        todo.extend(node.users)
    return None


def _keeps_slots(node: torch.fx.Node, name: str | None) -> bool:
    """``node`` keeps its input's last two dims (slots, features) as its own last two, row for row."""
    src, out = node.args[0] if node.args else None, example_of(node)
    t = example_of(src)
    if not isinstance(t, torch.Tensor) or not isinstance(out, torch.Tensor) or t.dim() < 2 or out.dim() < 2:
        return False
    same_tail = [size_expr(s) for s in t.shape[-2:]] == [size_expr(s) for s in out.shape[-2:]]
    if name in _SLOT_KEEPS or name in ("expand", "expand_as", "broadcast_to"):
        return same_tail and out.dim() >= t.dim()
    if name in RESHAPES and name not in ("transpose", "permute", "movedim", "swapaxes", "t"):
        return same_tail  # row-major: equal trailing sizes => only the leading dims are regrouped
    if name == "getitem":
        idx = node.args[1] if len(node.args) > 1 else None
        items = list(idx) if isinstance(idx, tuple) else [idx]
        if not all(i is None or i is Ellipsis or i == slice(None) for i in items):
            return False
        where = _view_map(items, t.dim())
        return where is not None and (where(t.dim() - 2), where(t.dim() - 1)) == (out.dim() - 2, out.dim() - 1)
    return False


def _masks_slots(node: torch.fx.Node, reached: set[torch.fx.Node], shift: str | None, ctx: _Ctx) -> bool:
    """An attention reading the slots (as keys or values only) with a boolean mask proven true only
    where ``key slot <= query index + shift``."""
    if _arg(node, 0, "query") in reached:
        return False
    mask = _arg(node, 3, "attn_mask", None)
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    t = example_of(mask)
    return isinstance(fact, _Causal) and fact.shift == shift and isinstance(t, torch.Tensor) \
        and t.dtype == torch.bool and (fact.q, fact.k) == (t.dim() - 2, t.dim() - 1) \
        and _arg(node, 5, "is_causal", False) is not True


def _check_node(node: torch.fx.Node, ctx: _Ctx) -> _Finding | None:
    if node.op in ("placeholder", "output", "get_attr"):
        return None
    if node.op == "call_function" and _namespace(node.target) in _SAFE_NAMESPACES:
        return None  # graphpass's own markers: no outputs, run-time side effects only
    if _row_wise_function(node) is not None:
        return None  # inside a library function that is row-wise as a whole (its proven source)
    causal_fn = causal_function_of(node) if ctx.causal_ok else None
    if causal_fn is not None:  # inside a proven causal scan: only its edges are checked
        ctx.trusted.add(causal_fn)
        return check_causal_edges(node, causal_fn, ctx.padded, ctx.is_length)
    inputs = [n for n in _iter_nodes((node.args, node.kwargs))]
    tensor_in = [n for n in inputs if tensors_of(n)]
    tensor_out = tensors_of(node)
    if not tensor_in and not tensor_out:
        return None  # SymInt / SymFloat arithmetic, size queries of nothing, asserts
    padded_in = any(ctx.padded(t) for n in tensor_in for t in tensors_of(n))
    padded_out = any(ctx.padded(t) for t in tensor_out)
    if not padded_in and not padded_out and _value_use(node, ctx) is None:
        return None  # nothing padded goes in, comes out, or is used as a value
    name = _op_name(node)
    if name in ROW_WRITES and ctx.padded(_arg(node, *ROW_WRITES[name], None)) and not ctx.padded(node.args[0]):
        return _check_row_write(node, name, ctx)
    handler = _handler(name) if name is not None else None
    if handler is None:
        return None, f"unknown op {_label(node)}: cannot prove row independence"
    return handler(node, name, ctx)


# --------------------------------------------------------------------------------------------
# Index provenance: position tensors and causal masks
# --------------------------------------------------------------------------------------------
#
# transformers builds its attention masks from position indices: ``q = arange(L)[None, None, :, None]``,
# ``kv = arange(L)[None, None, None, :]``, ``position_ids[batch, q]`` and ``kv <= q``. Two facts,
# computed in one forward sweep over the graph, let the checks above accept them:
#
# * :class:`_Positions`: an integer tensor whose value at index ``i`` along one dim is ``i + offset``
#   whatever the other indices (``arange``, and what views, ``+ c`` and indexing by positions keep).
#   Indexing a padded dim of length ``n`` with positions ``0 .. n - 1`` reads row ``i`` into row ``i``.
# * :class:`_Causal`: a boolean tensor that is true only where the index along dim ``k`` is at most
#   the index along dim ``q`` (``kv <= q`` on positions with equal offsets, and anything ANDed with
#   such a mask). As an attention mask (queries on dim -2, keys on dim -1) it lets a real query row
#   ``i < L`` see keys ``j <= i`` only, so never the padding at the end: the same proof as ``is_causal``.
#
# Positions may carry a run-time offset (``base``: a 0-d length tensor added to them, a cache's slots); a causal
# fact then carries it as ``shift`` (``j <= i + X``) and is never plain causal nor proven on its diagonal
# (``diag``), which the additive-mask facts (:class:`_NegMask` ...) need.


@dataclass(frozen=True)
class _Positions:
    dim: int  # value at index i along dim == i + offset (+ base), whatever the other indices
    offset: int
    base: str | None = None  # a 0-d integer tensor (node name) added to every position: a run-time offset


@dataclass(frozen=True)
class _Causal:
    q: int  # true only where index along k <= index along q (+ the value of shift)
    k: int
    shift: str | None = None  # a 0-d integer tensor (node name): the query's positions start there
    # true on the diagonal (k == q) of every real row when the named zero-padded inputs hold 1 at every real
    # position (checked per call by the dispatcher); None: not proven
    diag: frozenset[str] | None = None


@dataclass(frozen=True)
class _Diag:
    a: int  # true on the diagonal (index along a == index along b), when the named inputs hold 1 (as _Causal.diag)
    b: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _AllTrue:
    """A boolean tensor true everywhere (``new_ones((), dtype=torch.bool)``, where transformers' ``and_masks`` starts)."""


@dataclass(frozen=True)
class _ZeroPad:
    dim: int  # every padding row along dim holds 0 / False (an input the dispatcher pads with 0, and what keeps that)
    source: str | None = None  # the placeholder whose values it holds, read in place (None: combined with others)


@dataclass(frozen=True)
class _NegMask:
    """A float tensor (scores plus an additive mask) whose every real row ``i`` along ``q`` holds a value
    ``<= -1e30`` at each key ``j > i`` along ``k`` and a moderate one (a finite score, not a fill value) at
    ``j == i`` when the ``needs`` inputs hold 1: a softmax over ``k`` gives exactly 0 at ``j > i``."""
    q: int
    k: int
    needs: frozenset[str] = frozenset()
    pure: bool = False  # the mask alone (where(mask, 0, fill)): exactly 0 on the diagonal, given needs
    tail: int = 0  # static columns of finite values (attention sinks) appended after the keys along k


@dataclass(frozen=True)
class _MaskedAbove:
    """A boolean tensor true at every key ``j > i`` along ``k`` of every real row ``i`` along ``q`` and false on
    the diagonal when the ``needs`` inputs hold 1: the negation of a :class:`_Causal` mask, as ``masked_fill`` takes it."""
    q: int
    k: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _KeysOnly:
    """A boolean tensor false at every padding row along ``dim`` (the keys) and true at every real one when the
    ``needs`` inputs hold 1: a bidirectional mask of a zero-padded attention mask."""
    dim: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _NegKeys:
    """A float tensor holding a value ``<= -1e30`` at every padding key along ``k`` and a finite score at every
    real key when the ``needs`` inputs hold 1 (scores plus the additive form of a :class:`_KeysOnly`)."""
    k: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _ZeroKeys:
    """A float tensor exactly 0 at every padding key along ``k`` (a softmax over ``k`` of a :class:`_NegKeys`)."""
    k: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _ZeroAbove:
    """A float tensor exactly 0 at every key ``j > i`` along ``k`` of every real row ``i`` along ``q`` (a softmax
    of a :class:`_NegMask`): a product contracting ``k`` reads no row after ``i``."""
    q: int
    k: int
    needs: frozenset[str] = frozenset()
    tail: int = 0  # as _NegMask.tail: dropped by a slice [..., :-tail] before any product


@dataclass(frozen=True)
class _OnePad:
    """A number tensor exactly 1 at every padding row along ``dim`` and 0 at every real one when the ``needs``
    inputs hold 1: ``1.0 - m`` of a zero-padded input read in place (the legacy additive mask
    ``(1.0 - attention_mask[:, None, None, :]) * finfo.min`` of GPT-1 and other pre-``masking_utils`` models)."""
    dim: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _PadCount:
    """An integer tensor holding, at every padding row along ``dim``, the number of real rows (>= 1) when the
    ``needs`` inputs hold 1 at every real position: the running count ``cumsum`` of a zero-padded mask."""
    dim: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class _Const:
    """A tensor holding ``value`` at every element, whatever the padding (``zeros_like(x)``, what compares, selects
    and indexes keep of it): GIT's text-only ``token_type_ids`` and the block ids and block mask built from them."""
    value: bool | int | float


@dataclass(frozen=True)
class _ZeroPadIf:
    """A tensor that is 0 / False at every padding row along ``dim`` when the ``needs`` inputs hold 1 at every
    real position (``cumsum(mask) == 0``: transformers' count of left-padding tokens)."""
    dim: int
    needs: frozenset[str] = frozenset()


#: Each fact's dim fields, renumbered by :func:`_moved`.
_FACT_DIMS: Mapping[type, tuple[str, ...]] = MappingProxyType({
    _Positions: ("dim",), _Causal: ("q", "k"), _Diag: ("a", "b"), _AllTrue: (), _ZeroPad: ("dim",),
    _NegMask: ("q", "k"), _MaskedAbove: ("q", "k"), _ZeroAbove: ("q", "k"), _KeysOnly: ("dim",), _NegKeys: ("k",),
    _ZeroKeys: ("k",), _OnePad: ("dim",), _Const: (), _PadCount: ("dim",), _ZeroPadIf: ("dim",)})
#: Facts about two different dims (they must stay different).
_PAIR_FACTS = (_Causal, _Diag, _NegMask, _MaskedAbove, _ZeroAbove)
#: A fill value this negative (or -inf) vanishes from a softmax next to any finite score, in fp32 and bf16.
_HUGE = 1e30


#: Ops that keep every value and dim (dtype and device conversions, copies).
_KEEPS = frozenset("to type long int bool float double bfloat16 half clone contiguous detach alias lift_fresh _to_copy".split())
#: Comparisons as (flip operands, strict): a < b, a <= b, a > b == b < a, a >= b == b <= a.
_COMPARES = MappingProxyType({"le": (False, False), "lt": (False, True), "ge": (True, False), "gt": (True, True),
                              "less_equal": (False, False), "less": (False, True), "greater_equal": (True, False),
                              "greater": (True, True)})
_ANDS = frozenset("and_ logical_and bitwise_and mul".split())


def _moved(fact: Any, where: Callable[[int], int | None]) -> Any:
    """``fact`` with its dims renumbered by ``where`` (None: a dim that does not survive)."""
    fields = _FACT_DIMS.get(type(fact))
    if fields is None:
        return None
    dims = {f: where(getattr(fact, f)) for f in fields}
    if any(d is None for d in dims.values()):
        return None
    if isinstance(fact, _PAIR_FACTS) and len(set(dims.values())) < 2:
        return None
    return replace(fact, **dims)


def _aligned(fact: Any, src: Any, out: torch.Tensor) -> Any:
    """``fact`` of ``src`` on the dims of a broadcast result ``out`` (dims align from the right)."""
    t = example_of(src)
    if fact is None or not isinstance(t, torch.Tensor) or t.dim() > out.dim():
        return None
    return _moved(fact, lambda d: d + out.dim() - t.dim())


def _is_int_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and not t.dtype.is_complex \
        and t.dtype != torch.bool


def _arange_fact(node: torch.fx.Node, out: torch.Tensor) -> Any:
    """``arange(n)`` / ``arange(c, c + n)`` with a static integer start and step 1."""
    if out.dim() != 1 or not _is_int_tensor(out):
        return None
    args = [a for a in node.args]
    start = node.kwargs.get("start", args[0] if len(args) >= 2 else 0)
    step = node.kwargs.get("step", args[2] if len(args) >= 3 else 1)
    start, step = _static_int(start), _static_int(step)
    return _Positions(0, start) if start is not None and step == 1 else None


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


def _gather_fact(src: torch.fx.Node, items: list[Any], facts: Mapping[torch.fx.Node, Any], out: torch.Tensor,
                 ties: Mapping[Any, Any] = MappingProxyType({})) -> Any:
    """``src[i0, i1, ...]`` with integer tensor indices on its leading dims (advanced indexing)."""
    fact = facts.get(src)
    lead = 0
    while lead < len(items) and _is_int_tensor(example_of(items[lead])):
        lead += 1
    if not isinstance(fact, (_Positions, _ZeroPad)) or lead == 0 or any(i not in (Ellipsis,) and not (
            isinstance(i, slice) and i == slice(None)) for i in items[lead:]):
        return None
    nb = out.dim() - (example_of(src).dim() - lead)  # the broadcast index dims come first
    if fact.dim >= lead:
        return _moved(fact, lambda d: nb + d - lead)
    index = items[fact.dim]
    inner = facts.get(index) if isinstance(index, torch.fx.Node) else None
    if not isinstance(inner, _Positions):
        return None
    at = inner.dim + nb - example_of(index).dim()
    if isinstance(fact, _ZeroPad):  # rows 0 .. n - 1 read in place: the padding rows stay the zero rows
        same = inner.offset == 0 and inner.base is None and size_expr(example_of(index).shape[inner.dim]).xreplace(ties) == size_expr(
            example_of(src).shape[fact.dim]).xreplace(ties)
        return _ZeroPad(at, fact.source) if same else None
    if fact.base is not None and inner.base is not None:
        return None  # two run-time offsets: not one named base
    return _Positions(at, fact.offset + inner.offset, fact.base or inner.base)


def _getitem_fact(node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor,
                  ties: Mapping[Any, Any] = MappingProxyType({})) -> Any:
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
    if isinstance(fb, _Positions) and fb.base is None and _static_int(a) is not None:  # c <= i + offset, i >= 0
        return _AllTrue() if _static_int(a) <= fb.offset - (1 if strict else 0) else None
    if not (isinstance(fa, _Positions) and isinstance(fb, _Positions)) or fa.dim == fb.dim:
        return None
    # true => j + fa.offset <= i + fb.offset (- 1 when strict) => j <= i when the slack is <= 0
    slack = fb.offset - fa.offset - (1 if strict else 0)
    if fa.base == fb.base:  # the same run-time offset on both sides cancels
        # on the diagonal (j == i) it is true exactly when the slack is >= 0
        if slack <= 0:
            return _Causal(q=fb.dim, k=fa.dim, diag=frozenset() if slack == 0 else None)
        return _Diag(fa.dim, fb.dim)
    # key slots from 0 against query positions that start at a run-time offset X: j <= i + X (the diagonal is
    # not proven: X's sign is not known here)
    return _Causal(q=fb.dim, k=fa.dim, shift=fb.base) if fa.base is None and slack <= 0 else None


def _diag_needs(fact: Any, pair: frozenset[int]) -> frozenset[str] | None:
    """The inputs that must hold 1 for ``fact``'s tensor to be true on the diagonal of the dims ``pair``,
    or None when that is not proven."""
    if isinstance(fact, _AllTrue):
        return frozenset()
    if isinstance(fact, _Causal) and fact.diag is not None and {fact.q, fact.k} == pair:
        return fact.diag
    if isinstance(fact, _Diag) and {fact.a, fact.b} == pair:
        return fact.needs
    if isinstance(fact, _ZeroPad) and fact.source is not None and fact.dim in pair:
        return frozenset({fact.source})  # holds the input's value at (.., i): true there when it is 1
    return None


def _keys_only(found: list[Any], dim: int) -> Any:
    """The AND of all-true tensors and zero-padded inputs read in place along ``dim`` (transformers' bidirectional
    mask): false at every padding key, true at every real one when those inputs hold 1."""
    needs: set[str] = set()
    for f in found:
        if isinstance(f, (_ZeroPad, _KeysOnly)) and f.dim == dim and getattr(f, "source", "") is not None:
            needs |= {f.source} if isinstance(f, _ZeroPad) else f.needs
        elif not isinstance(f, _AllTrue):
            return None
    return _KeysOnly(dim, frozenset(needs))


def _and_fact(node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """An AND only removes true entries: causal when any operand is (zero at the padding when any operand
    is); true on the diagonal when every operand is."""
    if out.dtype != torch.bool:
        return None
    operands = list(_leaves(node.args))
    found = [_aligned(facts.get(a), a, out) if isinstance(a, torch.fx.Node) else (_AllTrue() if a is True else None)
             for a in operands]
    causal = min((f for f in found if isinstance(f, _Causal)), key=lambda f: f.shift is not None, default=None)
    pairs = {frozenset({f.q, f.k}) if isinstance(f, _Causal) else frozenset({f.a, f.b})
             for f in found if isinstance(f, (_Causal, _Diag))}
    diag: frozenset[str] | None = None
    if len(pairs) == 1:
        needs = [_diag_needs(f, next(iter(pairs))) for f in found]
        diag = frozenset().union(*needs) if all(n is not None for n in needs) else None
    if causal is not None:
        return replace(causal, diag=diag)  # an unshifted operand's, when any: the tighter bound
    zero = next((f for f in found if isinstance(f, (_ZeroPad, _KeysOnly))), None)
    if zero is not None:
        return _keys_only(found, zero.dim) or _ZeroPad(zero.dim)
    if diag is not None:
        a, b = sorted(next(iter(pairs)))
        return _Diag(a, b, diag)
    return _AllTrue() if found and all(isinstance(f, _AllTrue) for f in found) else None


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
    dims = [getattr(fact, f) for f in _FACT_DIMS.get(type(fact), ())]
    if not dims:
        return None
    tail = t.dim() - min(dims)  # the trailing dims the fact is about
    if tail > out.dim() or [size_expr(s) for s in t.shape[t.dim() - tail:]] != [
            size_expr(s) for s in out.shape[out.dim() - tail:]]:
        return None
    return _moved(fact, lambda d: d + out.dim() - t.dim())


_NEG_MASK_DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # float16 overflows a mask value plus a score to -inf
_ALL_TRUE_FACTORIES = frozenset("new_ones ones ones_like".split())
_NOTS = frozenset("logical_not bitwise_not invert not_".split())


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
_SOFTMAXES = frozenset("softmax _softmax".split())
_BOUNDED = _SOFTMAXES | {"sigmoid"}  # values in [0, 1] whatever the input: never a fill value


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
                isinstance(a, torch.fx.Node) and a in huge for a in (_arg(node, i, kw, None) for i, kw in (
                    (0, "query"), (1, "key"), (2, "value")))):
            continue  # softmax weights times the values: a fill value in the mask does not reach the result
        leaves = list(_leaves((node.args, node.kwargs)))
        if any(_huge_value(v) or (isinstance(v, torch.fx.Node) and v in huge) for v in leaves):
            huge.add(node)
    return huge


def _mask_fact(node: torch.fx.Node, name: str, facts: Mapping[torch.fx.Node, Any], huge: set[torch.fx.Node],
               out: torch.Tensor) -> Any:
    """The additive-mask facts: ``where(causal, score, fill)`` and ``score + mask`` (a :class:`_NegMask`), a softmax
    of one over its keys (a :class:`_ZeroAbove`)."""
    if name == "where" and len(node.args) == 3 and out.dtype in _NEG_MASK_DTYPES:
        cond, keep, fill = (_aligned(facts.get(a), a, out) if isinstance(a, torch.fx.Node) else None for a in node.args)
        fill_value = node.args[2]
        huge_fill = (isinstance(fill_value, (int, float)) and not isinstance(fill_value, bool)
                     and fill_value <= -_HUGE) or (isinstance(fill_value, torch.fx.Node) and fill_value in huge
                                                   and fill_value.op == "call_function" and _is_negative_constant(fill_value))
        keep_ok = not (isinstance(node.args[1], torch.fx.Node) and node.args[1] in huge) and not _huge_value(node.args[1])
        if isinstance(cond, _Causal) and cond.diag is not None and huge_fill and keep_ok:
            return _NegMask(cond.q, cond.k, cond.diag, pure=_is_zero(node.args[1]))
        if isinstance(cond, _KeysOnly) and huge_fill and keep_ok:
            return _NegKeys(cond.dim, cond.needs)
        return None
    if name == "masked_fill" and len(node.args) == 3 and out.dtype in _NEG_MASK_DTYPES:
        x, cond, fill = node.args
        fact = _aligned(facts.get(cond), cond, out) if isinstance(cond, torch.fx.Node) else None
        x_ok = isinstance(x, torch.fx.Node) and x not in huge
        if isinstance(fact, _MaskedAbove) and x_ok and isinstance(fill, (int, float)) and fill <= -_HUGE:
            return _NegMask(fact.q, fact.k, fact.needs)
        return None
    if name == "cat":
        return _sink_cat_fact(node, facts, huge, out)
    if name in ("max", "maximum") and len(node.args) == 2 and all(isinstance(a, torch.fx.Node) for a in node.args):
        for m, c in (node.args, node.args[::-1]):  # max(scores + mask, full((), finfo.min)): xglm's clamp
            fact = _aligned(facts.get(m), m, out)
            if isinstance(fact, _NegMask) and _is_negative_constant(c):
                return fact  # the fill values stay <= -1e30, the finite scores are unchanged
        return None
    if name == "sub" and len(node.args) == 2 and isinstance(node.args[0], torch.fx.Node):
        fact = facts.get(node.args[0])
        if isinstance(fact, _NegMask) and _row_max_of(node.args[1], node.args[0], fact.k):
            return fact  # minus the row's own max (finite for a real row): the fill values stay <= -1e30
        return None
    if name == "add" and len(node.args) == 2 and out.dtype in _NEG_MASK_DTYPES and "alpha" not in node.kwargs:
        both = _neg_mask_sum(node, facts, out)
        if both is not None:
            return both
        for m, x in (node.args, node.args[::-1]):
            fact = _aligned(facts.get(m), m, out) if isinstance(m, torch.fx.Node) else None
            if isinstance(fact, (_NegMask, _NegKeys)) and isinstance(x, torch.fx.Node) and x not in huge \
                    and isinstance(example_of(x), torch.Tensor) and example_of(x).dtype.is_floating_point:
                return replace(fact, pure=False) if isinstance(fact, _NegMask) else fact  # plus scores: not 0 on the diagonal
        return None
    if name in _SOFTMAXES:
        src = node.args[0]
        fact = facts.get(src) if isinstance(src, torch.fx.Node) else None
        dim = _static_int(_arg(node, 1, "dim", None))
        if isinstance(fact, _NegMask) and dim is not None and _norm_dim(dim, out.dim()) == fact.k:
            return _ZeroAbove(fact.q, fact.k, fact.needs, fact.tail)
        if isinstance(fact, _NegKeys) and dim is not None and _norm_dim(dim, out.dim()) == fact.k:
            return _ZeroKeys(fact.k, fact.needs)
    return None


def _neg_mask_sum(node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """``a + b`` of two :class:`_NegMask` on the same dims (GPT-Neo: ``where(tril_buffer, scores, min)`` plus
    transformers' additive mask): at a key after a real row's query both are ``<= -1e30``, so their sum is (or is
    ``-inf``, whose softmax weight is 0 as well); on the diagonal both are finite, so the sum is (exactly 0 when both
    are 0). Needs every input either needs."""
    a, b = (_aligned(facts.get(x), x, out) if isinstance(x, torch.fx.Node) else None for x in node.args)
    if not (isinstance(a, _NegMask) and isinstance(b, _NegMask)) or (a.q, a.k) != (b.q, b.k) or a.tail or b.tail:
        return None
    return _NegMask(a.q, a.k, a.needs | b.needs, pure=a.pure and b.pure)


def _row_max_of(value: Any, src: torch.fx.Node, k: int) -> bool:
    """``value`` is ``src.max(dim=k, keepdim=True).values`` (or ``amax``)."""
    if not isinstance(value, torch.fx.Node):
        return False
    if value.op == "call_function" and value.target in (operator.getitem, getattr) and len(value.args) == 2 \
            and value.args[1] in (0, "values") and isinstance(value.args[0], torch.fx.Node):
        value = value.args[0]
        if _op_name(value) != "max":
            return False
    elif _op_name(value) != "amax":
        return False
    t = example_of(src)
    dim = _static_int(_arg(value, 1, "dim", None))
    return value.args[0] is src and dim is not None and _norm_dim(dim, t.dim()) == k and _arg(value, 2, "keepdim", False) is True


def _sink_cat_fact(node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], huge: set[torch.fx.Node], out: torch.Tensor) -> Any:
    """``cat([scores + mask, sinks], dim=k)``: static columns of finite values after the masked keys."""
    pieces = _arg(node, 0, "tensors", ())
    d = _static_int(_arg(node, 1, "dim", 0))
    if not isinstance(pieces, (list, tuple)) or len(pieces) < 2 or d is None or not isinstance(pieces[0], torch.fx.Node):
        return None
    fact = facts.get(pieces[0])
    if not (isinstance(fact, _NegMask) and fact.tail == 0 and _norm_dim(d, out.dim()) == fact.k):
        return None
    widths = [_static_int(example_of(p).shape[fact.k]) if isinstance(example_of(p), torch.Tensor) else None for p in pieces[1:]]
    if any(w is None for w in widths) or any(p in huge for p in pieces[1:]):
        return None
    return replace(fact, tail=sum(widths), pure=False)


def _is_negative_constant(node: torch.fx.Node) -> bool:
    """``torch.tensor(v)`` / ``full(..., v)`` with a static ``v <= -1e30``: a fill value."""
    values = [v for v in _leaves((node.args, node.kwargs)) if isinstance(v, float)]
    return _op_name(node) in ("tensor", "full", "scalar_tensor") and bool(values) and all(v <= -_HUGE for v in values)


def _keeps(fact: Any, out: torch.Tensor) -> bool:
    """Whether a dtype conversion to ``out``'s dtype keeps ``fact``."""
    if isinstance(fact, _Positions):
        return _is_int_tensor(out)
    if isinstance(fact, (_Causal, _Diag, _AllTrue, _MaskedAbove, _KeysOnly)):
        return out.dtype == torch.bool
    if isinstance(fact, (_NegMask, _NegKeys)):
        return out.dtype in _NEG_MASK_DTYPES
    if isinstance(fact, (_ZeroAbove, _ZeroKeys)):
        return out.dtype.is_floating_point
    if isinstance(fact, _OnePad):
        return out.dtype != torch.bool and not out.dtype.is_complex
    if isinstance(fact, _PadCount):  # a count up to the length: integer types whose range _values_fit checks
        return out.dtype in _INT_DTYPES
    return True


def _count_fact(node: torch.fx.Node, name: str, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """``cumsum`` of a zero-padded input read in place along its padded dim (a :class:`_PadCount`), and that count
    compared equal to 0 (a :class:`_ZeroPadIf`): llama4's chunked mask counts left-padding tokens as
    ``(attention_mask.cumsum(-1) == 0).sum(-1)``."""
    src = node.args[0] if node.args else None
    fact = facts.get(src) if isinstance(src, torch.fx.Node) else None
    if name == "cumsum" and isinstance(fact, _ZeroPad) and fact.source is not None and _is_int_tensor(out):
        d = _static_int(_arg(node, 1, "dim", None))
        if d is not None and _norm_dim(d, out.dim()) == fact.dim:
            return _PadCount(fact.dim, frozenset({fact.source}))  # padding row: the sum of the real rows, L >= 1
        return None
    if name == "eq" and out.dtype == torch.bool and len(node.args) == 2:
        for a, b in (node.args, node.args[::-1]):
            f = _aligned(facts.get(a), a, out) if isinstance(a, torch.fx.Node) else None
            if isinstance(f, _PadCount) and _is_zero(b):
                return _ZeroPadIf(f.dim, f.needs)
    return None


def _fact_of(node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], huge: set[torch.fx.Node] = frozenset(),
             ties: Mapping[Any, Any] = MappingProxyType({}), upper: Mapping[str, int] | None = None) -> Any:
    """The fact of ``node``'s value, or None. An integer fact (positions, a pad count) is kept only where every value
    it stands for fits the node's dtype at every size (:func:`_values_fit`): a fact derived in a wider type, or in
    this one before it wrapped, says nothing about a value that wrapped (``arange(L).to(torch.int8)`` past 127)."""
    fact = _derive_fact(node, facts, huge, ties)
    if isinstance(fact, (_Positions, _PadCount)) and not _values_fit(fact, example_of(node), upper):
        return None
    return fact


#: The integer dtypes whose every value a 64-bit index holds exactly (a position or count that fits survives).
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64)


def _values_fit(fact: Any, out: Any, upper: Mapping[str, int] | None) -> bool:
    """Whether every value ``fact`` says ``out`` holds lies in ``out``'s dtype at every size the graph runs at.

    :class:`_Positions` holds ``i + offset`` at index ``i < n`` (``n`` the size of its dim) plus a run-time ``base``;
    :class:`_PadCount` holds counts ``0 .. n``. The ends come from torch's value-range analysis
    (:func:`~graphpass.fx_utils.size_range`) over the symbols' ranges, capped by ``upper`` (symbol name -> the largest
    bucket, the largest size a padded call runs at). A run-time base has no known range: only ``int64`` keeps it."""
    if not isinstance(out, torch.Tensor) or out.dtype not in _INT_DTYPES:
        return False
    if out.dtype == torch.int64:
        return True  # no size reaches 2**63
    if getattr(fact, "base", None) is not None:
        return False
    n = size_expr(out.shape[fact.dim])
    if isinstance(fact, _Positions):
        lo, hi = size_range(n - 1 + fact.offset, shape_env_of(out), upper)
        lo = min(lo, fact.offset)
    else:
        lo, hi = 0, size_range(n, shape_env_of(out), upper)[1]
    info = torch.iinfo(out.dtype)
    try:
        return bool(lo >= info.min) and bool(hi <= info.max)
    except TypeError:  # an end sympy cannot order (a symbol left over)
        return False


def _derive_fact(node: torch.fx.Node, facts: Mapping[torch.fx.Node, Any], huge: set[torch.fx.Node] = frozenset(),
                 ties: Mapping[Any, Any] = MappingProxyType({})) -> Any:
    out = example_of(node)
    name = _op_name(node) if node.op in ("call_function", "call_method") else None
    if name is None or not isinstance(out, torch.Tensor):
        return None
    if name == "arange":
        return _arange_fact(node, out)
    const = _const_fact(node, name, facts, out)
    if const is not None:
        return const
    if name == "getitem":
        return _getitem_fact(node, facts, out, ties)
    if name in ("sub", "rsub", "mul"):
        found = _legacy_key_mask_fact(node, name, facts, out)
        if found is not None:
            return found
    if name in _COMPARES:
        return _compare_fact(node, name, facts, out)
    if name in _ANDS:
        return _and_fact(node, facts, out)
    counted = _count_fact(node, name, facts, out)
    if counted is not None:
        return counted
    if name in _ALL_TRUE_FACTORIES and out.dtype == torch.bool:
        return _AllTrue()
    if name in ("where", "add", "sub", "masked_fill", "cat", "max", "maximum") or name in _SOFTMAXES:
        found = _mask_fact(node, name, facts, huge, out)
        if found is not None or name not in ("add", "sub", "max"):
            return found
    src = node.args[0] if node.args else None
    fact = facts.get(src) if isinstance(src, torch.fx.Node) else None
    if fact is None:
        return None
    if name in ("add", "sub") and isinstance(fact, _Positions) and _is_int_tensor(out):
        c = _static_int(node.args[1]) if len(node.args) > 1 else None
        if c is None and name == "add" and fact.base is None and len(node.args) > 1:
            base = _scalar_tensor_root(node.args[1])  # + a 0-d integer tensor (a cache's length)
            return None if base is None else _aligned(_Positions(fact.dim, fact.offset, base), src, out)
        return None if c is None else _aligned(
            _Positions(fact.dim, fact.offset + (c if name == "add" else -c), fact.base), src, out)
    if isinstance(fact, _Causal) and fact.diag is not None and name in _NOTS:
        return _MaskedAbove(fact.q, fact.k, fact.diag)
    if isinstance(fact, _NegMask) and fact.pure and out.dtype == torch.bool and name in ("ne", "not_equal") \
            and len(node.args) == 2 and _is_zero(node.args[1]):
        return _aligned(_MaskedAbove(fact.q, fact.k, fact.needs), src, out)  # mask != 0: what .bool() gives (doge)
    if isinstance(fact, _NegMask) and fact.pure and out.dtype == torch.bool and name in _KEEPS:
        return _aligned(_MaskedAbove(fact.q, fact.k, fact.needs), src, out)  # nonzero: the fill values
    if name in _KEEPS or (name == "dropout" and isinstance(fact, (_ZeroAbove, _ZeroKeys))):  # dropout keeps zeros zero
        return _aligned(fact, src, out) if _keeps(fact, out) and example_of(src).dim() == out.dim() else None
    if name in ("expand", "expand_as", "broadcast_to"):
        return _aligned(fact, src, out)
    if name == "unsqueeze":
        at = _static_int(_arg(node, 1, "dim", None))
        return None if at is None else _moved(fact, lambda d: d + (d >= at % out.dim()))
    if name in RESHAPES:
        return _reshape_fact(src, fact, out)
    return None


def _legacy_key_mask_fact(node: torch.fx.Node, name: str, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """``1 - m`` (``rsub(m, 1)``) of a zero-padded input ``m`` read in place: a :class:`_OnePad` (1 at the padding,
    ``1 - m`` elsewhere, so 0 where ``m`` holds 1); that times a static fill ``<= -1e30``: a :class:`_NegKeys` (the
    fill at every padding key, ``-0.0`` at every real key where ``m`` holds 1)."""
    if len(node.args) != 2 or node.kwargs or out.dtype == torch.bool or out.dtype.is_complex:
        return None
    a, b = node.args
    if name in ("sub", "rsub"):
        one, m = (a, b) if name == "sub" else (b, a)
        fact = _aligned(facts.get(m), m, out) if isinstance(m, torch.fx.Node) else None
        if isinstance(one, (int, float)) and not isinstance(one, bool) and one == 1 \
                and isinstance(fact, _ZeroPad) and fact.source is not None:
            return _OnePad(fact.dim, frozenset({fact.source}))
        return None
    for x, c in ((a, b), (b, a)):
        fact = _aligned(facts.get(x), x, out) if isinstance(x, torch.fx.Node) else None
        if isinstance(fact, _OnePad) and isinstance(c, (int, float)) and not isinstance(c, bool) and c <= -_HUGE \
                and out.dtype in _NEG_MASK_DTYPES:
            return _NegKeys(fact.dim, fact.needs)
    return None


_CONST_FACTORIES = MappingProxyType({"zeros": 0, "zeros_like": 0, "new_zeros": 0, "ones": 1, "ones_like": 1, "new_ones": 1})
_CONST_FILLS = MappingProxyType({"full": 1, "full_like": 1, "new_full": 2})  # name -> position of the fill value
#: Ops whose every output element is an element of their first input (views, copies, indexing, gathers).
_CONST_KEEPS = frozenset("getitem expand expand_as broadcast_to unsqueeze squeeze permute transpose view reshape "
                         "flatten contiguous clone detach alias select narrow slice index_select".split()) | _KEEPS
_CONST_COMPARES = MappingProxyType({"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
                                    "gt": operator.gt, "ge": operator.ge})


def _const_value(value: Any, facts: Mapping[torch.fx.Node, Any]) -> tuple[bool, Any]:
    """``(True, v)`` when ``value`` is a static number or a node holding :class:`_Const` ``v``."""
    if isinstance(value, torch.fx.Node):
        fact = facts.get(value)
        if isinstance(fact, _AllTrue):
            return True, True
        return (True, fact.value) if isinstance(fact, _Const) else (False, None)
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
    return None if v is None else _Const(v)


def _const_fact(node: torch.fx.Node, name: str, facts: Mapping[torch.fx.Node, Any], out: torch.Tensor) -> Any:
    """:class:`_Const` facts: constant factories, what keeps a constant's elements, compares and ``where`` of
    constants, ``x & False``; ``x | False`` is ``x`` (any fact of ``x``, broadcast). Complex dtypes are left alone."""
    if out.dtype.is_complex:
        return None
    args = node.args
    if name in _CONST_FACTORIES:
        value = _cast(_CONST_FACTORIES[name], out.dtype)
        return None if value is True else _Const(value)  # an all-true one is an _AllTrue (and_masks' start)
    if name in _CONST_FILLS:
        ok, v = _const_value(_arg(node, _CONST_FILLS[name], "fill_value", None), facts)
        return _const_of(v, out.dtype) if ok else None
    if not args or not isinstance(args[0], torch.fx.Node):
        return None
    src = facts.get(args[0])
    if name in _CONST_KEEPS and isinstance(src, _Const):
        return _const_of(src.value, out.dtype)
    if name in _CONST_COMPARES and len(args) == 2:
        (ok_a, a), (ok_b, b) = _const_value(args[0], facts), _const_value(args[1], facts)
        exact = not isinstance(a, float) and not isinstance(b, float)  # a float compare depends on type promotion
        return _Const(_CONST_COMPARES[name](a, b)) if ok_a and ok_b and exact else None
    if name == "where" and len(args) == 3 and isinstance(src, _Const):
        ok, v = _const_value(args[1] if src.value else args[2], facts)
        return _const_of(v, out.dtype) if ok else None
    if out.dtype == torch.bool and name in ("and_", "logical_and", "bitwise_and"):
        consts = [_const_value(a, facts) for a in _leaves(args)]
        return _Const(False) if any(ok and not v for ok, v in consts) else None
    if out.dtype == torch.bool and name in ("or_", "logical_or", "bitwise_or") and len(args) == 2:
        for x, other in (args, args[::-1]):
            ok, v = _const_value(other, facts)
            if ok and not v and isinstance(x, torch.fx.Node) and isinstance(example_of(x), torch.Tensor) \
                    and example_of(x).dtype == torch.bool:
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


def index_provenance(gm: torch.fx.GraphModule, zero_padded: Mapping[torch.fx.Node, int] | None = None,
                     ties: Mapping[Any, Any] | None = None, values: Mapping[str, Any] | None = None,
                     proven: Mapping[torch.fx.Node, Any] | None = None,
                     upper: Mapping[str, int] | None = None) -> dict[torch.fx.Node, Any]:
    """The position and causal-mask facts of ``gm``'s nodes (see the section comment above).
    ``zero_padded``: placeholders the dispatcher pads with 0 -> their padded dim; ``ties``: size symbols padded
    together (symbol -> the one it equals on every call); ``values``: placeholder name -> the real tensor it takes
    (a module buffer), whose values may prove it a causal table (:mod:`.buffer_masks`); ``proven``: facts of nodes
    proven by a whole-pattern rule (a top-k indexer's narrowed additive mask, :mod:`.topk_mask`); ``upper``: symbol
    name -> the largest size a padded call runs at (the largest bucket), which bounds the values of integer facts
    (:func:`_values_fit`)."""
    ties = MappingProxyType(dict(ties or {}))
    facts: dict[torch.fx.Node, Any] = {n: _ZeroPad(d, n.name) for n, d in (zero_padded or {}).items()}
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
    above the diagonal of its last two dims and true on it (GPT-Neo's ``tril`` buffer): a :class:`_Causal` on those
    dims, true on the diagonal with no input needed. A prefix slice keeps it (:func:`_view_map`)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in values and is_causal_table(values[node.name]):
            nd = values[node.name].dim()
            out[node] = _Causal(q=nd - 2, k=nd - 1, diag=frozenset())
    return out


def _identity_index(item: Any, size: Any, ctx: _Ctx) -> bool:
    """``item`` holds ``0 .. size - 1`` along the dim it broadcasts on (row ``i`` reads row ``i``)."""
    fact = ctx.facts.get(item) if isinstance(item, torch.fx.Node) else None
    if not isinstance(fact, _Positions) or fact.offset != 0 or fact.base is not None:
        return False
    return ctx.same_size(example_of(item).shape[fact.dim], size)


def _pad_keys_masked(mask: Any, ctx: _Ctx) -> bool:
    """A boolean attention mask that is False at every padding key (dim -1): no query reads them."""
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    t = example_of(mask)
    return isinstance(fact, (_ZeroPad, _KeysOnly)) and isinstance(t, torch.Tensor) and t.dtype == torch.bool \
        and fact.dim == t.dim() - 1


def _causal_mask(mask: Any, ctx: _Ctx) -> bool:
    """An attention mask proven true only where key index (dim -1) <= query index (dim -2)."""
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    t = example_of(mask)
    return isinstance(fact, _Causal) and fact.shift is None and isinstance(t, torch.Tensor) \
        and t.dtype == torch.bool and (fact.q, fact.k) == (t.dim() - 2, t.dim() - 1)


def _zero_padded(gm: torch.fx.GraphModule, names: set[str], symbols: frozenset[str]) -> dict[torch.fx.Node, int]:
    """The named placeholders with exactly one padded dim -> that dim."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            dims = padded_dims(node, symbols)
            if len(dims) == 1:
                out[node] = dims[0]
    return out


def _live_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose values can reach an output: ancestors of the output, of every node that writes into one
    of its arguments, of graphpass's ops and of module calls. Others (a ``max(position_ids)`` whose result the
    model's code never uses) are dead: whatever they compute over the padding reaches no result."""
    roots = [n for n in gm.graph.nodes if n.op in ("output", "call_module") or (
        n.op in ("call_function", "call_method") and (_namespace(n.target) in _SAFE_NAMESPACES or any(
            writes_into(n, a) for a in flat_nodes((n.args, n.kwargs)))))]
    live: set[torch.fx.Node] = set()
    while roots:
        n = roots.pop()
        if n not in live:
            live.add(n)
            roots.extend(n.all_input_nodes)
    return live


#: A whole-pattern rule: ``rule(gm, facts, same_size, padded)`` -> its proofs, each with ``nodes`` (the pattern's
#: nodes, not checked op by op) and ``facts`` (pairs node -> fact proven for the nodes it produces).
PatternRule = Callable[..., list]


def _prove_patterns(gm: torch.fx.GraphModule, ctx: _Ctx, rules: Sequence[PatternRule],
                    provenance: Callable[[dict], Mapping]) -> tuple[_Ctx, list]:
    """Run ``rules`` to a fixpoint: the facts their proofs carry are added to the index-provenance facts
    (``provenance(carried)``) until no rule proves a new node; return the context with those facts and the proofs."""
    carried: dict[torch.fx.Node, Any] = {}
    while True:
        found = [p for rule in rules for p in rule(gm, ctx.facts, ctx.same_size, ctx.padded)]
        more = {n: f for p in found for n, f in p.facts}
        if more.keys() <= carried.keys():
            return ctx, found
        carried.update(more)
        ctx = replace(ctx, facts=provenance(carried))


def check_padding_safety(
    gm: torch.fx.GraphModule, symbols: set[sympy.Symbol], *, causal_ok: bool = True,
    ties: Mapping[sympy.Symbol, sympy.Symbol] | None = None, zero_padded: Iterable[str] = (),
    relied_on: set[str] | None = None, trusted: set[str] | None = None,
    values: Mapping[str, Any] | None = None, tables: dict[str, CausalTable] | None = None,
    rules: Sequence[PatternRule] = (), proofs: list[Any] | None = None, table_reads: list[TableRead] | None = None,
    upper: Mapping[str, int] | None = None,
) -> list[PaddingViolation]:
    """Every node of ``gm`` that would make padding the dims sized by ``symbols`` inexact.

    ``gm`` is a Dynamo-level graph traced with dynamic shapes (its nodes carry FakeTensor
    ``example_value`` metadata with SymInt sizes); ``symbols`` are the sympy symbols of the dims
    bucketing pads (matched by name). ``causal_ok``: causal ops along a padded dim count as safe
    (padding sits at the end, and row i reads rows <= i only): ``scaled_dot_product_attention`` with
    ``is_causal``, prefix scans and ``diff`` without ``append`` (:data:`CAUSAL_SCANS`).

    ``zero_padded``: names of the placeholders whose padding is filled with 0 (so a mask ANDed with
    such an input, read in place, is False at every padding key).
    ``ties``: symbols padded together with another one (symbol -> the one it equals on every call,
    which the caller checks), for the size comparisons of the index-provenance proofs.
    ``relied_on``: when given, filled with the ``zero_padded`` inputs that an accepted additive-mask proof needs
    to hold 1 at every real position (no real query row fully masked); the caller checks that on every call.

    ``trusted``: when given, filled with the names of the causal functions (:mod:`.causal_functions`) checked as
    a whole; their proof is about the function's code at each size, so the caller must also check that the traced
    graph is the code's trace at the bucket's size (Dynamo's guards hold there).
    ``values``: placeholder name -> the real tensor the graph takes there (the backend's example inputs); a
    boolean one proven causal on its values (:func:`.buffer_masks.is_causal_table`: a ``tril`` buffer) is a causal
    mask. ``tables``: when given, filled with those the graph reads (name -> :class:`.buffer_masks.CausalTable`);
    the proof holds only while they keep those values, which the caller checks on every call.
    ``rules``: whole-pattern rules (:data:`PatternRule`, e.g. :func:`.topk_mask.topk_masks`, a sparse-attention
    indexer's top-k that only narrows a causal mask): the nodes of each pattern a rule proves are not checked op by
    op, and the facts it proves feed the index-provenance facts, to a fixpoint (a later layer's pattern may be proven
    through an earlier one's). Only where the padding sits at the end (``causal_ok``). ``proofs``: when given, filled
    with the proofs; a proof may hold conditions on the bucket sizes that the caller checks (a top-k's ``k``).
    ``table_reads``: when given, filled with the lookups of static-size tables by position (:mod:`.position_tables`).
    ``upper``: symbol name -> the largest size a padded call runs at (the largest bucket): integer facts survive a
    narrow dtype only when their values fit it up to there (without it, only the shape env's ranges count).

    Nodes whose values reach no output (dead code the model computes and never uses) are not checked.
    Returns the violations in graph order; an empty list means padding is safe.
    """
    def provenance(carried: dict | None = None) -> MappingProxyType:
        zero = _zero_padded(gm, set(zero_padded), _symbol_names(symbols))
        return MappingProxyType(index_provenance(gm, zero, ties, values, carried, upper))

    ctx = _Ctx(names=_symbol_names(symbols), causal_ok=causal_ok, facts=provenance(),
               ties=MappingProxyType(dict(ties or {})), table_reads=[] if table_reads is None else table_reads)
    out: list[PaddingViolation] = []
    live = _live_nodes(gm)
    ctx, found = _prove_patterns(gm, ctx, rules, provenance) if rules and causal_ok else (ctx, [])
    (proofs if proofs is not None else []).extend(found)
    proven = {n for proof in found for n in proof.nodes}
    if tables is not None:
        tables.update({n.name: CausalTable(n.name, values[n.name]) for n in gm.graph.nodes
                       if n.op == "placeholder" and n in live and isinstance(ctx.facts.get(n), _Causal)})
    _, layout = layout_sweep(gm, padded=ctx.padded, name_of=_op_name, arg_of=_arg, along_dims=_along_dims,
                             row_wise=lambda name: name in _ROW_WISE_ANY_LAYOUT,
                             transparent=lambda n: n.op == "call_function" and _namespace(n.target) in _SAFE_NAMESPACES,
                             inside=lambda n: ("causal" if causal_ok and causal_function_of(n) is not None else
                                               "row_wise" if _row_wise_function(n) is not None else None))
    for node in (n for n in gm.graph.nodes if (n in live or n.op == "output") and n not in proven):
        hit = _check_node(node, ctx)  # the op's own rule first: it names what the op does along the padded dim
        if hit is None:
            hit = layout.get(node)
        if hit is not None:
            out.append(PaddingViolation(node=node.name, op=_label(node), dim=hit[0], reason=hit[1], source=_source(node)))
    for into, got in ((relied_on, ctx.relied_on), (trusted, ctx.trusted)):
        if into is not None:
            into.update(got)
    return out
