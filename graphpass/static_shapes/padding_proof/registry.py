"""The two rule tables of the padding proof, keyed by op name, and the context the op rules read.

* **Op rules** (:data:`OP_RULES`, filled with :func:`op_rule`): the check of one op, ``check(node, name, ctx)``
  -> ``(dim, reason)`` for a violation, or None. One rule per name; a name without one falls to the conservative
  default (``unknown op ...: cannot prove row independence``, :data:`.op_checks.UNKNOWN_OP`).
* **Fact rules** (:data:`FACT_RULES`, filled with :func:`fact_rule`): what a node's values are known to hold
  (:mod:`.facts`), ``rule(node, name, out, env)`` -> a fact or None. A name may have several, tried in the order
  they were registered; the first non-None wins, and a ``final`` rule ends the search even with None.

Modelled on torch's value-range analysis (a handler per op name, a conservative default) and inductor's
``register_graph_pattern``. A rule module registers its rules when imported; :mod:`.prove` imports them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import sympy
import torch

from ...fx_utils import example_of, mentions_symbol, size_expr
from ..position_tables import TableRead

__all__ = [
    "FACT_RULES",
    "FactEnv",
    "FactRule",
    "Finding",
    "OP_RULES",
    "OpRule",
    "ProofContext",
    "fact_rule",
    "op_rule",
    "remove_op_rule",
]

Finding = tuple[Optional[int], str]  # (the padded dim an op mixes along, or None; the reason)


@dataclass(frozen=True)
class ProofContext:
    """What the op and pattern rules read (the padded symbols, the facts, ...) and fill (the inputs and causal
    functions an accepted proof relies on, the tables read by position, which rule accepted a node)."""

    names: frozenset[str]
    causal_ok: bool
    facts: Mapping[torch.fx.Node, Any] = field(default_factory=dict)  # index provenance (Positions / Causal)
    ties: Mapping[Any, Any] = field(default_factory=dict)  # symbol -> the padded symbol it equals on every call
    relied_on: set[str] = field(default_factory=set)  # zero-padded inputs an accepted proof needs to hold 1 (filled)
    trusted: set[str] = field(default_factory=set)  # causal functions checked as a whole (filled)
    table_reads: list[TableRead] = field(default_factory=list)  # static-size tables looked up by position (filled)
    live: frozenset[torch.fx.Node] = frozenset()  # the nodes whose values reach an output
    notes: list[str] = field(default_factory=list)  # the sub-rules that accepted the node being checked (filled)

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

    def because(self, rule: str) -> None:
        """Record that ``rule`` (a finer name than the op rule's: ``causal_sdpa``, ``masked_softmax``) accepted
        the node being checked (``PaddingProof.proven_by``)."""
        self.notes.append(rule)


# --------------------------------------------------------------------------------------------
# Op rules
# --------------------------------------------------------------------------------------------

OpCheck = Callable[[torch.fx.Node, str, ProofContext], Optional[Finding]]


@dataclass(frozen=True)
class OpRule:
    """The check of the ops it is registered for: ``check(node, name, ctx)`` -> a violation or None."""

    name: str
    check: OpCheck


#: op name -> its rule. A name missing here is an unknown op (:data:`.op_checks.UNKNOWN_OP`).
OP_RULES: dict[str, OpRule] = {}


def op_rule(*names: str, name: str | None = None, replace: bool = False) -> Callable[[OpCheck], OpCheck]:
    """Register the decorated check as the op rule of ``names`` (called ``name``, default the function's name
    without ``_check_``). A name may have one op rule: registering another raises unless ``replace``."""

    def register(check: OpCheck) -> OpCheck:
        rule = OpRule(name or check.__name__.removeprefix("_check_"), check)
        taken = [n for n in names if n in OP_RULES and OP_RULES[n].check is not check]
        if taken and not replace:
            raise ValueError(f"op rule {rule.name!r}: {taken} already have a rule ({OP_RULES[taken[0]].name!r})")
        for n in names:
            OP_RULES[n] = rule
        return check

    return register


def remove_op_rule(*names: str) -> None:
    """Drop the op rules of ``names`` (they become unknown ops again)."""
    for n in names:
        OP_RULES.pop(n, None)


# --------------------------------------------------------------------------------------------
# Fact rules
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FactEnv:
    """What a fact rule reads besides the node: the facts found so far, the nodes that may hold a fill value
    (``huge``), and the size symbols padded together (``ties``)."""

    facts: Mapping[torch.fx.Node, Any]
    huge: Any = frozenset()
    ties: Mapping[Any, Any] = field(default_factory=dict)


FactFn = Callable[[torch.fx.Node, str, torch.Tensor, FactEnv], Any]


@dataclass(frozen=True)
class FactRule:
    """A rule that may prove a fact of a node: ``rule(node, name, out, env)``; ``final``: when it applies to a
    name, no later rule is tried, even when it proves nothing."""

    name: str
    rule: FactFn
    final: bool = False


#: op name -> its fact rules, in the order they are tried.
FACT_RULES: dict[str, list[FactRule]] = {}


def fact_rule(*names: str, final: bool = False, name: str | None = None) -> Callable[[FactFn], FactFn]:
    """Register the decorated function as a fact rule of ``names``, tried after the rules registered before it."""

    def register(fn: FactFn) -> FactFn:
        rule = FactRule(name or fn.__name__.strip("_"), fn, final)
        for n in names:
            FACT_RULES.setdefault(n, []).append(rule)
        return fn

    return register
