"""The op tables of the padding proof: which op names are pointwise, dim-wise layout, reshapes, reductions along a
dim, matmuls, normalisations, attention kernels, ...; the library functions proven row-wise as a whole
(:data:`ROW_WISE_FUNCTIONS`); the row-writing ops (:data:`ROW_WRITES`); and the names and constants the fact rules
match. Data only: the op rules that read these tables are registered in :mod:`.op_checks`, by name."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch

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

#: Reshapes reinterpret the row-major element order: checked by :func:`_reshape_keeps_rows`.
RESHAPES: frozenset[str] = frozenset("view reshape flatten unflatten view_as reshape_as _unsafe_view ravel".split())

#: Size queries and other ops without a tensor result that read only metadata.
META: frozenset[str] = frozenset(
    "size dim numel stride sym_size sym_numel sym_stride sym_storage_offset is_contiguous "
    "element_size get_device is_floating_point".split()
)

#: Factories: sizes may mention the padded length (row i of ``arange(L)`` is i either way); the
#: listed arguments are *values* and must not. name -> ((position, keyword), ...).
FACTORIES: Mapping[str, tuple[tuple[int, str], ...]] = MappingProxyType(
    {
        **{
            n: ()
            for n in "zeros ones empty rand randn zeros_like ones_like empty_like rand_like "
            "randn_like new_zeros new_ones new_empty eye".split()
        },
        "full": ((1, "fill_value"),),
        "full_like": ((1, "fill_value"),),
        "new_full": ((2, "fill_value"),),
        "arange": (),  # start / step are checked in _check_factory
    }
)


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
ALONG_DIM: Mapping[str, _DimSpec] = MappingProxyType(
    {
        **{
            n: _DimSpec(1, "dim", _ALL, _MIX)
            for n in (
                "sum nansum mean nanmean prod amax amin max min all any argmax argmin count_nonzero var std "
                "var_mean std_mean logsumexp median nanmedian softmax log_softmax softmin _softmax "
                "_log_softmax cumsum cumprod cummax cummin logcumsumexp"
            ).split()
        },
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
        **{
            n: _DimSpec(1, "dim", _ALL, _GATHER)
            for n in ("index_select gather scatter scatter_add scatter_reduce index_add index_copy index_fill").split()
        },
        "take_along_dim": _DimSpec(2, "dim", _ALL, _GATHER),
    }
)

#: Prefix scans: row i of the output reads rows <= i along the dim, so with ``causal_ok`` (the
#: padding at the end) real rows never read padding. ``diff`` reads rows i - 1 (``prepend``) or
#: i + 1 .. i + n of its input, never past the real rows for a real output row, unless it ``append``s.
CAUSAL_SCANS: frozenset[str] = frozenset("cumsum cumprod cummax cummin logcumsumexp diff".split())


#: Matmul-family ops, with the (argument position, keyword, dim) pairs they contract over. None:
#: decided from the operands' ranks (matmul) or the equation (einsum).
MATMULS: Mapping[str, tuple[tuple[int, str, int], ...] | None] = MappingProxyType(
    {
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
    }
)

#: Normalisations, with the dims they compute statistics over ("trailing": the last
#: len(normalized_shape); "from1": dims 1..; "from2": dims 2..; "batch": all but 1, in training).
NORMS: Mapping[str, str] = MappingProxyType(
    {
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
    }
)

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
    POINTWISE
    | LAYOUT
    | RESHAPES
    | META
    | ATTENTION
    | INDEXING
    | CONCAT
    | REPEATS
    | PADS
    | EMBEDDINGS
    | CONVS
    | WINDOWS
    | frozenset(FACTORIES)
    | frozenset(ALONG_DIM)
    | frozenset(MATMULS)
    | frozenset(NORMS)
)


@dataclass(frozen=True)
class RowWiseFunction:
    """A library function trusted as row-wise as a whole: its code (with ``helpers``, the same file's module-level
    functions it calls) must have ``digest`` (:func:`..causal_functions.source_digest`), so an edited or vendored
    copy, or another release's, is checked op by op again; ``reason``: why every output row depends on its own row."""

    digest: str
    reason: str
    helpers: tuple[str, ...] = ()


