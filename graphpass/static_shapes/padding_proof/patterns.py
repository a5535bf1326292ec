"""Whole-pattern rules of the padding proof: rules that prove a group of nodes at once, or a node from what happens
around it, instead of op by op. Each is a :class:`PatternRule` (``name``, ``needs_causal``, ``prove(gm, ctx)`` ->
a list of proofs); a proof names the nodes it ``claims`` (not checked op by op), may carry ``facts`` it proves
(node -> fact, fed back into the index provenance until no rule proves a new one), ``findings`` (violations at its
nodes), ``trusted`` (causal functions whose proof the caller checks against Dynamo's guards) and ``bucket_checks``
(conditions on the bucket sizes, :mod:`.conditions`).

The built-in rules (:data:`PATTERN_RULES`, in the order they claim nodes): graphpass's own ops, the library
functions proven row-wise as a whole (:data:`.tables.ROW_WISE_FUNCTIONS`), the causal functions trusted by source
digest (:mod:`..causal_functions`), and the rows written into a key/value cache's slots (:func:`_check_row_write`).
Extra rules (a sparse-attention indexer's top-k, :mod:`..topk_mask`) are passed to ``prove_padding(rules=)`` and
claim before them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from ...fx_utils import example_of, ran_inside_file, size_expr, source_frame
from ..causal_functions import causal_function_of, check_causal_edges, source_digest
from .facts import Causal, Positions
from .nodes import _arg, _label, _namespace, _op_name, _static_int
from .provenance import _view_map
from .registry import Finding, ProofContext
from .tables import _SAFE_NAMESPACES, _SLOT_KEEPS, ATTENTION, RESHAPES, ROW_WISE_FUNCTIONS, ROW_WRITES

__all__ = ["PATTERN_RULES", "PatternProof", "PatternRule", "as_pattern_rule"]

_Finding = Finding


@dataclass(frozen=True)
class PatternProof:
    """What a pattern rule proved: the nodes it claims (not checked op by op), the facts it proves for other rules,
    the violations it found at its nodes, and what the caller must still check."""

    nodes: frozenset[torch.fx.Node]
    facts: tuple[tuple[torch.fx.Node, Any], ...] = ()
    findings: Mapping[torch.fx.Node, Finding] = field(default_factory=dict)
    trusted: frozenset[str] = frozenset()  # causal functions proven as code: Dynamo's guards checked per bucket
    bucket_checks: tuple[Any, ...] = ()  # conditions on the bucket sizes (:class:`.result.BucketCheck`)


@runtime_checkable
class PatternRule(Protocol):
    """A whole-pattern rule: ``prove(gm, ctx)`` -> its proofs (objects with ``nodes`` and ``facts``, and optionally
    ``findings``, ``trusted`` and ``bucket_checks``, as :class:`PatternProof`). ``needs_causal``: run only where the
    padding sits at the end (``causal_ok``)."""

    name: str
    needs_causal: bool

    def prove(self, gm: torch.fx.GraphModule, ctx: ProofContext) -> list[Any]: ...


@dataclass(frozen=True)
class _CallableRule:
    """A rule written as a function ``rule(gm, facts, same_size, padded)`` (the form ``check_padding_safety(rules=)``
    took before :class:`PatternRule`)."""

    fn: Callable[..., list]
    name: str
    needs_causal: bool = True

    def prove(self, gm: torch.fx.GraphModule, ctx: ProofContext) -> list[Any]:
        return self.fn(gm, ctx.facts, ctx.same_size, ctx.padded)


def as_pattern_rule(rule: Any) -> PatternRule:
    """``rule`` itself when it is a :class:`PatternRule`; a function ``rule(gm, facts, same_size, padded)`` wrapped
    as one (named after it, run only with ``causal_ok``)."""
    if isinstance(rule, PatternRule):
        return rule
    return _CallableRule(rule, getattr(rule, "__name__", repr(rule)))


def _calls(gm: torch.fx.GraphModule, ctx: ProofContext) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n in ctx.live and n.op in ("call_function", "call_method")]


@dataclass(frozen=True)
class GraphpassOps:
    """graphpass's own markers (``torch.ops.graphpass.*``): no outputs, run-time side effects only."""

    name: str = "graphpass_op"
    needs_causal: bool = False

    def prove(self, gm: torch.fx.GraphModule, ctx: ProofContext) -> list[PatternProof]:
        nodes = [n for n in _calls(gm, ctx) if n.op == "call_function" and _namespace(n.target) in _SAFE_NAMESPACES]
        return [PatternProof(frozenset(nodes))] if nodes else []


@dataclass(frozen=True)
class RowWiseFunctions:
    """The nodes traced inside a library function that is row-wise as a whole (:data:`.tables.ROW_WISE_FUNCTIONS`)."""

    name: str = "row_wise_function"
    needs_causal: bool = False

    def prove(self, gm: torch.fx.GraphModule, ctx: ProofContext) -> list[PatternProof]:
        nodes = [
            n
            for n in gm.graph.nodes
            if n in ctx.live
            and n.op not in ("placeholder", "output", "get_attr")
            and row_wise_function_of(n) is not None
        ]
        return [PatternProof(frozenset(nodes))] if nodes else []


