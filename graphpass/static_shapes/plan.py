"""The static-shape bucketing plan of one graph (:class:`BucketPlan`, recorded on
``GraphAnalysis.bucket_plan`` by ``plan_static_shapes``, read by the bucket dispatcher) and the
size bounds it implies (:data:`StaticBounds`, ``PassContext.static_bounds``, read by
``slice_static_buffers``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

import sympy
import torch

from .config import StaticShapesConfig

StaticBounds = Dict[sympy.Symbol, int]  # size symbol -> upper bound (the largest bucket)


@dataclass
class BucketPlan:
    symbols: dict[sympy.Symbol, tuple[int, int]]  # symbol -> (placeholder index, dim) it is read from
    pad: dict[int, tuple[tuple[int, sympy.Symbol], ...]]  # placeholder index -> (dim, its symbol) to pad
    pad_values: dict[int, float]  # placeholder index -> pad value
    size_inputs: dict[int, sympy.Expr]  # placeholder index of a SymInt input -> its expression
    outputs: list[Any]  # per output: None (no padded dim) or per-dim None / (symbol, a, b): size a*L + b
    refused: list[str] = field(default_factory=list)  # why this graph runs dynamic (empty: bucketed)
    ties: dict[sympy.Symbol, sympy.Symbol] = field(
        default_factory=dict
    )  # symbol of another input's dim -> the bucketed symbol it must equal
    # what the padding proof holds under, checked by the dispatcher on every call (``padding_proof.CallCheck``: an
    # input that must hold 1 everywhere, a causal table that must keep its values); a failed one: the call runs unpadded
    call_checks: list[Any] = field(default_factory=list)
    # placeholder index -> name of a padded input whose zero padding the padding proof may rely on (a mask read from
    # the padding of an attention mask); the checked mode (``verify``) keeps their fill and varies every other one
    zero_inputs: dict[int, str] = field(default_factory=dict)
    unsliced: torch.fx.GraphModule | None = (
        None  # copy of the graph before slice_static_buffers, for the dynamic fallback
    )
    # bucket -> why calls landing there run unpadded (``padding_proof.InvalidBucket``: ``GuardFails``, a Dynamo guard
    # that fails there for a graph proven through a causal function's code; ``NotProven``, a proof that holds at some
    # buckets only: a top-k indexer keeping fewer keys than the bucket, a position table too short)
    invalid_buckets: dict[int, Any] = field(default_factory=dict)

    @property
    def ones_inputs(self) -> dict[int, str]:
        """Placeholder index -> name of an input that must hold 1 at every position (from :attr:`call_checks`)."""
        from .padding_proof import OnesCheck

        return {i: n for c in self.call_checks if isinstance(c, OnesCheck) for i, n in c.ones.items()}

    @property
    def causal_tables(self) -> dict[int, Any]:
        """Placeholder index -> the :class:`~.buffer_masks.CausalTable` read from it (from :attr:`call_checks`)."""
        from .padding_proof import CausalTablesCheck

        return {i: t for c in self.call_checks if isinstance(c, CausalTablesCheck) for i, t in c.tables.items()}

    @property
    def active(self) -> bool:
        return not self.refused

    def bounds(self, cfg: StaticShapesConfig) -> StaticBounds:
        """Each bucketed symbol (not the symbols tied to it) -> its upper bound, the largest bucket;
        empty when the plan is refused. What :mod:`slice_static_buffers` sizes its buffers by."""
        if not self.active:
            return {}
        return {sym: cfg.largest for sym in self.symbols if sym not in self.ties}
