"""The pass contract: what every pass receives (:class:`PassContext`) and what it promises (:class:`GraphPass`).

A pass

* has a ``name`` (its file's name) and a module docstring saying what it inserts and what it assumes;
* declares the passes that must have run before it in ``requires`` (their names), which
  :func:`graphpass.pipeline.check_pipeline` checks once against ``PIPELINE``;
* implements :meth:`GraphPass.run`, which returns whether it changed the graph. It never lints or
  recompiles the graph itself: the runner (:func:`graphpass.pipeline.run_pipeline`) does, only
  after a pass that changed it, and checks that the graph is still well formed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..analysis import GraphAnalysis
from ..config import GraphpassConfig
from ..roots import Roots

if TYPE_CHECKING:
    import sympy

    from ..capturing.model_capture import CaptureSpec


@dataclass
class PassContext:
    gm: torch.fx.GraphModule
    example_inputs: Sequence[Any]
    config: GraphpassConfig
    roots: Roots = field(default_factory=Roots)  # the model objects the graph's sources start from
    captures: list[CaptureSpec] = field(default_factory=list)  # specs of the ModelCaptures attached to the model
    static_bounds: dict[sympy.Symbol, int] = field(default_factory=dict)  # size symbol -> upper bound (largest bucket)
    analysis: GraphAnalysis = field(default_factory=GraphAnalysis)
    log: list[str] = field(default_factory=list)  # what each pass did, one line per change
    graph_name: str = "graph"  # how errors and logs name this graph ("graph 0 of forward")


class GraphPass:
    """One step of the pipeline. Subclasses set ``name`` (and ``requires``) and implement :meth:`run`."""

    name: str = "pass"
    requires: tuple[str, ...] = ()  # names of passes that must run earlier in the pipeline

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(f"graphpass.passes.{self.name}")

    def should_run(self, ctx: PassContext) -> bool:
        return True

    def run(self, ctx: PassContext) -> bool:  # pragma: no cover - abstract
        """Transform or analyse ``ctx.gm`` in place; return True when the graph changed."""
        raise NotImplementedError

    def __call__(self, ctx: PassContext) -> bool:
        """Run this one pass under the runner's contract (see :func:`graphpass.pipeline.run_pass`)."""
        from ..pipeline import run_pass

        return run_pass(self, ctx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
