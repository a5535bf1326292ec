"""Backward load pinning (aten level, inductor only): inserts data dependencies, no new ops.

In training, AOTAutograd's partitioner re-runs each trap's ``load_start``/``load_wait`` in the
backward graph (they are tagged ``MUST_RECOMPUTE``) right before the first backward op that reads
the loaded tensors. A ``load_start`` there has no input computed in the backward, so a scheduler
that reorders nodes (inductor) may hoist every re-load to the top of the backward and hold all
traps' weights at once. This pass places each re-load ``prefetch_distance`` traps ahead in backward
order (the distance the forward used, read off the recomputed waits): the ``load_start`` of trap
``k`` goes where the backward reaches trap ``k - prefetch_distance`` and takes, as a data
dependency, the nearest tensor-producing compute node before that point, so it cannot start
earlier; the ``load_wait`` of trap ``k`` stays right before its first consumer and lists the start
issued there (the next prefetch), as in the forward. Device residency in the backward is then the
forward's window: ``prefetch_distance + 1`` traps at a time.

Applies to graphs that hold ``load_wait`` nodes but no ``evict`` node (the backward graphs); the
forward graph's loads already carry their order in data. Declared in
``graphpass.pipeline.POST_GRAD_PASSES``; :class:`graphpass.backends.InductorDelegate` installs it
as inductor's ``post_grad_custom_post_pass`` for a graph that holds offload loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..offloading.ops import EVICT, LOAD_START, LOAD_WAIT
from ..offloading.schedule import PrefetchWindow
from ..config import GraphpassConfig
from ..fx_utils import find_calls, is_graphpass_op, node_order
from .base import GraphPass, PassContext, run_pass


def _descendants_before(node: torch.fx.Node, order: dict, limit: int) -> set:
    """The node's descendants placed before position ``limit``. Exact: in a topologically ordered
    graph every node on a path to such a descendant is placed before it, so the walk never needs to
    go past ``limit``; it costs the nodes it keeps (and their edges), not the rest of the graph."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen and order[u] < limit:
                seen.add(u)
                todo.append(u)
    return seen


def _is_compute(node: torch.fx.Node) -> bool:
    """A tensor-producing op other than graphpass's own: what a re-load can be pinned after."""
    return (
        node.op == "call_function"
        and not is_graphpass_op(node.target)
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


def _previous_compute(nodes: list[torch.fx.Node]) -> list[torch.fx.Node | None]:
    """For every position, the nearest compute node before it (None: none), in one sweep."""
    prev, last = [], None
    for n in nodes:
        prev.append(last)
        if _is_compute(n):
            last = n
    return prev


@dataclass
class _BackwardLoad:
    """One re-load in the backward graph, and where the backward reaches its trap."""

    start: torch.fx.Node
    wait: torch.fx.Node
    items: list[torch.fx.Node]  # the getitems of the loaded tensors
    first: torch.fx.Node  # the first backward op reading them
    anchor: torch.fx.Node | None  # the nearest compute node before ``first`` (None: nothing to pin to)


def _backward_loads(graph: torch.fx.Graph) -> list[_BackwardLoad]:
    """The graph's re-loads in backward order (of their first consumer)."""
    order = node_order(graph)  # taken once: nothing below moves a node
    nodes = list(graph.nodes)
    before = _previous_compute(nodes)
    found = []
    for start in find_calls(graph, LOAD_START):
        wait = next((u for u in start.users if u.target is LOAD_WAIT and u.args[0] is start), None)
        if wait is None:
            continue
        items = list(wait.users)
        consumers = [c for it in items for c in it.users if not (c.op == "call_function" and is_graphpass_op(c.target))]
        if not consumers:
            continue
        first = min(consumers, key=order.__getitem__)
        below = _descendants_before(wait, order, order[first])
        anchor = before[order[first]]
        while anchor is not None and anchor in below:  # skip compute that reads the loaded tensors
            anchor = before[order[anchor]]
        found.append(_BackwardLoad(start, wait, items, first, anchor))
    return sorted(found, key=lambda load: order[load.first])


def _prefetch_distance(loads: list[_BackwardLoad]) -> int:
    """The forward's prefetch distance, read off the re-loaded waits: a wait lists the start it
    issued ``prefetch_distance`` traps ahead (AOTAutograd recomputes it with the same arguments)."""
    index = {load.start.args[1]: i for i, load in enumerate(loads)}
    for i, load in enumerate(loads):
        ahead = [n for n in load.wait.args[4] if isinstance(n, torch.fx.Node) and n.target is LOAD_START]
        if ahead and ahead[0].args[1] in index:
            return abs(index[ahead[0].args[1]] - i)
    return 0


def _set_last_arg(node: torch.fx.Node, nodes: list[torch.fx.Node]) -> None:
    """Replace the node's last (list) argument; inductor lowers custom ops against the fake values
    recorded for their inputs, so those follow."""
    node.args = (*node.args[:-1], list(nodes))
    vals = node.meta.get("eager_input_vals")
    if vals is not None:
        args, kwargs = vals
        node.meta["eager_input_vals"] = ((*args[: len(node.args) - 1], [n.meta["val"] for n in nodes]), kwargs)


def pin_backward_loads(graph: torch.fx.Graph) -> int:
    """Place every backward re-load ``prefetch_distance`` traps ahead in backward order, each start
    pinned after the compute where the backward reaches the trap it is issued at. Returns how many."""
    if not find_calls(graph, LOAD_WAIT) or find_calls(graph, EVICT):
        return 0
    loads = _backward_loads(graph)
    if not loads:
        return 0
    window = PrefetchWindow(_prefetch_distance(loads))
    for i, load in enumerate(loads):
        issued_at = loads[window.issuer(i)]  # the first d + 1 loads start together, at the first trap
        _set_last_arg(load.start, [issued_at.anchor] if issued_at.anchor is not None else [])
        ahead = window.ahead(i, len(loads))
        _set_last_arg(load.wait, [loads[ahead].start] if ahead is not None else [])
    for j, here in enumerate(loads):
        for n in [loads[i].start for i in window.issued_at(j, len(loads))] + [here.wait, *here.items]:
            here.first.prepend(n)
    return len(loads)


class PinBackwardLoads(GraphPass, CustomGraphPass):
    """Runs under the pass contract (:func:`~graphpass.passes.base.run_pass`) like every pass: when
    inductor calls it with a backward graph, that graph's module becomes the context's ``gm``."""

    name = "pin_backward_loads"

    def applies_to(self, gm: torch.fx.GraphModule) -> bool:
        """Whether a Dynamo-level graph holds offload loads (its backward may then need pinning)."""
        return bool(find_calls(gm.graph, LOAD_WAIT))

    def run(self, ctx: PassContext) -> bool:
        pinned = pin_backward_loads(ctx.gm.graph)
        if pinned:
            ctx.log.append(f"{self.name}: {pinned} backward re-loads pinned")
        return bool(pinned)

    def __call__(self, graph: torch.fx.Graph | PassContext) -> bool:  # type: ignore[override]
        """Inductor's ``post_grad_custom_post_pass`` hook (a graph), or the runner (a context)."""
        if isinstance(graph, PassContext):
            return run_pass(self, graph)
        gm = graph.owning_module
        if gm is None:  # a graph no module owns: give it one, so the runner can recompile it
            gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        return run_pass(
            self, PassContext(gm=gm, example_inputs=[], config=GraphpassConfig(), graph_name="a post-grad graph")
        )

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
