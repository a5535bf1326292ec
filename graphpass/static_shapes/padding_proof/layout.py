"""Where the padding sits inside each padded dim: the layout half of the padding proof.

Bucketing appends padding rows after the real rows of a padded input dim. Every rule of the proof that reads a
dim "along" it (a causal scan, a prefix slice, a causal attention, a ``cat`` after it, the dispatcher's slice of
an output back to its length) assumes the real rows of that dim are a **prefix**. A reshape can break that without
mixing any rows: ``[B, L, H] -> [B*L, H]`` puts batch row 1's tokens after batch row 0's *padding*;
``[B, H, L] -> [B, H*L]`` puts every channel's padding between the channels. Such a dim is still fine for
row-wise work (MoE routers flatten the tokens, compute per token and view them back), but not for anything that
relies on the prefix, and splitting it back in another order (``[B, L*H] -> [B, H, L]``) scrambles the rows.

This module follows, for every padded dim of every node, one :class:`Digit`: the dim's index, read in mixed radix,
has the padded factor (``digit``, a size that mentions the padded symbol) with ``outer`` static values before it and
``inner`` after it (``size = outer * digit * inner``). The dim's real rows are a prefix exactly when ``outer == 1``
(:attr:`Digit.prefix`). An input's padded dim is ``Digit(1, size, 1)``.

* **Reshapes** (``view``, ``reshape``, ``flatten``, ``unflatten``, ``squeeze``, ``unsqueeze``, ...) keep the flat
  row-major index. The padded factor of source dim ``d`` has stride ``C = inner * prod(src[d+1:])``; it lands in the
  destination dim ``d'`` (stride ``C' = prod(dst[d'+1:])``, size ``S'``) with ``C' | C`` and ``C * digit | C' * S'``,
  as ``Digit(S' * C' / (C * digit), digit, C / C')``. When no destination dim holds it whole (the factor is split
  across dims: the order changed), or a destination dim mentions the symbol without holding a factor, or holds two,
  the reshape is a violation.
* **Moves** (``permute``, ``transpose``, ``movedim``, ``expand``, ...) carry each dim's digit to where the dim goes.
* **Row-wise ops** (pointwise, matmuls not contracting the dim, norms and reductions over other dims, ``repeat``
  along it: ``Digit(c * outer, digit, inner)``) carry the digit of the operand dim they align with; operands whose
  digits disagree on one dim (a prefix against an interleaved dim) are a violation.
* **Anything else** reading an interleaved dim (``outer != 1``) is a violation: only row-wise work may happen before
  the dim is split back. So is a graph output with an interleaved dim (the dispatcher slices outputs as prefixes).

The op rules of the proof (:mod:`.op_checks`) still decide whether an op mixes rows; this sweep only decides
where the real rows are. It inserts nothing and assumes Dynamo-level or aten graphs with FakeTensor metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import sympy
import torch

from ...fx_utils import example_of, size_expr
from ...tensor_utils import shape_env_of
from .nodes import _MISSING, _arg, _dims, _is_tensor_arg, _leaves, _namespace, _norm_dim, _op_name
from .tables import _SAFE_NAMESPACES, ALONG_DIM, FACTORIES, META, NORMS, POINTWISE

__all__ = ["Digit", "layout_sweep", "layout_violations"]


@dataclass(frozen=True)
class Digit:
    """A padded dim's index read in mixed radix: ``outer`` static values, then the padded factor ``digit``, then
    ``inner``; its real rows are a prefix of the dim exactly when ``outer == 1``."""

    outer: sympy.Expr
    digit: sympy.Expr
    inner: sympy.Expr

    @property
    def prefix(self) -> bool:
        return self.outer == 1


#: Ops that only move or broadcast dims (their digits move with them); reshapes are handled by the digit rule.
_MOVES = frozenset(
    "permute transpose swapaxes swapdims movedim moveaxis t adjoint expand expand_as broadcast_to".split()
)
_RESHAPES = frozenset("view reshape flatten unflatten view_as reshape_as _unsafe_view ravel squeeze unsqueeze".split())
#: Matmuls whose row dims (all but the contracted one) keep their digits.
_MATMULS = frozenset("linear matmul mm bmm addmm baddbmm".split())


def _exact(expr: sympy.Expr, env: Any) -> sympy.Expr:
    """``expr`` with every ``a // b`` the shape env knows to be exact replaced by ``a / b``."""
    from torch.utils._sympy.functions import FloorDiv

    known = getattr(env, "divisible", None) or ()
    reps = {
        atom: atom.args[0] / atom.args[1] for atom in expr.atoms(FloorDiv) if any(m.args == atom.args for m in known)
    }
    return sympy.expand(expr.xreplace(reps)) if reps else expr