def row_wise_function_of(node: torch.fx.Node) -> str | None:
    """The trusted row-wise function ``node`` was traced inside (its name), or None: inside it on the stack, its
    innermost frame the function or one of its helpers (a model's own code it calls, an overridden ``_apply_gate``,
    is checked op by op), and the file's source with the recorded digest (:data:`.tables.ROW_WISE_FUNCTIONS`)."""
    for (suffix, name), fn in ROW_WISE_FUNCTIONS.items():
        path = ran_inside_file(node, suffix, name)
        if path is None:
            continue
        frame = source_frame(node)
        if frame is None or frame.file != suffix.rsplit("/", 1)[-1] or frame.function not in (name, *fn.helpers):
            continue
        if source_digest(path, name, fn.helpers) == fn.digest:
            return name
    return None


@dataclass(frozen=True)
class CausalFunctions:
    """The nodes traced inside a proven causal function (:mod:`..causal_functions`): trusted as a whole, only its
    edges checked (:func:`..causal_functions.check_causal_edges`); one proof per function."""

    name: str = "causal_function"
    needs_causal: bool = True

    def prove(self, gm: torch.fx.GraphModule, ctx: ProofContext) -> list[PatternProof]:
        by_fn: dict[str, dict[torch.fx.Node, Any]] = {}
        for node in gm.graph.nodes:
            if node in ctx.live and node.op not in ("placeholder", "output", "get_attr"):
                fn = causal_function_of(node)
                if fn is not None:
                    by_fn.setdefault(fn, {})[node] = check_causal_edges(node, fn, ctx.padded, ctx.is_length)
        return [
            PatternProof(
                frozenset(found), findings={n: f for n, f in found.items() if f is not None}, trusted=frozenset({fn})
            )
            for fn, found in by_fn.items()
        ]


@dataclass(frozen=True)
class KvSlotWrites:
    """Padding rows written into a tensor that is not padded (a key/value cache's slots): proven when the slots are
    positions after the real rows' and every later read is an attention masking them (:func:`_check_row_write`)."""

    name: str = "kv_slot_write"
    needs_causal: bool = False

    def prove(self, gm: torch.fx.GraphModule, ctx: ProofContext) -> list[PatternProof]:
        found = []
        for node in _calls(gm, ctx):
            name = _op_name(node)
            if name in ROW_WRITES and ctx.padded(_arg(node, *ROW_WRITES[name], None)) and not ctx.padded(node.args[0]):
                hit = _check_row_write(node, name, ctx)
                found.append(PatternProof(frozenset({node}), findings={node: hit} if hit is not None else {}))
        return found


#: The built-in pattern rules, in the order they claim nodes (a node claimed by one is not claimed by the next).
PATTERN_RULES: list[PatternRule] = [GraphpassOps(), RowWiseFunctions(), CausalFunctions(), KvSlotWrites()]


# --------------------------------------------------------------------------------------------
# Padding rows written into a tensor that is not padded (a key/value cache's slots)
# --------------------------------------------------------------------------------------------


def _check_row_write(node: torch.fx.Node, name: str, ctx: ProofContext) -> _Finding:
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
        return (
            None,
            f"{_label(node)} writes padding rows into {_label(dst)}, which is not padded: later reads may see them",
        )
    index = _arg(node, 2, "index", None)
    fact = ctx.facts.get(index) if isinstance(index, torch.fx.Node) else None
    if not isinstance(fact, Positions) or fact.offset != 0 or dim % t_dst.dim() != t_dst.dim() - 2:
        return dim, (
            f"{_label(node)} writes padding rows into {_label(dst)} at slots not proven to be "
            f"positions after the real rows' (an arange plus a run-time offset, along the slot dim -2)"
        )
    bad = _unmasked_slot_read(node, dst, fact.base, ctx)
    if bad is not None:
        return dim, (
            f"{_label(node)} writes padding rows into {_label(dst)}, and {_label(bad)} reads those slots "
            f"without an attention mask proven to hide every slot past a query's position"
        )
    return None


def _unmasked_slot_read(
    write: torch.fx.Node, buf: torch.fx.Node, shift: str | None, ctx: ProofContext
) -> torch.fx.Node | None:
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


def _masks_slots(node: torch.fx.Node, reached: set[torch.fx.Node], shift: str | None, ctx: ProofContext) -> bool:
    """An attention reading the slots (as keys or values only) with a boolean mask proven true only
    where ``key slot <= query index + shift``."""
    if _arg(node, 0, "query") in reached:
        return False
    mask = _arg(node, 3, "attn_mask", None)
    fact = ctx.facts.get(mask) if isinstance(mask, torch.fx.Node) else None
    t = example_of(mask)
    return (
        isinstance(fact, Causal)
        and fact.shift == shift
        and isinstance(t, torch.Tensor)
        and t.dtype == torch.bool
        and (fact.q, fact.k) == (t.dim() - 2, t.dim() - 1)
        and _arg(node, 5, "is_causal", False) is not True
    )
