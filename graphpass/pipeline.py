"""The graphpass pipeline: every pass, in the order it runs, and the runner that enforces the
pass contract. This file is the only place the order is written down; each pass lives in a file
of its own under ``graphpass/passes/`` (the contract: :mod:`graphpass.passes.base`).

Dynamo-level passes (``PIPELINE``) run on the graph Dynamo hands the backend, before the delegate
lowers it. Aten-level passes (``POST_GRAD_PASSES``) run inside inductor, after AOTAutograd split
the graph into forward and backward; the inductor delegate installs them from here.

Logging: every pass reports to ``logging.getLogger("graphpass.passes.<name>")`` at DEBUG (its wall
time and what it changed); ``graphpass.graphs`` carries the graphs themselves. The environment
variable ``GRAPHPASS_LOG`` turns them on without code, the way ``TORCH_LOGS`` does for Dynamo:
``GRAPHPASS_LOG=+passes`` (each pass), ``passes`` (one line per graph), ``+graphs`` (each graph
before and after each pass), ``graphs`` (each graph after the pipeline); comma-separated.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass  # pin_backward_loads imports it already

from .config import GraphpassConfig
from .errors import PassError
from .fx_utils import is_graphpass_node
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
        _log.info("graphpass: %s in %.1f ms; changed by %s", graph_name, (time.perf_counter() - t0) * 1e3,
                  ", ".join(changed) or "no pass")
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


# --------------------------------------------------------------------------------------------
# GRAPHPASS_LOG
# --------------------------------------------------------------------------------------------

# Logging configuration is process-wide by nature (the logging module's loggers are); this records
# which GRAPHPASS_LOG value it was configured for and exactly what graphpass itself set (its own
# handler, and each level it set with the level the logger had before), under a lock. graphpass
# never changes a level or a handler it did not set: with GRAPHPASS_LOG unset nothing is touched,
# and when the value changes graphpass undoes only its own settings, and only where the logger
# still holds what graphpass put there (an application that set a level since keeps it).
_LOG_LOCK = threading.Lock()
_LOG_STATE: dict[str, Any] = {"value": "", "handler": None, "levels": {}}
_TOPICS = {"passes": "graphpass", "graphs": "graphpass.graphs", "all": "graphpass"}


def configure_logging_from_env() -> None:
    """Apply ``GRAPHPASS_LOG`` (see the module docstring); unknown topics are ignored with a warning."""
    value = os.environ.get("GRAPHPASS_LOG", "")
    if value == _LOG_STATE["value"]:
        return
    with _LOG_LOCK:
        if value == _LOG_STATE["value"]:
            return
        _undo_own_logging()
        levels = _levels_for(value)
        if levels:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            root = logging.getLogger("graphpass")
            root.addHandler(handler)
            _LOG_STATE["handler"] = handler
            for name in ("graphpass", "graphpass.graphs"):
                logger = logging.getLogger(name)
                level = levels.get(name, logging.WARNING)
                _LOG_STATE["levels"][name] = (logger.level, level)
                logger.setLevel(level)
        _LOG_STATE["value"] = value


def _levels_for(value: str) -> dict[str, int]:
    """The logger levels a ``GRAPHPASS_LOG`` value asks for, by logger name."""
    levels: dict[str, int] = {}
    for token in (t.strip() for t in value.split(",")):
        if not token:
            continue
        topic = token.lstrip("+")
        if topic not in _TOPICS:
            import warnings

            warnings.warn(f"GRAPHPASS_LOG: unknown topic {topic!r} (known: {', '.join(sorted(_TOPICS))})", stacklevel=3)
            continue
        level = logging.DEBUG if token.startswith("+") else logging.INFO
        levels[_TOPICS[topic]] = min(levels.get(_TOPICS[topic], logging.WARNING), level)
        if topic == "all":
            levels["graphpass.graphs"] = level
    return levels


def _undo_own_logging() -> None:
    """Remove the handler graphpass added and restore the levels it set, where still its own."""
    handler = _LOG_STATE["handler"]
    if handler is not None:
        logging.getLogger("graphpass").removeHandler(handler)
        _LOG_STATE["handler"] = None
    for name, (before, ours) in _LOG_STATE["levels"].items():
        logger = logging.getLogger(name)
        if logger.level == ours:
            logger.setLevel(before)
    _LOG_STATE["levels"] = {}