def _divides(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a != 0 and sympy.cancel(b / a).is_integer is True


class _Sweep:
    def __init__(
        self,
        padded: Callable[[Any], tuple[int, ...]],
        name_of: Callable[[torch.fx.Node], str | None],
        arg_of: Callable[..., Any],
        along_dims: Callable[[torch.fx.Node, str], list[int] | None],
        transparent: Callable[[torch.fx.Node], bool],
        inside: Callable[[torch.fx.Node], str | None],
    ) -> None:
        self.padded, self.name_of, self.arg_of, self.along_dims = padded, name_of, arg_of, along_dims
        self.transparent, self.inside = transparent, inside
        self.digits: dict[Any, dict[int, Digit]] = {}  # node (or (node, i) of a tuple result) -> padded dim -> digit
        self.violations: dict[torch.fx.Node, tuple[int | None, str]] = {}
        self.row_wise_rows: dict[sympy.Expr, Digit | None] = {}  # see _enter_row_wise

    # -- reading ---------------------------------------------------------------------------------
    def of(self, value: Any, key: Any = None) -> dict[int, Digit]:
        """The digits of a node's tensor value (an input's padded dims are prefixes)."""
        key = value if key is None else key
        if key in self.digits:
            return self.digits[key]
        t = example_of(value)
        if not isinstance(t, torch.Tensor):
            return {}
        return {d: Digit(sympy.Integer(1), size_expr(t.shape[d]), sympy.Integer(1)) for d in self.padded(t)}

    def interleaved(self, value: Any) -> list[int]:
        return [d for d, g in self.of(value).items() if not g.prefix] if isinstance(value, torch.fx.Node) else []

    # -- the rules -------------------------------------------------------------------------------
    def reshape(self, node: torch.fx.Node, src: torch.fx.Node, out: torch.Tensor) -> dict[int, Digit] | str:
        t = example_of(src)
        env = shape_env_of(t) or shape_env_of(out)
        src_shape = [_exact(size_expr(s), env) for s in t.shape]
        dst_shape = [_exact(size_expr(s), env) for s in out.shape]
        found: dict[int, Digit] = {}
        for d, g in self.of(src).items():
            stride = _exact(g.inner * sympy.Mul(*src_shape[d + 1 :]), env)
            for dd in range(len(dst_shape)):
                c2 = sympy.Mul(*dst_shape[dd + 1 :])
                if _divides(c2, stride) and _divides(stride * g.digit, c2 * dst_shape[dd]):
                    if dd in found:
                        return f"puts two padded factors into dim {dd}"
                    found[dd] = Digit(
                        sympy.cancel(c2 * dst_shape[dd] / (stride * g.digit)), g.digit, sympy.cancel(stride / c2)
                    )
                    break
            else:
                return (
                    f"splits the padded factor {g.digit} of dim {d} across dims "
                    f"{tuple(str(s) for s in out.shape)}: the rows come back in another order"
                )
        missing = [d for d in self.padded(out) if d not in found]
        if missing:
            return f"gives dim {missing[0]} a padded size that holds no whole padded factor"
        return found

    def moved(self, node: torch.fx.Node, name: str, src: torch.fx.Node, out: torch.Tensor) -> dict[int, Digit] | None:
        t = example_of(src)
        digits = self.of(src)
        n = t.dim()
        if name in ("expand", "expand_as", "broadcast_to"):
            return {d + out.dim() - n: g for d, g in digits.items()}
        if name in ("t", "adjoint") or (name in ("transpose", "swapaxes", "swapdims") and len(node.args) >= 3):
            a, b = (0, 1) if name == "t" else (self.arg_of(node, 1, "dim0"), self.arg_of(node, 2, "dim1"))
            if name == "adjoint":
                a, b = n - 2, n - 1
            if not (isinstance(a, int) and isinstance(b, int)):
                return None
            a, b = a % n, b % n
            swap = {a: b, b: a}
            return {swap.get(d, d): g for d, g in digits.items()}
        if name == "permute":
            dims = list(node.args[1:]) if len(node.args) > 2 else self.arg_of(node, 1, "dims")
            if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
                return None
            where = {d % n: i for i, d in enumerate(dims)}
            return {where[d]: g for d, g in digits.items()}
        if name in ("movedim", "moveaxis"):
            srcs, dsts = self.arg_of(node, 1, "source"), self.arg_of(node, 2, "destination")
            srcs = [srcs] if isinstance(srcs, int) else srcs
            dsts = [dsts] if isinstance(dsts, int) else dsts
            if not isinstance(srcs, (list, tuple)) or not isinstance(dsts, (list, tuple)):
                return None
            order = [None] * n
            for s, d in zip(srcs, dsts):
                order[d % n] = s % n
            rest = iter(d for d in range(n) if d not in {s % n for s in srcs})
            order = [o if o is not None else next(rest) for o in order]
            where = {o: i for i, o in enumerate(order)}
            return {where[d]: g for d, g in digits.items()}
        return None

    def getitem(self, node: torch.fx.Node, src: torch.fx.Node, out: torch.Tensor) -> dict[int, Digit] | str | None:
        """A subscript: dims under full slices keep their digit; an interleaved dim may only be kept whole."""
        t = example_of(src)
        idx = node.args[1] if len(node.args) > 1 else None
        items = list(idx) if isinstance(idx, tuple) else [idx]
        bad = self.interleaved(src)
        if any(isinstance(example_of(i), torch.Tensor) or isinstance(i, (list, tuple)) for i in items):
            return f"indexes a tensor whose padded dim {bad[0]} is interleaved" if bad else None
        used = sum(0 if i is None or i is Ellipsis else 1 for i in items)
        d = o = 0
        found: dict[int, Digit] = {}
        digits = self.of(src)
        for item in items + [Ellipsis] * (Ellipsis not in items):
            if item is None:
                o += 1
                continue
            width = t.dim() - used if item is Ellipsis else 1
            for _ in range(width):
                full = item is Ellipsis or item == slice(None)
                if d in bad and not full:
                    return f"subscripts the padded dim {d}, whose rows are interleaved with another dim's"
                if isinstance(item, slice) or item is Ellipsis:
                    if full and d in digits:
                        found[o] = digits[d]
                    o += 1
                d += 1
        for dd in self.padded(out):  # a prefix slice of a prefix dim, or an int / tensor index: a prefix again
            found.setdefault(dd, Digit(sympy.Integer(1), size_expr(out.shape[dd]), sympy.Integer(1)))
        return found

    def carried(self, node: torch.fx.Node, operands: list[Any], out: torch.Tensor) -> dict[int, Digit] | str:
        """A row-wise op: each padded output dim takes the digit of the operand dims it aligns with (from the right,
        as broadcasting does, else from the left, as a reduction of trailing dims leaves them), all equal."""
        found: dict[int, Digit] = {}
        pads = self.padded(out)
        tensors = [(a, example_of(a)) for a in operands]
        tensors = [(a, t) for a, t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0]
        for d in pads:
            size = size_expr(out.shape[d])
            seen: list[Digit] = []
            for a, t in tensors:
                for dd in (d - out.dim() + t.dim(), d):
                    if 0 <= dd < t.dim() and size_expr(t.shape[dd]) == size:
                        g = self.of(a).get(dd)
                        if g is not None:
                            seen.append(g)
                        break
            if any(g != seen[0] for g in seen[1:]):
                return f"combines operands whose dim {d} holds its padding at different places"
            if seen:
                found[d] = seen[0]
            elif any(self.interleaved(a) for a, _ in tensors):
                return f"leaves dim {d} padded where it cannot be told which operand dim it comes from"
            else:
                found[d] = Digit(sympy.Integer(1), size, sympy.Integer(1))  # a new dim sized by the length
        return found

    # -- one node --------------------------------------------------------------------------------
    def visit(self, node: torch.fx.Node, allowed: Callable[[str | None], bool]) -> None:
        if node.op == "output":
            self._output(node)
            return
        if node.op not in ("call_function", "call_method"):
            return
        out = example_of(node)
        operands = [a for a in _leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
        src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if self.name_of(node) == "getitem" and src is not None and not isinstance(example_of(src), torch.Tensor):
            i = node.args[1] if len(node.args) > 1 else None
            if (src, i) in self.digits:  # an element of a tuple result (topk's values, split's pieces)
                self.digits[node] = self.digits[(src, i)]
            return
        if self._opaque(node, operands, src, out):
            return
        interleaved = [a for a in operands if self.interleaved(a)]
        result = self._rule(node, self.name_of(node), operands, interleaved, src, out, allowed)
        if isinstance(result, str):
            at = interleaved[0] if interleaved else src
            dims = (self.interleaved(at) or list(self.padded(example_of(at)))) if isinstance(at, torch.fx.Node) else []
            self.violations[node] = (dims[0] if dims else None, result)
        elif isinstance(result, dict):
            self.digits[node] = result

    def _enter_row_wise(self, operands: list) -> None:
        """Record the digits of the tensors a row-wise function reads from outside it, by the padded size they have
        (a size seen with two different digits is not used)."""
        for a in operands:
            if isinstance(a, torch.fx.Node) and self.inside(a) != "row_wise":
                t = example_of(a)
                for d, g in self.of(a).items():
                    size = size_expr(t.shape[d])
                    if self.row_wise_rows.setdefault(size, g) != g:
                        self.row_wise_rows[size] = None

    def _rows_kept(self, digits: dict[int, Digit]) -> dict[int, Digit]:
        """A row-wise function keeps each row where it is (its proof): a padded dim of one of its nodes that no
        operand's dim lines up with (a fresh digit: the tokens regrouped by expert and gathered back) but that has
        the size of a token dim the function read takes that dim's digit."""
        out = dict(digits)
        for d, g in digits.items():
            entry = self.row_wise_rows.get(g.digit)
            if g.prefix and g.inner == 1 and entry is not None:
                out[d] = entry
        return out

    def _output(self, node: torch.fx.Node) -> None:
        for a in _leaves(node.args):
            if isinstance(a, torch.fx.Node) and self.interleaved(a):
                self.violations[node] = (
                    self.interleaved(a)[0],
                    (
                        f"returns {a.name} with the padded dim {self.interleaved(a)[0]} interleaved with another dim: "
                        "its real rows are not a prefix, so slicing it back is wrong"
                    ),
                )

    def _opaque(self, node: torch.fx.Node, operands: list, src: Any, out: Any) -> bool:
        """Nodes whose layout another proof answers for: inside a proven causal function (its edges are checked to
        be the padded length itself, a prefix), inside a function row-wise as a whole (rows stay where they are),
        graphpass's markers (their input passes through)."""
        whole = self.inside(node)
        if whole == "causal":
            return True
        if whole == "row_wise" and isinstance(out, torch.Tensor):
            self._enter_row_wise(operands)
            result = self.carried(node, operands, out)
            if isinstance(result, dict):
                self.digits[node] = self._rows_kept(result)
            return True
        if self.transparent(node):
            if (
                src is not None
                and isinstance(out, torch.Tensor)
                and isinstance(example_of(src), torch.Tensor)
                and tuple(out.shape) == tuple(example_of(src).shape)
            ):
                self.digits[node] = self.of(src)
            return True
        return False

    def _rule(
        self,
        node: torch.fx.Node,
        name: str | None,
        operands: list,
        interleaved: list,
        src: Any,
        out: Any,
        allowed: Callable[[str | None], bool],
    ) -> Any:
        """The digits of ``node``'s result (a dict), a violation (a str), or None (every padded dim a prefix)."""
        tensor_out = isinstance(out, torch.Tensor)
        if name == "repeat" and src is not None and tensor_out:
            return self._repeat(node, src, out)
        if name in _RESHAPES and src is not None and tensor_out:
            result = self.reshape(node, src, out) if (self.padded(src) or self.padded(out)) else None
            if isinstance(result, str):
                return (
                    f"{name} {tuple(example_of(src).shape)} -> {tuple(out.shape)} moves padding rows away from "
                    f"the end of the padded dim: it {result}"
                )
            return result
        if name in _MOVES and src is not None and tensor_out:
            result = self.moved(node, name, src, out)
            if result is None and interleaved:
                return f"{name} with arguments that are not static moves an interleaved padded dim"
            return result
        if name == "getitem" and src is not None and tensor_out:
            return self.getitem(node, src, out)
        if interleaved and not allowed(name):
            return (
                f"reads {interleaved[0].name}, whose padded dim {self.interleaved(interleaved[0])[0]} is "
                "interleaved with another dim (merged by a reshape): only row-wise ops may read it before it "
                "is split back in the same order"
            )
        if interleaved and name in _MATMULS and self._contracts_interleaved(node, name):
            return "contracts over an interleaved padded dim"
        along = self.along_dims(node, name) if interleaved else None
        if along is not None and any(d in self.interleaved(interleaved[0]) for d in along):
            return f"{name} along an interleaved padded dim"
        if tensor_out:
            return self.carried(node, operands, out)
        if isinstance(out, (tuple, list)):
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    r = self.carried(node, operands, t)
                    if isinstance(r, str):
                        return r
                    self.digits[(node, i)] = r
        return None

    def _contracts_interleaved(self, node: torch.fx.Node, name: str) -> bool:
        a = node.args[0] if name not in ("addmm", "baddbmm") else (node.args[1] if len(node.args) > 1 else None)
        b = node.args[1] if name not in ("addmm", "baddbmm") else (node.args[2] if len(node.args) > 2 else None)
        ta, tb = example_of(a), example_of(b)
        if isinstance(ta, torch.Tensor) and ta.dim() and ta.dim() - 1 in self.interleaved(a):
            return True
        if name == "linear":
            return bool(self.interleaved(b)) if isinstance(b, torch.fx.Node) else False
        return isinstance(tb, torch.Tensor) and tb.dim() >= 2 and tb.dim() - 2 in self.interleaved(b)

    def _repeat(self, node: torch.fx.Node, src: torch.fx.Node, out: torch.Tensor) -> dict[int, Digit] | str:
        t = example_of(src)
        counts: Any = (
            list(node.args[1:]) if node.op == "call_method" and len(node.args) > 2 else self.arg_of(node, 1, "repeats")
        )
        counts = list(counts) if isinstance(counts, (list, tuple)) else [counts]
        shift = out.dim() - t.dim()
        found = {}
        for d, g in self.of(src).items():
            c = counts[d + len(counts) - t.dim()] if 0 <= d + len(counts) - t.dim() < len(counts) else 1
            c = example_of(c)
            if not isinstance(c, int) or isinstance(c, bool):
                return "repeat by a count that is not static"
            found[d + shift] = Digit(g.outer * c, g.digit, g.inner)
        return found


def layout_sweep(
    gm: torch.fx.GraphModule,
    *,
    padded: Callable[[Any], tuple[int, ...]],
    name_of: Callable[[torch.fx.Node], str | None],
    arg_of: Callable[..., Any],
    along_dims: Callable[[torch.fx.Node, str], list[int] | None],
    row_wise: Callable[[str | None], bool],
    transparent: Callable[[torch.fx.Node], bool] = lambda node: False,
    inside: Callable[[torch.fx.Node], str | None] = lambda node: None,
) -> tuple[Mapping[Any, dict[int, Digit]], dict[torch.fx.Node, tuple[int | None, str]]]:
    """Every node's padded dims' :class:`Digit` and the nodes that break the layout rules (the module docstring).

    ``padded(t)``: the padded dims of a tensor; ``name_of(node)``: the op's bare name; ``arg_of(node, pos, kw)``: an
    argument; ``along_dims(node, name)``: the dims an op reduces or scans along (None: not such an op);
    ``row_wise(name)``: whether an op may read an interleaved dim (its own rule still refuses it along that dim);
    ``transparent(node)``: a marker that passes its input through (graphpass's own ops); ``inside(node)``:
    ``"causal"`` or ``"row_wise"`` for a node traced inside a library function proven as a whole (its inner layout is
    that proof's business: a causal function's edges are checked to be the padded length itself, a row-wise one keeps
    each row where it is), else None."""
    sweep = _Sweep(padded, name_of, arg_of, along_dims, transparent, inside)
    for node in gm.graph.nodes:
        sweep.visit(node, row_wise)
    return sweep.digits, sweep.violations


def along_dims(node: torch.fx.Node, name: str | None) -> list[int] | None:
    """The dims an op of :data:`.tables.ALONG_DIM` combines values along (every dim when none is given), or None for
    another op (read as :func:`.op_checks._check_along_dim` reads them)."""
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
ROW_WISE_ANY_LAYOUT = (
    POINTWISE
    | frozenset(NORMS)
    | frozenset(ALONG_DIM)
    | META
    | frozenset(FACTORIES)
    | frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "stack"})
)

#: The pattern rules (:mod:`.patterns`) whose nodes' layout their own proof answers for.
_WHOLE = {"causal_function": "causal", "row_wise_function": "row_wise"}


def layout_violations(
    gm: torch.fx.GraphModule, padded: Callable[[Any], tuple[int, ...]], claimed: Mapping[torch.fx.Node, Any]
) -> dict[torch.fx.Node, tuple[int | None, str]]:
    """The layout sweep over ``gm`` with the proof's readers; ``claimed``: node -> (the pattern rule that proved it,
    ...) (:func:`.prove._claim`)."""

    def inside(node: torch.fx.Node) -> str | None:
        return _WHOLE.get(claimed[node][0]) if node in claimed else None

    _, found = layout_sweep(
        gm,
        padded=padded,
        name_of=_op_name,
        arg_of=_arg,
        along_dims=along_dims,
        row_wise=lambda name: name in ROW_WISE_ANY_LAYOUT,
        transparent=lambda n: n.op == "call_function" and _namespace(n.target) in _SAFE_NAMESPACES,
        inside=inside,
    )
    return found
