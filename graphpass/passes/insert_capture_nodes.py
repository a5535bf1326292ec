"""Capture nodes: inserts ``graphpass::capture(name, value)`` after every output
tensor of every module a :class:`graphpass.ModelCapture` selected.

A module's outputs are the tensors computed inside it (``nn_module_stack``) that are read
outside it or returned by the graph; with nested outputs (tuples, dicts, ``ModelOutput``) Dynamo
has already flattened them, so every tensor is captured, in execution order. The node clones
the value into the capture registry at run time only while capture is active and enabled, so
toggling needs no recompilation. A module whose own forward Dynamo split at a graph break is
not captured as a whole (its pieces' outputs are not its outputs): capture its children or use
``capture_tensor`` there; values route by name to the innermost active registry that
asked for the module (one compiled graph may serve several instances of a model class). Assumes :mod:`analyze_ownership` ran (module paths per node).
"""

from __future__ import annotations

from ..fx_utils import is_graphpass_node, is_tensor_node
from ..capturing.ops import CAPTURE
from .base import GraphPass, PassContext


class InsertCaptureNodes(GraphPass):
    name = "insert_capture_nodes"
    requires = ("analyze_ownership",)

    def should_run(self, ctx: PassContext) -> bool:
        return bool(ctx.captures)

    def run(self, ctx: PassContext) -> bool:
        graph = ctx.gm.graph
        analysis = ctx.analysis
        modules = list(dict.fromkeys(p for paths in analysis.node_modules.values() for p in paths))
        nodes = [n for n in graph.nodes if n.name in analysis.node_modules]
        inserted = 0
        for spec in ctx.captures:
            for fqn in modules:
                if spec.prefix and not (fqn == spec.prefix or fqn.startswith(spec.prefix + ".")):
                    continue
                rel = fqn[len(spec.prefix) + 1 :] if spec.prefix else fqn
                if not rel or not any(p.matches(rel) for p in spec.patterns):
                    continue
                if fqn == ctx.roots.frame_module:
                    # This graph is a piece of that module's own frame (cut by a graph break): its
                    # outputs are whatever crosses the break, not the module's outputs.
                    ctx.log.append(f"{self.name}: {rel} skipped (its forward is split by a graph break)")
                    continue
                region = [n for n in nodes if fqn in analysis.node_modules[n.name]]
                members = set(region)
                for n in region:
                    if not is_tensor_node(n):
                        continue
                    if not any(u not in members and not is_graphpass_node(u)
                               for u in n.users):
                        continue
                    with graph.inserting_after(n):
                        node = graph.call_function(CAPTURE, (rel, n))
                    node.meta["graphpass_capture"] = rel
                    inserted += 1
        return inserted > 0
        ctx.log.append(f"{self.name}: {inserted} capture nodes")
