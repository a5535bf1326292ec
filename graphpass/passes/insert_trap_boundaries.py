"""Trap boundaries: inserts ``graphpass::trap_enter`` before each trap's first op and
``graphpass::trap_exit`` after its last op.

The nodes are placed at the trap's edges in graph order (exact for eager-style delegates). Their
``deps`` order them for compilers that reschedule (inductor) without changing what gets fused:
deps are only values every compiler materializes anyway (graph inputs and the results of
matmul-like, convolution, attention and custom ops, the "anchors"):

* enter: nothing when the previous trap's exit comes before it (boundary ops keep their order
  among themselves, so it runs right after that exit); otherwise the latest anchor the trap's
  inputs are computed from (walking back through pointwise and reduction ops);
* exit: the latest anchor inside the trap its outputs are computed from, so it runs after the
  trap's last matmul; trailing pointwise ops (a residual add) stay free to fuse into the next kernel.

One dep each keeps buffer lifetimes as the compiler would have them.

A trap with no anchor on either side falls back to its plain inputs / outputs. Weights are never
deps, so boundaries do not pin them. Traps that already have boundary nodes (manual
``trap_block`` traps, or a graph another graphpass instance rewrote) are left as they are, so
the pass is idempotent. Assumes :mod:`assign_traps` ran first.

Under ``torch.distributed`` the deps may be DTensors (tensor parallel, FSDP2): the boundary ops read
no data, so the DTensor rule registered with them in ``graphpass/ops.py`` hands them the local shards
as they are (no sharding strategy, no redistribution, hence no collective a boundary could add).
"""

from __future__ import annotations

import heapq
import operator

import torch
import torch.nn.functional as F

from ..fx_utils import find_calls, is_graphpass_op, is_tensor_node, node_order
from ..ops import BOUNDARY_TARGETS, TRAP_ENTER, TRAP_EXIT, trap_model_key
from .base import GraphPass, PassContext

_ANCHOR_FUNCTIONS = {
    F.linear,
    torch._C._nn.linear,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    torch.einsum,
    operator.matmul,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    F.scaled_dot_product_attention,
}
_ANCHOR_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__"}
_ANCHOR_ATEN = {
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "matmul",
    "linear",
    "convolution",
    "einsum",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
}


def _owner_kwargs(ctx: PassContext, trap, nodes: dict) -> dict:
    """For a graph traced from a submodule's own frame (Dynamo runs it for every instance of the
    class whose guards pass): a weight of the trap, where it sat when traced and the enclosing
    model, so the boundary names the block that runs (:func:`graphpass.ops.trap_enter`)."""
    roots = ctx.roots
    model = roots.models.get(("self", ())) if roots is not None and roots.frame_module else None
    if model is None:
        return {}
    for name in trap.tensors:
        t = ctx.analysis.tensors.get(name)
        if t is not None and t.kind in ("parameter", "buffer") and t.fqns and name in nodes:
            return {"owner": [nodes[name]], "owner_fqn": t.fqns[0], "model": trap_model_key(model)}
    return {}


def is_anchor(node: torch.fx.Node) -> bool:
    """A value every compiler materializes: graph input, matmul/conv/attention or custom op result."""
    if node.op == "placeholder":
        return True
    if node.op == "call_method":
        return node.target in _ANCHOR_METHODS
    if node.op != "call_function":
        return False
    t = node.target
    if t in _ANCHOR_FUNCTIONS:
        return True
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and not is_graphpass_op(t):
        ns = str(t).split(".")[0]
        if ns not in ("aten", "prims"):
            return True  # custom ops are opaque kernels
        return str(t).split(".")[1] in _ANCHOR_ATEN
    return False


def _latest_anchor(starts, stop, order: dict, keep, floor: int = -1) -> torch.fx.Node | None:
    """The latest (in graph order) tensor anchor that ``keep`` accepts among those reached walking
    back from ``starts`` through non-anchor nodes, not entering ``stop``; None when there is none.

    The walk takes nodes latest first: an input comes before its users, so every node on a path
    to an anchor leaves the heap before that anchor does, and the first anchor accepted is the
    latest one reached. It stops there, or below position ``floor`` (where ``keep`` accepts
    nothing), instead of following a chain of non-anchors (a residual stream) back to the start
    of the graph for every trap."""
    heap: list = []
    seen: set = set()

    def push(n: torch.fx.Node) -> None:
        if n not in seen and n not in stop:
            seen.add(n)
            heapq.heappush(heap, (-order[n], id(n), n))

    for n in starts:
        push(n)
    while heap:
        position, _, n = heapq.heappop(heap)
        if -position < floor:
            return None
        if is_anchor(n):
            if is_tensor_node(n) and keep(n):
                return n
            continue
        for a in n.all_input_nodes:
            push(a)
    return None


class InsertTrapBoundaries(GraphPass):
    name = "insert_trap_boundaries"
    requires = ("assign_traps",)

    def should_run(self, ctx: PassContext) -> bool:
        return ctx.config.boundaries

    def run(self, ctx: PassContext) -> bool:
        graph = ctx.gm.graph
        analysis = ctx.analysis
        nodes = {n.name: n for n in graph.nodes}
        order = node_order(graph)
        present = {n.args[0] for n in find_calls(graph, *BOUNDARY_TARGETS)}
        weights = {nodes[name] for name, t in analysis.tensors.items() if t.is_weight}
        inserted = 0
        previous_exit = None
        for label, trap in analysis.traps.items():
            if trap.manual or label in present or not trap.nodes:
                continue
            region = [nodes[n] for n in trap.nodes]
            members = set(region)
            first, last = region[0], region[-1]
            inputs = {
                a: None
                for n in region
                for a in n.all_input_nodes
                if a not in members and a not in weights and order[a] < order[first] and is_tensor_node(a)
            }
            outputs = {n: None for n in region if is_tensor_node(n) and any(u not in members for u in n.users)}
            # One dep each: the latest anchor is enough to order the node, and keeping more
            # buffers referenced would only stretch their lifetimes.
            before = _latest_anchor(inputs, members, order, lambda a: a not in weights)
            inside = _latest_anchor(outputs, (), order, members.__contains__, floor=min(map(order.__getitem__, region)))
            enter_deps = [before] if before is not None else list(inputs)
            exit_deps = [inside] if inside is not None else list(outputs)
            if previous_exit is not None and order[previous_exit] < order[first]:
                # Boundary ops keep their relative order in every compiler (they are side
                # effects), so an enter that follows the previous trap's exit needs no dep of its
                # own: it runs right after that exit. Each dep is one more user of a matmul result,
                # which costs inductor compile time (measured: AOT tracing, joint-graph passes and
                # lowering all slow down), so the deps are kept to one per trap.
                enter_deps = []
            previous_exit = last
            kwargs = {"profile": ctx.config.profile_ranges, **_owner_kwargs(ctx, trap, nodes)}
            with graph.inserting_before(first):
                enter = graph.call_function(TRAP_ENTER, (label, enter_deps), kwargs)
            with graph.inserting_after(last):
                exit_ = graph.call_function(TRAP_EXIT, (label, exit_deps), dict(kwargs))
            enter.meta["graphpass_trap"] = label
            exit_.meta["graphpass_trap"] = label
            inserted += 1
        ctx.log.append(f"{self.name}: {inserted} traps bounded")
        return inserted > 0
