"""Backward load pinning (aten level, inductor only): inserts data dependencies, no new ops.

In training, AOTAutograd's partitioner re-runs each trap's ``load_start``/``load_wait`` in the
backward graph (they are tagged ``MUST_RECOMPUTE``) right before the first backward op that reads
the loaded tensors. A ``load_start`` there has no input computed in the backward, so a scheduler
that reorders nodes (inductor) may hoist every re-load to the top of the backward and hold all
traps' weights at once. This pass adds, to each such ``load_start``, a dependency on the nearest
tensor-producing compute node before it, so a re-load cannot start before the backward reaches
its trap and device residency in the backward stays one trap at a time.

Applies to graphs that hold ``load_wait`` nodes but no ``evict`` node (the backward graphs); the
forward graph's loads already carry their order in data. Declared in
``graphpass.pipeline.POST_GRAD_PASSES``; :class:`graphpass.backends.InductorDelegate` installs it
as inductor's ``post_grad_custom_post_pass`` for a graph that holds offload loads.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..offloading.ops import EVICT, LOAD_START, LOAD_WAIT
from ..fx_utils import is_graphpass_op, node_order


def _descendants(node: torch.fx.Node) -> set:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def pin_backward_loads(graph: torch.fx.Graph) -> int:
    nodes = list(graph.nodes)
    if not any(n.target is LOAD_WAIT for n in nodes) or any(n.target is EVICT for n in nodes):
        return 0
    pinned = 0
    for start in [n for n in nodes if n.target is LOAD_START]:
        wait = next((u for u in start.users if u.target is LOAD_WAIT and u.args[0] is start), None)
        if wait is None:
            continue
        items = list(wait.users)
        consumers = [c for it in items for c in it.users if not (c.op == "call_function" and is_graphpass_op(c.target))]
        if not consumers:
            continue
        order = node_order(graph)
        first = min(consumers, key=order.__getitem__)
        below = _descendants(wait)
        anchor = None
        for prev in reversed(list(graph.nodes)[: order[first]]):
            if prev in below or prev is start or prev is wait or prev.op != "call_function" or is_graphpass_op(prev.target):
                continue
            if isinstance(prev.meta.get("val"), torch.Tensor):
                anchor = prev
                break
        if anchor is None:
            continue
        start.args = (*start.args[:3], [anchor])
        wait.args = (*wait.args[:4], [])  # no prefetch in the backward
        # inductor lowers custom ops against the fake values recorded for their inputs
        for n, last in ((start, [anchor.meta["val"]]), (wait, [])):
            vals = n.meta.get("eager_input_vals")
            if vals is not None:
                args, kwargs = vals
                n.meta["eager_input_vals"] = ((*args[: len(n.args) - 1], last), kwargs)
        for n in (start, wait, *items):
            first.prepend(n)
        pinned += 1
    return pinned


class PinBackwardLoads(CustomGraphPass):
    name = "pin_backward_loads"

    def applies_to(self, gm: torch.fx.GraphModule) -> bool:
        """Whether a Dynamo-level graph holds offload loads (its backward may then need pinning)."""
        return any(n.target is LOAD_WAIT for n in gm.graph.nodes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        from ..pipeline import check_well_formed

        if pin_backward_loads(graph):
            check_well_formed(graph, self.name, "a backward graph")

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
