"""The padding proof itself: :func:`prove_padding` runs the pattern rules (to a fixpoint over the facts they
prove), then every other live node through its op rule, and returns a :class:`.result.PaddingProof`;
:func:`check_padding_safety` is the older interface over it (the violations, and ``set``/``list`` arguments
filled with what the proof relies on)."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

import sympy
import torch

from ...fx_utils import canonical_sizes, example_of, flat_nodes, tensors_of, writes_into
from ...tensor_utils import shape_env_of
from ..buffer_masks import CausalTable
from ..causal_functions import CAUSAL_FUNCTIONS
from ..position_tables import TableRead
from . import op_checks  # noqa: F401 (registers the op rules)
from .conditions import CausalTablesCheck, GuardBuckets, OnesCheck, TableBuckets
from .drift import drift_note
from .facts import Causal
from .guards import MultipleBuckets, MultipleCanon, multiples_from_guards
from .nodes import _iter_nodes, _label, _namespace, _op_name, _source, _symbol_names, padded_dims
from .op_checks import UNKNOWN_OP, _value_use
from .patterns import PATTERN_RULES, PatternRule, as_pattern_rule
from .layout import layout_violations
from .provenance import index_provenance
from .registry import OP_RULES, Finding, ProofContext
from .result import PaddingProof, PaddingViolation
from .tables import _SAFE_NAMESPACES

__all__ = ["check_padding_safety", "prove_padding"]


def _check_node(node: torch.fx.Node, ctx: ProofContext) -> tuple[Finding | None, str]:
    """The violation at ``node`` (or None) and the rule that decided it, for a node no pattern rule claimed."""
    if node.op in ("placeholder", "output", "get_attr"):
        return None, node.op
    inputs = [n for n in _iter_nodes((node.args, node.kwargs))]
    tensor_in = [n for n in inputs if tensors_of(n)]
    tensor_out = tensors_of(node)
    if not tensor_in and not tensor_out:
        return None, "no_tensor"  # SymInt / SymFloat arithmetic, size queries of nothing, asserts
    padded_in = any(ctx.padded(t) for n in tensor_in for t in tensors_of(n))
    padded_out = any(ctx.padded(t) for t in tensor_out)
    if not padded_in and not padded_out and _value_use(node, ctx) is None:
        return None, "unpadded"  # nothing padded goes in, comes out, or is used as a value
    name = _op_name(node)
    rule = OP_RULES.get(name, UNKNOWN_OP) if name is not None else UNKNOWN_OP
    ctx.notes.clear()
    hit = rule.check(node, name, ctx)
    return hit, ctx.notes[-1] if ctx.notes else rule.name


def _prove_patterns(
    gm: torch.fx.GraphModule, ctx: ProofContext, rules: Sequence[PatternRule], provenance: Callable[[dict], Mapping]
) -> tuple[ProofContext, list[tuple[PatternRule, Any]]]:
    """Run ``rules`` to a fixpoint: the facts their proofs carry are added to the index-provenance facts
    (``provenance(carried)``) until no rule proves a new node; return the context with those facts and the proofs
    (with their rules). A rule that ``needs_causal`` runs only with ``causal_ok``."""
    carried: dict[torch.fx.Node, Any] = {}
    while True:
        found = [(rule, p) for rule in rules if ctx.causal_ok or not rule.needs_causal for p in rule.prove(gm, ctx)]
        more = {n: f for _, p in found for n, f in getattr(p, "facts", ())}
        if more.keys() <= carried.keys():
            return ctx, found
        carried.update(more)
        ctx = replace(ctx, facts=provenance(carried))


def _claim(found: list[tuple[PatternRule, Any]], live: frozenset, result: PaddingProof) -> dict[torch.fx.Node, tuple]:
    """Each live node a proof names -> (the rule's name, the violation it found there or None): the first rule
    to name a node claims it. A proof that claimed a node adds the causal functions it trusts to ``result``."""
    claimed: dict[torch.fx.Node, tuple[str, Finding | None]] = {}
    for rule, proof in found:
        mine = [n for n in proof.nodes if n in live and n not in claimed]
        findings = getattr(proof, "findings", {})
        claimed.update({n: (rule.name, findings.get(n)) for n in mine})
        if mine:
            result.trusted.update(getattr(proof, "trusted", ()))
    return claimed


def _checks(
    gm: torch.fx.GraphModule,
    ctx: ProofContext,
    found: list,
    result: PaddingProof,
    values: Mapping[str, Any] | None,
    table_names: Mapping[str, str] | None,
) -> None:
    """What the caller must check: per call (the inputs that must hold 1, the causal tables read) and per bucket
    (the pattern proofs' own conditions, the position tables' rows, the trusted causal functions' guards)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    result.tables.update(
        {
            n.name: CausalTable(n.name, values[n.name])
            for n in placeholders
            if n in ctx.live and isinstance(ctx.facts.get(n), Causal)
        }
    )
    ones = {i: n.name for i, n in enumerate(placeholders) if n.name in result.relied_on}
    tables = {i: result.tables[n.name] for i, n in enumerate(placeholders) if n.name in result.tables}
    result.call_checks += [
        c for c in (OnesCheck(ones) if ones else None, CausalTablesCheck(tables) if tables else None) if c is not None
    ]
    result.bucket_checks += [c for _, p in found for c in getattr(p, "bucket_checks", ())]
    if result.table_reads:
        names = table_names or {}
        result.bucket_checks.append(
            TableBuckets(tuple(replace(r, table=names[r.table]) if r.table in names else r for r in result.table_reads))
        )
    if result.trusted:
        result.bucket_checks.append(GuardBuckets(gm, tuple(sorted(result.trusted))))


def prove_padding(
    gm: torch.fx.GraphModule,
    symbols: Iterable[Any],
    *,
    causal_ok: bool = True,
    ties: Mapping[sympy.Symbol, sympy.Symbol] | None = None,
    zero_padded: Iterable[str] = (),
    values: Mapping[str, Any] | None = None,
    rules: Sequence[Any] = (),
    buckets: tuple[int, ...] = (),
    bucket_symbols: Iterable[Any] | None = None,
    table_names: Mapping[str, str] | None = None,
    upper: Mapping[str, int] | None = None,
) -> PaddingProof:
    """The padding proof of ``gm`` for the dims sized by ``symbols`` (see :func:`check_padding_safety` for
    ``causal_ok``, ``ties``, ``zero_padded`` and ``values``). ``rules``: extra whole-pattern rules
    (:class:`.patterns.PatternRule`, or functions ``rule(gm, facts, same_size, padded)``), which claim nodes before
    the built-in ones (:data:`.patterns.PATTERN_RULES`). With ``buckets``, the bucket checks are decided there
    (``bucket_symbols``: every bucketed symbol, default ``symbols``) into ``invalid_buckets`` and ``refused``;
    ``table_names``: placeholder name -> the name a position table is reported by (its module's FQN); ``upper``:
    symbol name -> the largest size a padded call runs at (the largest bucket): integer facts survive a narrow dtype
    only where their values fit it up to there (without it, only the shape env's ranges count).

    Every live node is checked by the pattern rule that claimed it or by its op rule (whether it mixes rows), then
    by the layout sweep (:mod:`.layout`: whether its padded dims' real rows are still a prefix where it needs them).

    Where Dynamo's guards require the length to be a multiple of ``c`` (a graph traced at a multiple of a chunk size,
    :mod:`.guards`), the proof reads every size as it is at the multiples, and the buckets that are not one are
    invalid."""
    names = _symbol_names(symbols)
    env = shape_env_of([example_of(n) for n in gm.graph.nodes if n.op == "placeholder"])
    multiples = multiples_from_guards(env, names, CAUSAL_FUNCTIONS)
    with canonical_sizes(MultipleCanon({s: c for s, (c, _) in multiples.items()}) if multiples else None):
        result = _prove(gm, names, causal_ok, ties, zero_padded, values, rules, table_names, upper)
        if multiples:
            result.bucket_checks.insert(
                0, MultipleBuckets(tuple((str(s), c, why) for s, (c, why) in multiples.items()))
            )
        if buckets:
            result.check_buckets(_symbol_names(bucket_symbols if bucket_symbols is not None else symbols), buckets)
    return result


def _prove(
    gm: torch.fx.GraphModule,
    names: frozenset[str],
    causal_ok: bool,
    ties: Any,
    zero_padded: Iterable[str],
    values: Any,
    rules: Sequence[Any],
    table_names: Any,
    upper: Any,
) -> PaddingProof:
    """:func:`prove_padding`'s proof, the bucket checks listed but not decided."""

    def provenance(carried: dict | None = None) -> MappingProxyType:
        zero = _zero_padded(gm, set(zero_padded), names)
        return MappingProxyType(index_provenance(gm, zero, ties, values, carried, upper))

    live = frozenset(_live_nodes(gm))
    ctx = ProofContext(
        names=names, causal_ok=causal_ok, facts=provenance(), ties=MappingProxyType(dict(ties or {})), live=live
    )
    extra = [as_pattern_rule(r) for r in rules]
    ctx, found = _prove_patterns(gm, ctx, [*extra, *PATTERN_RULES], provenance)
    result = PaddingProof(proofs=[p for rule, p in found if any(rule is r for r in extra)])
    claimed = _claim(found, live, result)
    layout = layout_violations(gm, ctx.padded, claimed)
    for node in (n for n in gm.graph.nodes if n in live):
        rule, hit = claimed[node] if node in claimed else _check_node(node, ctx)[::-1]
        if hit is None and node in layout:
            rule, hit = "layout", layout[node]
        if hit is not None:
            note = drift_note(node)
            result.violations.append(
                PaddingViolation(
                    node=node.name,
                    op=_label(node),
                    dim=hit[0],
                    reason=f"{hit[1]} ({note})" if note else hit[1],
                    source=_source(node),
                )
            )
        else:
            result.proven_by[node.name] = rule
            result.accepted_by[rule] += 1
    result.relied_on |= ctx.relied_on
    result.trusted |= ctx.trusted
    result.table_reads += ctx.table_reads
    _checks(gm, ctx, found, result, values, table_names)
    return result


def check_padding_safety(
    gm: torch.fx.GraphModule,
    symbols: set[sympy.Symbol],
    *,
    causal_ok: bool = True,
    ties: Mapping[sympy.Symbol, sympy.Symbol] | None = None,
    zero_padded: Iterable[str] = (),
    relied_on: set[str] | None = None,
    trusted: set[str] | None = None,
    values: Mapping[str, Any] | None = None,
    tables: dict[str, CausalTable] | None = None,
    rules: Sequence[Any] = (),
    proofs: list[Any] | None = None,
    table_reads: list[TableRead] | None = None,
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
    ``rules``: whole-pattern rules (:class:`.patterns.PatternRule`, e.g. :data:`..topk_mask.TOPK_MASKS`, a sparse-attention
    indexer's top-k that only narrows a causal mask): the nodes of each pattern a rule proves are not checked op by
    op, and the facts it proves feed the index-provenance facts, to a fixpoint (a later layer's pattern may be proven
    through an earlier one's). Only where the padding sits at the end (``causal_ok``). ``proofs``: when given, filled
    with the proofs; a proof may hold conditions on the bucket sizes that the caller checks (a top-k's ``k``).
    ``table_reads``: when given, filled with the lookups of static-size tables by position (:mod:`.position_tables`).
    ``upper``: symbol name -> the largest size a padded call runs at (see :func:`prove_padding`).

    Nodes whose values reach no output (dead code the model computes and never uses) are not checked.
    Returns the violations in graph order; an empty list means padding is safe.
    """
    result = prove_padding(
        gm, symbols, causal_ok=causal_ok, ties=ties, zero_padded=zero_padded, values=values, rules=rules, upper=upper
    )
    _hand_back(result, relied_on, trusted, tables, proofs, table_reads)
    return result.violations


def _hand_back(
    result: PaddingProof,
    relied_on: set[str] | None,
    trusted: set[str] | None,
    tables: dict[str, CausalTable] | None,
    proofs: list[Any] | None,
    table_reads: list[TableRead] | None,
) -> None:
    """Fill the caller's collections that :func:`check_padding_safety` was given from the proof's ``result``."""
    for into, got in ((relied_on, result.relied_on), (trusted, result.trusted)):
        if into is not None:
            into.update(got)
    if tables is not None:
        tables.update(result.tables)
    if proofs is not None:
        proofs.extend(result.proofs)
    if table_reads is not None:
        table_reads.extend(result.table_reads)


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
    roots = [
        n
        for n in gm.graph.nodes
        if n.op in ("output", "call_module")
        or (
            n.op in ("call_function", "call_method")
            and (
                _namespace(n.target) in _SAFE_NAMESPACES
                or any(writes_into(n, a) for a in flat_nodes((n.args, n.kwargs)))
            )
        )
    ]
    live: set[torch.fx.Node] = set()
    while roots:
        n = roots.pop()
        if n not in live:
            live.add(n)
            roots.extend(n.all_input_nodes)
    return live
