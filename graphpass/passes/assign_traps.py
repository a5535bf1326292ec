"""Trap assignment: inserts nothing; fills ``ctx.analysis.traps`` and ``node_trap``.

Three sources of traps, in priority order:

1. manual traps: ``graphpass.trap_block(name)`` in model code leaves ``trap_enter``/``trap_exit``
   nodes in the graph; every op between them belongs to trap ``name``. A graph another graphpass
   instance already rewrote (``then=graphpass.backend(...)``) keeps exactly the traps it has;
2. ``traps=[patterns]``: an op belongs to the outermost module in its ``nn_module_stack`` whose
   FQN matches a pattern; the trap is labelled with that FQN;
3. default: the repeated blocks. Among the module containers with numbered children
   (``layers.0``, ``layers.1``, ...) the one whose children hold the most weight bytes in this
   graph is chosen, and each child that runs ops here is a trap.

A weight belongs to the traps whose ops read it (a tied weight can belong to several).

Collectives (functional collectives and their waits, DTensor redistributions) belong to the trap
whose ops they serve: their own module's trap when their ``nn_module_stack`` places them in one
(TP's input/output redistributions run inside the parallelized Linear's hooks); otherwise the
trap of the first op reading their result, else of the op producing their input. Recorded in
``analysis.collectives`` and ``Trap.collectives``.
Assumes :mod:`analyze_ownership` ran first.
"""

from __future__ import annotations

from ..analysis import Trap, is_collective
from ..fx_utils import is_graphpass_op, repeated_blocks
from ..ops import is_enter, is_exit
from ..patterns import check_all_match, first_match
from .base import GraphPass, PassContext


def _is_op(node) -> bool:
    return node.op in ("call_function", "call_method", "call_module") and not is_graphpass_op(node.target)


def find_repeated_container(ctx: PassContext) -> tuple[str | None, list[str]]:
    """The repeated blocks among the modules that run ops in this graph (see
    :func:`graphpass.fx_utils.repeated_blocks`), weighted by the bytes of the weights they hold or read."""
    analysis = ctx.analysis
    called = dict.fromkeys(path for paths in analysis.node_modules.values() for path in paths)
    return repeated_blocks(called, ((t.nbytes, t.holders + t.consumers) for t in analysis.weights()))


class AssignTraps(GraphPass):
    name = "assign_traps"
    requires = ("analyze_ownership",)

    def run(self, ctx: PassContext) -> bool:
        analysis = ctx.analysis
        manual = _manual_regions(ctx)  # 1. boundary nodes already in the graph
        by_module = _module_traps(ctx, manual)  # 2./3. patterns, or the repeated blocks
        collectives = _collective_traps(ctx, manual, by_module)
        for node in ctx.gm.graph.nodes:
            label = manual.get(node.name) or by_module.get(node.name) or collectives.get(node.name)
            if node.name in collectives:
                analysis.collectives[node.name] = label
            if label is None:
                continue
            analysis.node_trap[node.name] = label
            trap = analysis.traps.get(label)
            if trap is None:
                trap = analysis.traps[label] = Trap(label, manual=False)
            trap.nodes.append(node.name)
            paths = analysis.modules_of(node)
            inner = paths[-1] if paths else None
            if inner is not None and inner not in trap.modules:
                trap.modules.append(inner)
            if node.name in collectives:
                trap.collectives.append(node.name)
        _assign_weights(analysis)
        ctx.log.append(
            f"{self.name}: {len(analysis.traps)} traps"
            + (f" in {analysis.trap_container!r}" if analysis.trap_container is not None else "")
        )
        return False  # analysis only


def _manual_regions(ctx: PassContext) -> dict[str, str]:
    """Op node -> the innermost manual trap (``trap_block``) open around it; registers those traps."""
    manual: dict[str, str] = {}
    open_labels: list[str] = []
    for node in ctx.gm.graph.nodes:
        if is_enter(node):
            open_labels.append(node.args[0])
            ctx.analysis.traps.setdefault(node.args[0], Trap(node.args[0], manual=True))
        elif is_exit(node):
            label = node.args[0]
            if label in open_labels:
                idx = len(open_labels) - 1 - open_labels[::-1].index(label)
                del open_labels[idx:]
        elif _is_op(node) and open_labels:
            manual[node.name] = open_labels[-1]
    return manual


def _module_traps(ctx: PassContext, manual: dict[str, str]) -> dict[str, str]:
    """Op node -> its module-based trap: the outermost module matching ``traps=`` patterns, else the
    repeated block it runs in. None at all when another graphpass instance already bounded this
    graph (chaining): then its traps are the traps."""
    analysis = ctx.analysis
    graph = ctx.gm.graph
    if any("graphpass_trap" in n.meta for n in graph.nodes):
        return {}
    patterns = ctx.config.traps
    if patterns is not None:
        # A graph with no module at all (a helper function's frame after a graph break, such as
        # transformers' get_vision_position_ids) has nothing the patterns could name: no check.
        if analysis.module_names:
            check_all_match(patterns, analysis.module_names, "traps")
        chosen = lambda path: first_match(patterns, path)  # noqa: E731
    else:
        container, children = find_repeated_container(ctx)
        analysis.trap_container = container
        child_set = set(children)
        chosen = child_set.__contains__
    by_module: dict[str, str] = {}
    for node in graph.nodes:
        if not _is_op(node) or node.name in manual:
            continue
        for path in analysis.modules_of(node):
            if chosen(path):
                by_module[node.name] = path
                break
    return by_module


def _collective_traps(ctx: PassContext, manual: dict[str, str], by_module: dict[str, str]) -> dict[str, str | None]:
    """Collective node -> the trap whose ops it serves (None when no trapped op is near it)."""
    out: dict[str, str | None] = {}
    for node in ctx.gm.graph.nodes:
        if not is_collective(node):
            continue
        own = manual.get(node.name) or by_module.get(node.name)
        out[node.name] = (
            own
            or _nearest_trap(node, manual, by_module, "users")
            or _nearest_trap(node, manual, by_module, "all_input_nodes")
        )
    return out


def _nearest_trap(node, manual: dict[str, str], by_module: dict[str, str], direction: str) -> str | None:
    """The trap of the first op reached from ``node`` along ``direction`` (users or inputs), through
    untrapped nodes (waits, views, other collectives)."""
    frontier = list(getattr(node, direction))
    seen = {node}
    while frontier:
        n = frontier.pop(0)
        if n in seen or n.op in ("placeholder", "output"):
            continue
        seen.add(n)
        label = manual.get(n.name) or by_module.get(n.name)
        if label is not None:
            return label
        frontier.extend(getattr(n, direction))
    return None


def _assign_weights(analysis) -> None:
    """A weight belongs to the traps whose ops read it (a tied weight to several)."""
    for t in analysis.tensors.values():
        if not t.is_weight:
            continue
        labels = [analysis.node_trap[n] for n in analysis.consumer_nodes.get(t.node, []) if n in analysis.node_trap]
        t.traps = list(dict.fromkeys(labels))
        for label in t.traps:
            trap = analysis.traps[label]
            trap.tensors.append(t.node)
            trap.nbytes += t.nbytes