#: Library functions checked as a whole instead of op by op: every output row of each, along the padded dim,
#: depends only on the same rows of its inputs, for the reason given. Their inner ops (a sort of the tokens by expert,
#: gathers, a count per expert, grouped GEMMs, the inverse permutation) are not row-wise one by one, but the function
#: is. A node is trusted when it was traced inside one of them, its innermost frame is the function or one of its
#: helpers (not a model's own ``_apply_gate`` it calls), and the file's source has the digest
#: (:class:`.patterns.RowWiseFunctions`). (path suffix, function) -> the proven code.
ROW_WISE_FUNCTIONS: Mapping[tuple[str, str], RowWiseFunction] = MappingProxyType(
    {
        ("transformers/integrations/moe.py", "grouped_mm_experts_forward"): RowWiseFunction(
            "4b3136e0cabfa5ba",
            "dropless top-k experts: the token-expert pairs are sorted by expert, each row is multiplied by its own "
            "expert's weights (the group offsets are counted from the same sorted rows), the inverse permutation puts "
            "every row back, and a token's k results are summed in its own row; no capacity, so no token is dropped "
            "because of another",
            helpers=("_grouped_linear", "_grouped_mm", "_can_use_grouped_mm", "_default_apply_gate"),
        ),
        ("transformers/integrations/moe.py", "batched_mm_experts_forward"): RowWiseFunction(
            "2d673d4ddafb277c",
            "dropless top-k experts: each token-expert pair is multiplied by its own gathered expert weights and a "
            "token's k results are summed in its own row",
            helpers=("_batched_linear", "_default_apply_gate"),
        ),
    }
)

#: Namespaces whose OpOverloads are read through the tables above; graphpass's are always safe.
_TABLE_NAMESPACES = frozenset({"aten", "prims"})
_SAFE_NAMESPACES = frozenset({"graphpass"})
#: Modules a call_function callable may come from to be matched by name (else: unknown).
_KNOWN_MODULES = ("torch", "_operator", "operator", "math", "builtins")

# --------------------------------------------------------------------------------------------
# Padding rows written into a tensor that is not padded (a key/value cache's slots)
# --------------------------------------------------------------------------------------------

#: Ops that write rows of a tensor into another one: name -> (position, keyword) of the written rows.
ROW_WRITES: Mapping[str, tuple[int, str]] = MappingProxyType(
    {
        "index_copy": (3, "source"),
        "index_add": (3, "source"),
        "index_put": (2, "values"),
        "scatter": (3, "src"),
        "scatter_add": (3, "src"),
        "scatter_reduce": (3, "src"),
        "setitem": (2, "value"),
        "masked_scatter": (2, "source"),
    }
)
#: Ops a read of the written slots may go through before the attention that masks them: they keep the
#: slot dim and the last dim as the last two (views, broadcasts, copies).
_SLOT_KEEPS = frozenset("contiguous clone to _to_copy detach alias".split())

# --------------------------------------------------------------------------------------------
# Names and constants of the fact rules (provenance.py)
# --------------------------------------------------------------------------------------------

#: A fill value this negative (or -inf) vanishes from a softmax next to any finite score, in fp32 and bf16.
_HUGE = 1e30


#: Ops that keep every value and dim (dtype and device conversions, copies).
_KEEPS = frozenset(
    "to type long int bool float double bfloat16 half clone contiguous detach alias lift_fresh _to_copy".split()
)
#: Comparisons as (flip operands, strict): a < b, a <= b, a > b == b < a, a >= b == b <= a.
_COMPARES = MappingProxyType(
    {
        "le": (False, False),
        "lt": (False, True),
        "ge": (True, False),
        "gt": (True, True),
        "less_equal": (False, False),
        "less": (False, True),
        "greater_equal": (True, False),
        "greater": (True, True),
    }
)
_ANDS = frozenset("and_ logical_and bitwise_and mul".split())

_NEG_MASK_DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # float16 overflows a mask value plus a score to -inf
_ALL_TRUE_FACTORIES = frozenset("new_ones ones ones_like".split())
_NOTS = frozenset("logical_not bitwise_not invert not_".split())
_SOFTMAXES = frozenset("softmax _softmax".split())
_BOUNDED = _SOFTMAXES | {"sigmoid"}  # values in [0, 1] whatever the input: never a fill value
_CONST_FACTORIES = MappingProxyType(
    {"zeros": 0, "zeros_like": 0, "new_zeros": 0, "ones": 1, "ones_like": 1, "new_ones": 1}
)
_CONST_FILLS = MappingProxyType({"full": 1, "full_like": 1, "new_full": 2})  # name -> position of the fill value
#: Ops whose every output element is an element of their first input (views, copies, indexing, gathers).
_CONST_KEEPS = (
    frozenset(
        "getitem expand expand_as broadcast_to unsqueeze squeeze permute transpose view reshape "
        "flatten contiguous clone detach alias select narrow slice index_select".split()
    )
    | _KEEPS
)
_CONST_COMPARES = MappingProxyType(
    {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}
)
