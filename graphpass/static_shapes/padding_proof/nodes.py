"""Reading FX nodes for the padding proof: an op's bare table name (:func:`_op_name`), its arguments by position,
keyword or schema name (:func:`_arg`), a readable label and source line for the violations, and small argument
helpers (static ints, dim lists, leaves of nested arguments)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from ...fx_utils import example_of, mentions_symbol, op_name, schema_position, source_frame
from .registry import OP_RULES
from .tables import _KNOWN, _KNOWN_MODULES, _TABLE_NAMESPACES, POINTWISE

if TYPE_CHECKING:
    from torch.fx.node import Target

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
        if c in _KNOWN or c in OP_RULES:  # the tables, and op rules registered since
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


def _is_int_tensor(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and not t.dtype.is_floating_point
        and not t.dtype.is_complex
        and t.dtype != torch.bool
    )
