"""What the padding proof asks the caller to check: per call (:class:`OnesCheck`, :class:`CausalTablesCheck`, read
by the dispatcher on every call) and per bucket (:class:`TableBuckets`, :class:`GuardBuckets`; the top-k indexer's
is :class:`..topk_mask.TopkBuckets`), each under the protocols of :mod:`.result`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import sympy
import torch

from ...fx_utils import example_of
from ...tensor_utils import shape_env_of
from ..buffer_masks import CausalTable
from ..causal_functions import benign_guard
from ..config import pads_on_host
from ..position_tables import TableRead, _largest_fitting, _last_at
from .guards import guard_where
from .op_guards import recorded_inside_an_op, replay_differs
from .result import GuardFails, NotProven, PaddingProof

__all__ = ["CausalTablesCheck", "GuardBuckets", "OnesCheck", "TableBuckets"]


def _all_ones(t: Any) -> bool:
    """Every element of ``t`` is 1 (read on the host for a lazy-tensor device, where a device-side reduction
    would compile a computation per length)."""
    if not isinstance(t, torch.Tensor):
        return False
    return bool((t.cpu() if pads_on_host(t) else t).eq(1).all())


@dataclass
class OnesCheck:
    """Zero-padded inputs an accepted additive-mask proof needs to hold 1 at every position (no real query row
    fully masked): ``ones``, placeholder position -> name."""

    ones: dict[int, str]
    name: str = "ones_inputs"
    _failed: list[str] = field(default_factory=list, repr=False)

    @property
    def inputs(self) -> tuple[int, ...]:
        return tuple(self.ones)

    def holds(self, args: Sequence[Any]) -> bool:
        self._failed = [name for i, name in self.ones.items() if not _all_ones(args[i])]
        return not self._failed

    def why(self) -> str:
        return (
            f"{', '.join(self._failed)} is not 1 everywhere in this call, and the padding proof of this graph's "
            "additive attention mask needs it (a fully masked row's softmax is uniform over the padded length)"
        )


@dataclass
class CausalTablesCheck:
    """Boolean inputs (a module's ``tril`` buffer) read as causal masks from their values (:mod:`..buffer_masks`):
    ``tables``, placeholder position -> :class:`..buffer_masks.CausalTable`; each call's tensors must still be."""

    tables: dict[int, CausalTable]
    name: str = "causal_tables"
    _failed: list[str] = field(default_factory=list, repr=False)

    @property
    def inputs(self) -> tuple[int, ...]:
        return tuple(self.tables)

    def holds(self, args: Sequence[Any]) -> bool:
        self._failed = [t.name for i, t in self.tables.items() if not t.holds(args[i])]
        return not self._failed

    def why(self) -> str:
        return (
            f"{', '.join(self._failed)} is no longer the causal (lower-triangular) table this graph's padding "
            "proof read its attention mask from"
        )


@dataclass(frozen=True)
class TableBuckets:
    """The buckets whose padding rows would read past a table looked up by position (:mod:`..position_tables`)."""

    reads: tuple[TableRead, ...]
    name: str = "position_tables"

    def mark(self, proof: PaddingProof, names: set[str], buckets: tuple[int, ...]) -> None:
        _table_invalid_buckets(proof, names, buckets, list(self.reads))


@dataclass(frozen=True)
class GuardBuckets:
    """The buckets at which a guard Dynamo recorded on a padded length fails, for a graph proven through a causal
    function's code (:mod:`..causal_functions`)."""

    gm: torch.fx.GraphModule
    trusted: tuple[str, ...]
    name: str = "causal_function_guards"

    def mark(self, proof: PaddingProof, names: set[str], buckets: tuple[int, ...]) -> None:
        _guard_invalid_buckets(proof, self.gm, names, buckets, list(self.trusted))


def _guard_invalid_buckets(
    plan: PaddingProof, gm: torch.fx.GraphModule, names: set[str], buckets: tuple[int, ...], trusted: list[str]
) -> None:
    """Fill ``plan.invalid_buckets``: buckets at which a guard Dynamo recorded on a padded length fails.

    A causal function's proof (``static_shapes/causal_functions.py``) is about its code at every size. The graph
    is the code's trace at the traced length: a branch on the length (``if pad_size > 0``, a loop over the chunk
    count, the parity tests of ``associative_scan``'s recursion) is baked in and guarded. At a bucket where such a
    guard fails, the graph is not the code's trace at that size, so the proof says nothing there. Each guard that
    mentions only padded symbols is evaluated with every one set to the bucket; a false or undecided guard marks the
    bucket. A guard that also mentions another size (``Eq(s16, s27)``: the length of an input of another graph of
    the frame, checked by Dynamo on the real call) is not about this graph's trace, and neither is a guard at one of
    the trusted function's lines listed as benign (``CausalFunction.benign_guards``: ``if pad_size > 0``, the loop
    over the chunks, each with its reason). A guard recorded inside an op (a layout check of torch 2.9's meta
    functions, :mod:`.op_guards`) is checked by its consequence instead: the graph replayed at the bucket's static
    sizes must give every node its traced sizes. Every bucket marked: the plan is refused."""
    env = shape_env_of([example_of(n) for n in gm.graph.nodes if n.op == "placeholder"])
    if env is None:
        plan.refused.append(f"{', '.join(trusted)}: no shape environment to check Dynamo's guards at the buckets")
        return
    for b in buckets:
        if b in plan.invalid_buckets:
            continue  # already marked by an earlier check (its reason kept)
        failing, inside_ops = _failing_guards(env, names, b, trusted)
        if failing is None and inside_ops:
            why = replay_differs(gm, env, names, b)
            if why is not None:
                failing = f"{inside_ops[0]}, recorded inside an op, and at the bucket's static sizes {why}"
        if failing is not None:
            plan.invalid_buckets[b] = GuardFails(failing)
    if len(plan.invalid_buckets) == len(buckets):
        b, why = next(iter(plan.invalid_buckets.items()))
        plan.refused.append(
            f"{', '.join(trusted)} proven for the code, but Dynamo's guard {why} fails at every bucket "
            f"(at {b} first): the traced graph is not the code's trace at any bucket size"
        )


def _failing_guards(env: Any, names: set[str], b: int, trusted: list[str]) -> tuple[str | None, list[str]]:
    """The first guard on the padded symbols that fails at bucket ``b`` and is neither benign nor recorded inside
    an op (as ``"<guard> (<where>)"``), or None; and the guards recorded inside an op that fail there."""
    inside_ops: list[str] = []
    for guard in getattr(env, "guards", ()):
        padded = [s for s in guard.expr.free_symbols if str(s) in names]
        if not padded:
            continue
        try:
            value = guard.expr.xreplace({s: sympy.Integer(b) for s in padded})
        except TypeError:
            value = None
        if isinstance(value, sympy.Basic) and value.free_symbols:
            continue  # relates the length to another size (``Eq(s16, s27)``: a mask of another graph)
        if value is sympy.true:
            continue
        where = guard_where(guard) or str(getattr(guard, "sloc", ""))
        if benign_guard(where, trusted, guard.expr) is not None:
            continue  # a branch of the proven code that is the same at the bucket for the real rows
        if recorded_inside_an_op(guard):
            inside_ops.append(f"{guard.expr} ({where})")
            continue
        return f"{guard.expr} ({where})", inside_ops
    return None, inside_ops


def _table_invalid_buckets(
    plan: PaddingProof, syms: Iterable[Any], buckets: tuple[int, ...], reads: list[TableRead]
) -> None:
    """Mark ``plan.invalid_buckets`` where a padding row would read past a position table (see
    :mod:`..position_tables`); every bucket marked: the plan is refused."""
    names = {str(s) for s in syms}
    for read in reads:
        largest = _largest_fitting(read, names)
        fits = f"; buckets up to {largest} fit" if largest is not None else ""
        for b in buckets:
            last = _last_at(read, b, names)
            if b in plan.invalid_buckets or (last is not None and last < read.rows):
                continue
            plan.invalid_buckets[b] = NotProven(
                f"{read.what} reads row {last if last is not None else read.last} of {read.table}, which "
                f"has {read.rows} rows, at bucket {b} (its padding rows read positions past the table){fits}"
            )
        if len(plan.invalid_buckets) == len(buckets):
            plan.refused.append(
                f"{read.what} reads {read.table} ({read.rows} rows) by position: every bucket "
                f"({', '.join(map(str, buckets))}) would read past it with its padding rows{fits}"
            )
            return
