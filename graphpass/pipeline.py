"""The graphpass pipeline: every pass, in the order it runs, and the runner that enforces the
pass contract. This file is the only place the order is written down; each pass lives in a file
of its own under ``graphpass/passes/`` (the contract: :mod:`graphpass.passes.base`).

Dynamo-level passes (``PIPELINE``) run on the graph Dynamo hands the backend, before the delegate
lowers it. Aten-level passes (``POST_GRAD_PASSES``) run inside inductor, after AOTAutograd split
the graph into forward and backward; the inductor delegate installs them from here.

Logging: every pass reports to ``logging.getLogger("graphpass.passes.<name>")`` at DEBUG (its wall
time and what it changed); ``graphpass.graphs`` carries the graphs themselves. The environment
variable ``GRAPHPASS_LOG`` turns them on without code (:mod:`graphpass.pass_logging`, which holds
that process-wide state; ``configure_logging_from_env`` is re-exported here).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass  # pin_backward_loads imports it already

from graphpass.backends import Delegate, InductorDelegate

from .config import GraphpassConfig
from .errors import PassError
from .fx_utils import is_graphpass_node
from .pass_logging import configure_logging_from_env
from .passes.analyze_ownership import AnalyzeOwnership
from .passes.assign_traps import AssignTraps
from .passes.base import GraphPass, PassContext, check_well_formed, readable as _readable, run_pass  # noqa: F401 (the runner)
from .passes.insert_capture_nodes import InsertCaptureNodes
from .passes.insert_offload_schedule import InsertOffloadSchedule
from .passes.insert_trap_boundaries import InsertTrapBoundaries
from .passes.pin_backward_loads import PinBackwardLoads
from .passes.plan_static_shapes import PlanStaticShapes
from .passes.slice_static_buffers import SliceStaticBuffers
from .roots import Roots


PIPELINE: tuple[GraphPass, ...] = (
    AnalyzeOwnership(),  # inputs -> FQNs -> holding and consuming modules, bytes
    AssignTraps(),  # ops and weights -> trap labels (manual, patterns, or repeated blocks)
    InsertTrapBoundaries(),  # graphpass::trap_enter / trap_exit around each trap region
    InsertOffloadSchedule(),  # graphpass::load_start / load_wait / evict per trap for offloaded weights
    InsertCaptureNodes(),  # graphpass::capture after each output of ModelCapture-selected modules
    PlanStaticShapes(),  # static_shapes: pad/slice contract per bucket + padding-safety verdict
    SliceStaticBuffers(slice_outputs=False),  # symbolic-size factories -> slices of max-size buffers
)

# Aten-level passes inductor runs after AOTAutograd (``post_grad_custom_post_pass``), in order.
POST_GRAD_PASSES: tuple[CustomGraphPass, ...] = (
    PinBackwardLoads(),  # backward re-loads: a data dependency so each starts when the backward reaches its trap
)

_log = logging.getLogger("graphpass")
_graphs_log = logging.getLogger("graphpass.graphs")


def check_pipeline(passes: Sequence[GraphPass]) -> None:
    """Every pass's ``requires`` names a pass that runs earlier in ``passes``; names are unique."""
    seen: set[str] = set()
    for p in passes:
        missing = [r for r in p.requires if r not in seen]
        if missing:
            raise PassError(p.name, "the pipeline", f"requires {', '.join(missing)} to run before it")
        if p.name in seen:
            raise PassError(p.name, "the pipeline", "listed twice")
        seen.add(p.name)


check_pipeline(PIPELINE)  # once, when the pipeline is defined


def run_pipeline(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: GraphpassConfig,
    roots: Roots | None = None,
    captures: Sequence[Any] = (),
    passes: Sequence[GraphPass] = PIPELINE,
    graph_name: str = "graph",
) -> PassContext:
    """Run ``passes`` over ``gm`` in place and return the context holding the shared analysis."""
    configure_logging_from_env()
    if passes is not PIPELINE:
        check_pipeline(passes)
    ctx = PassContext(
        gm=gm,
        example_inputs=list(example_inputs),
        config=config,
        roots=roots if roots is not None else Roots(),
        captures=list(captures),
        graph_name=graph_name,
    )
    t0 = time.perf_counter()
    changed = [p.name for p in passes if run_pass(p, ctx)]
    if _log.isEnabledFor(logging.INFO):
        _log.info(
            "graphpass: %s in %.1f ms; changed by %s",
            graph_name,
            (time.perf_counter() - t0) * 1e3,
            ", ".join(changed) or "no pass",
        )
    if _graphs_log.isEnabledFor(logging.INFO) and not _graphs_log.isEnabledFor(logging.DEBUG):
        _graphs_log.info("%s after the pipeline:\n%s", graph_name, _readable(gm))
    return ctx


def inductor_post_grad_pass(gm: torch.fx.GraphModule) -> CustomGraphPass | None:
    """The ``post_grad_custom_post_pass`` inductor gets for ``gm``: the post-grad passes, when the
    graph holds graphpass ops they act on (today: offload loads), else None (inductor's FX graph
    cache stays usable for graphs graphpass did not touch)."""
    if not any(is_graphpass_node(n) for n in gm.graph.nodes):
        return None
    passes = [p for p in POST_GRAD_PASSES if p.applies_to(gm)]
    if not passes:
        return None
    return passes[0] if len(passes) == 1 else _Chain(passes)


class _Chain(CustomGraphPass):
    """Several post-grad passes as the one ``post_grad_custom_post_pass`` inductor takes."""

    def __init__(self, passes) -> None:
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> bytes:
        return b"".join(p.uuid() for p in self.passes)


def with_post_grad_passes(delegate: Delegate) -> Delegate:
    """The inductor delegate that installs graphpass's aten-level passes (``POST_GRAD_PASSES``,
    declared beside ``PIPELINE``) for graphs holding graphpass ops; a copy, the caller's object is
    left as it is. Other delegates, and an inductor delegate given its own, are returned unchanged.
    The backend (:mod:`graphpass.dynamo_backend`) calls it on the delegate it resolves, before handing
    it down to :mod:`graphpass.delegation` and the bucket dispatcher, which never import the pipeline."""
    if not isinstance(delegate, InductorDelegate) or delegate.post_grad is not None:
        return delegate
    delegate = copy.copy(delegate)
    delegate.post_grad = inductor_post_grad_pass
    return delegate
