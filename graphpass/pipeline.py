"""The graphpass pipeline: every pass, in the order it runs. This list is the only place the
order is written down; each pass lives in a file of its own under ``graphpass/passes/``.

Dynamo-level passes run on the graph Dynamo hands the backend, before the delegate lowers it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .config import GraphpassConfig
from .passes.analyze_ownership import AnalyzeOwnership
from .passes.assign_traps import AssignTraps
from .passes.base import GraphPass, PassContext
from .passes.insert_capture_nodes import InsertCaptureNodes
from .passes.insert_offload_schedule import InsertOffloadSchedule
from .passes.insert_trap_boundaries import InsertTrapBoundaries
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


def run_pipeline(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: GraphpassConfig,
    roots: Roots | None = None,
    captures: Sequence[Any] = (),
    passes: Sequence[GraphPass] = PIPELINE,
) -> PassContext:
    """Run ``passes`` over ``gm`` in place and return the context holding the shared analysis."""
    ctx = PassContext(
        gm=gm,
        example_inputs=list(example_inputs),
        config=config,
        roots=roots if roots is not None else Roots(),
        captures=list(captures),
    )
    for p in passes:
        p(ctx)
    return ctx
