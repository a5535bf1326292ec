"""Trap boundaries: inserts ``graphpass::trap_enter`` before each trap's first op and
``graphpass::trap_exit`` after its last op.

``deps`` of the enter node are the activations the trap reads that were computed before it;
``deps`` of the exit node are the trap's values read after it. Weights are never deps, so the
boundaries do not pin them. Traps that already have boundary nodes (manual
``offload_block`` traps, or a graph that another graphpass instance already rewrote) are left
as they are, so the pass is idempotent.

Assumes :mod:`assign_traps` ran first.
"""

from __future__ import annotations

from ..analysis import is_tensor_node
from ..ops import TRAP_ENTER, TRAP_EXIT, is_boundary
from .base import GraphPass, PassContext


class InsertTrapBoundaries(GraphPass):
    name = "insert_trap_boundaries"

    def should_run(self, ctx: PassContext) -> bool:
        return ctx.config.boundaries

    def run(self, ctx: PassContext) -> None:
        graph = ctx.gm.graph
        analysis = ctx.analysis
        nodes = {n.name: n for n in graph.nodes}
        order = {n: i for i, n in enumerate(graph.nodes)}
        present = {n.args[0] for n in graph.nodes if is_boundary(n)}
        weights = {name for name, t in analysis.tensors.items() if t.is_weight}
        inserted = 0
        for label, trap in analysis.traps.items():
            if trap.manual or label in present or not trap.nodes:
                continue
            region = [nodes[n] for n in trap.nodes]
            members = set(region)
            first, last = region[0], region[-1]
            enter_deps: dict = {}
            for n in region:
                for arg in n.all_input_nodes:
                    if (
                        arg not in members
                        and arg.name not in weights
                        and order[arg] < order[first]
                        and is_tensor_node(arg)
                    ):
                        enter_deps[arg] = None
            exit_deps: dict = {}
            for n in region:
                if is_tensor_node(n) and any(u not in members for u in n.users):
                    exit_deps[n] = None
            profile = ctx.config.profile_ranges
            with graph.inserting_before(first):
                enter = graph.call_function(TRAP_ENTER, (label, list(enter_deps)), {"profile": profile})
            with graph.inserting_after(last):
                exit_ = graph.call_function(TRAP_EXIT, (label, list(exit_deps)), {"profile": profile})
            enter.meta["graphpass_trap"] = label
            exit_.meta["graphpass_trap"] = label
            inserted += 1
        if inserted:
            graph.lint()
            ctx.gm.recompile()
        ctx.log.append(f"{self.name}: {inserted} traps bounded")
