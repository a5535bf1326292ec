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
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..analysis import GraphAnalysis
from ..config import GraphpassConfig
from ..errors import GraphpassError, PassError
from ..roots import Roots
from ..static_shapes.plan import StaticBounds

if TYPE_CHECKING:
    from ..capturing.model_capture import CaptureSpec


@dataclass
class PassContext:
    gm: torch.fx.GraphModule
    example_inputs: Sequence[Any]
    config: GraphpassConfig
    roots: Roots = field(default_factory=Roots)  # the model objects the graph's sources start from
    captures: list[CaptureSpec] = field(default_factory=list)  # specs of the ModelCaptures attached to the model
    static_bounds: StaticBounds = field(
        default_factory=dict
    )  # size symbol -> upper bound (largest bucket): BucketPlan.bounds
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
        """Run this one pass under the runner's contract (:func:`run_pass`)."""
        return run_pass(self, ctx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# The runner: every pass runs through run_pass, in the pipeline (graphpass.pipeline.run_pipeline)
# and alone (GraphPass.__call__).

_graphs_log = logging.getLogger("graphpass.graphs")


def check_well_formed(graph: torch.fx.Graph, pass_name: str, graph_name: str = "graph") -> None:
    """The graph is in topological order and every argument is defined before it is used."""
    try:
        graph.lint()
    except Exception as err:  # noqa: BLE001 - FX reports malformed graphs as RuntimeError / AssertionError
        raise PassError(pass_name, graph_name, f"left a malformed graph: {err}") from err


def run_pass(p: GraphPass, ctx: PassContext) -> bool:
    """Run one pass under the contract: skip it when ``should_run`` says so; time it; turn an
    unexpected exception into a :class:`PassError` naming the pass and the graph; after a change,
    check the graph is well formed and recompile it. Returns whether the pass changed the graph."""
    if not p.should_run(ctx):
        p.logger.debug("%s: skipped on %s", p.name, ctx.graph_name)
        return False
    if _graphs_log.isEnabledFor(logging.DEBUG):
        _graphs_log.debug("%s before %s:\n%s", ctx.graph_name, p.name, readable(ctx.gm))
    _trace_graph(ctx, f"before_{p.name}")
    lines = len(ctx.log)
    t0 = time.perf_counter()
    try:
        changed = p.run(ctx)
    except GraphpassError:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised with the pass named, the original as cause
        raise PassError(p.name, ctx.graph_name, f"{type(err).__name__}: {err}") from err
    if not isinstance(changed, bool):
        raise PassError(
            p.name, ctx.graph_name, f"run() returned {changed!r}: a pass returns whether it changed the graph"
        )
    if changed:
        check_well_formed(ctx.gm.graph, p.name, ctx.graph_name)
        ctx.gm.recompile()
    if p.logger.isEnabledFor(logging.DEBUG):
        what = "; ".join(ctx.log[lines:]) or "nothing to report"
        p.logger.debug(
            "%s: %.2f ms on %s, %s: %s",
            p.name,
            (time.perf_counter() - t0) * 1e3,
            ctx.graph_name,
            "changed the graph" if changed else "graph unchanged",
            what,
        )
    if changed and _graphs_log.isEnabledFor(logging.DEBUG):
        _graphs_log.debug("%s after %s:\n%s", ctx.graph_name, p.name, readable(ctx.gm))
    _trace_graph(ctx, f"after_{p.name}")
    return changed


def _trace_graph(ctx: PassContext, when: str) -> None:
    """The graph as an artifact of torch's structured trace (``TORCH_TRACE``, read by tlparse),
    named ``graphpass_<graph>_<before|after>_<pass>``; torch builds nothing unless the trace is on."""
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"graphpass_{ctx.graph_name}_{when}", "encoding": "string"},
        payload_fn=lambda: readable(ctx.gm),
    )


def readable(gm: torch.fx.GraphModule) -> str:
    try:
        return gm.print_readable(print_output=False)
    except Exception:  # noqa: BLE001 - a graph that cannot be printed is still logged by its nodes
        return str(gm.graph)
