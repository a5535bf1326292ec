"""Capture nodes: inserts ``graphpass::capture(name, value, owner, owner_fqn)`` after every output
tensor of every module a :class:`graphpass.ModelCapture` selected.

A module's outputs are the tensors computed inside it (``nn_module_stack``) that are read
outside it or returned by the graph; with nested outputs (tuples, dicts, ``ModelOutput``) Dynamo
has already flattened them, so every tensor is captured, in execution order. The node clones
the value into the capture registry at run time only while capture is active and enabled, so
toggling needs no recompilation. A module whose own forward Dynamo split at a graph break is
not captured as a whole (its pieces' outputs are not its outputs): capture its children or use
``capture_tensor`` there.

Names: each captured value gets its key path in the module's return value (``[0]``,
``.last_hidden_state``, ``output``), read from the ``graphpass::output_key`` markers that the
global forward hook of :mod:`graphpass.capturing.model_capture` traces after every module of a
selected class; the markers are removed here. Output leaves are captured in output order right
after the call's last leaf computed inside the module, or after the last write inside the module
into one of them (an output allocated first and filled by a mutating ``out`` op), inside its trap; values the module
computed that are read outside it without being returned (a KV cache updated in place) get key
``""`` (written as ``other[i]``).

Which model a value belongs to is not baked into the graph: Dynamo runs one compiled graph for
every instance of a model class whose guards pass (a same-class draft model; layer 2 running the
graph traced from layer 0's frame). So each node gets ``owner``: a weight placeholder of the graph
held by the captured module (else by its nearest ancestor, else any weight of the graph), plus,
when there is one, a second weight held outside the captured module (so a module shared by two
models, e.g. a tied ``lm_head``, still tells them apart), and ``owner_fqn``: the FQN the first
one had when the graph was traced. At run time the op hands the value to the active registry
whose model holds those tensors and names it after where that model holds the first one
(:mod:`graphpass.capturing.ops`). ``name`` is the module's FQN in the model the graph was traced
from; each registry re-derives it relative to its own ``ModelCapture``'s module. A graph with no
usable weight (or none inside a ``ModelCapture``'s module) gets owner-less nodes named relative to
that ``ModelCapture``'s module, routed by name as before. Assumes :mod:`analyze_ownership` ran
(module paths per node, weight placeholders and their FQNs).
"""

from __future__ import annotations

import torch

from ..analysis import module_paths
from ..fx_utils import find_calls, is_graphpass_node, is_tensor_node, iter_writes
from ..capturing.ops import CAPTURE, OUTPUT_KEY_TARGETS, is_output_key
from .base import GraphPass, PassContext


def _insert_captures(
    graph: torch.fx.Graph, after: torch.fx.Node, value: torch.fx.Node, key: str, calls
) -> torch.fx.Node:
    """Capture nodes for ``value`` after ``after``, one per (name, owner, owner_fqn) of ``calls``,
    in ``calls`` order. ``key``: its output key path (``""``: not returned). Returns the last one."""
    for name, own, own_fqn in calls:
        with graph.inserting_after(after):
            after = graph.call_function(CAPTURE, (name, value, list(own), own_fqn, False, key))
        after.meta["graphpass_capture"] = name
    return after


def _capture_module(graph: torch.fx.Graph, region: list, marked: list, calls, order: dict) -> int:
    """Capture nodes for one module: its output leaves (``marked``) call by call in output order,
    right after the call's last leaf computed inside it (so inside its trap), then the values it
    computed that are read outside it without being returned. Returns how many were inserted."""
    members = set(region)
    escaping = [
        n for n in region if is_tensor_node(n) and any(u not in members and not is_graphpass_node(u) for u in n.users)
    ]
    leaves = {t for _, t, _ in marked}
    marked = [(m, _leaving(t, members, escaping, leaves), key) for m, t, key in marked]
    inserted = 0
    for call in _calls(marked):
        inside = [t for _, t, _ in call if t in members]
        # after the last write inside the module into any of them: an output allocated first and
        # filled by a mutating op (``out = torch.empty(..)``, ``op(out, x)``, as vLLM's layers do)
        # is only its value after that op
        inside += [w for t in inside for w, _ in iter_writes(t) if w in members]
        anchor = max(inside, key=order.get) if inside else call[-1][0]
        for _, t, key in call:
            anchor = _insert_captures(graph, anchor, t, key, calls)
        inserted += len(call) * len(calls)
    returned = {t for _, t, _ in marked}
    for n in escaping:
        if n not in returned:
            _insert_captures(graph, n, n, "", calls)
            inserted += len(calls)
    return inserted


def _leaving(t: torch.fx.Node, members: set, escaping: list, leaves: set = frozenset()) -> torch.fx.Node:
    """The value that leaves the module for output leaf ``t``: ``t`` itself, or, when ``t`` is only
    read inside the module and exactly one leaving value derives from it, that one (a module forward
    hook, e.g. a tensor-parallel output layout, ran after the marker's global hook)."""
    if t not in members or t in escaping:
        return t
    seen, todo, found = {t}, [t], []
    while todo:
        for u in todo.pop().users:
            if u in members and u not in seen:
                seen.add(u)
                todo.append(u)
                if u in escaping:
                    found.append(u)
    found = [f for f in found if f not in leaves]  # another output leaf is that leaf, not t's layout
    return found[0] if len(found) == 1 else t


def _calls(marked: list) -> list[list]:
    """A module's markers split into its calls: the hook traces one call's markers back to back."""
    out: list[list] = []
    for entry in marked:
        if out and out[-1][-1][0].next is entry[0]:
            out[-1].append(entry)
        else:
            out.append([entry])
    return out


def _within(fqn: str, module: str) -> bool:
    """``fqn`` is ``module`` itself or inside it (every FQN is inside the root, ``""``)."""
    return not module or fqn == module or fqn.startswith(module + ".")


def _regions(graph: torch.fx.Graph, node_modules: dict[str, list[str]]) -> dict[str, list[torch.fx.Node]]:
    """Module FQN -> the nodes that run inside it, in graph order (one sweep for every module)."""
    out: dict[str, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        for fqn in dict.fromkeys(node_modules.get(n.name, ())):
            out.setdefault(fqn, []).append(n)
    return out


class _Weights:
    """The graph's weights, ``(placeholder, FQNs, is a parameter)`` in graph order, indexed by every
    module that holds them, so a module's weights are one lookup instead of a scan of all of them."""

    def __init__(self, weights: list[tuple[torch.fx.Node, list[str], bool]]) -> None:
        self.all = weights
        self.params = [w for w in weights if w[2]]
        self.under: dict[str, list[tuple[torch.fx.Node, str, bool]]] = {}
        for node, fqns, param in weights:
            for f in fqns:
                parts = f.split(".")
                for scope in dict.fromkeys(["", *(".".join(parts[:i]) for i in range(1, len(parts) + 1))]):
                    self.under.setdefault(scope, []).append((node, f, param))  # every scope f is _within

    def __bool__(self) -> bool:
        return bool(self.all)

    def held(self, scope: str) -> list[tuple[torch.fx.Node, str, bool]]:
        """``(placeholder, FQN, is a parameter)`` of each weight FQN inside ``scope``, in graph order."""
        return self.under.get(scope, [])

    def last_outside(self, node: torch.fx.Node, fqn: str, inner: str) -> torch.fx.Node | None:
        """The last weight other than ``node`` held outside ``fqn`` and inside ``inner``, a parameter
        when there is one: searched from the end, parameters first, so it stops after a few steps."""
        for group in (self.params, self.all):
            for w, fqns, _ in reversed(group):
                if w is not node and not any(_within(f, fqn) for f in fqns) and any(_within(f, inner) for f in fqns):
                    return w
        return None


class InsertCaptureNodes(GraphPass):
    name = "insert_capture_nodes"
    requires = ("analyze_ownership",)

    def should_run(self, ctx: PassContext) -> bool:
        return bool(ctx.captures) or bool(find_calls(ctx.gm.graph, *OUTPUT_KEY_TARGETS))

    def run(self, ctx: PassContext) -> bool:
        graph = ctx.gm.graph
        analysis = ctx.analysis
        markers = self._output_markers(ctx)
        order = {n: i for i, n in enumerate(graph.nodes)}
        modules = list(dict.fromkeys([p for paths in analysis.node_modules.values() for p in paths] + list(markers)))
        regions = _regions(graph, analysis.node_modules)
        weights = _Weights(self._weights(ctx))
        inserted = 0
        twins = self._twins(ctx) if ctx.captures else []
        for fqn in modules if ctx.captures else ():
            specs = []  # (spec, name relative to its module) of every ModelCapture selecting fqn
            shared = False  # selected only where another instance of the frame's class runs this graph
            for spec in ctx.captures:
                for i, where in enumerate(
                    [fqn]
                    + [t + fqn[len(ctx.roots.frame_module) :] for t in twins if _within(fqn, ctx.roots.frame_module)]
                ):
                    if not _within(where, spec.prefix):
                        continue
                    rel = where[len(spec.prefix) + 1 :] if spec.prefix else where
                    if rel and any(p.matches(rel) for p in spec.patterns):
                        if i == 0:
                            specs.append((spec, rel))
                        else:
                            shared = True
                        break
            if not specs and not shared:
                continue
            if fqn == ctx.roots.frame_module:
                # This graph is a piece of that module's own frame (cut by a graph break): its
                # outputs are whatever crosses the break, not the module's outputs.
                ctx.log.append(f"{self.name}: {fqn} skipped (its forward is split by a graph break)")
                continue
            owner, owner_fqn = self._owner(fqn, specs, weights)
            if not specs and not owner:
                continue  # another instance's module, and no weight to name it by at run time
            calls = [(fqn, owner, owner_fqn)] if owner else []
            for spec, rel in specs:  # a ModelCapture whose module holds no owner: routed by name, as before
                if (not owner or not _within(owner_fqn, spec.prefix)) and (rel, [], "") not in calls:
                    calls.append((rel, [], ""))
            inserted += _capture_module(graph, regions.get(fqn, []), markers.get(fqn, []), calls, order)
        for fqn_markers in markers.values():
            for marker, _, _ in fqn_markers:
                graph.erase_node(marker)
        if inserted:
            ctx.log.append(f"{self.name}: {inserted} capture nodes")
        return inserted > 0 or bool(markers)

    @staticmethod
    def _output_markers(ctx: PassContext) -> dict[str, list[tuple[torch.fx.Node, torch.fx.Node, str]]]:
        """module FQN -> its ``output_key`` markers (marker, output tensor node, key path), graph
        order; one marker per (tensor, key) (a repeat is removed at once). Markers of no module
        (the hook on the graph's root) are listed under ``""`` (removed, never captured)."""
        out: dict[str, list[tuple[torch.fx.Node, torch.fx.Node, str]]] = {}
        seen: dict[str, set] = {}
        for node in list(ctx.gm.graph.nodes):
            if not is_output_key(node):
                continue
            paths = module_paths(node, ctx.roots)
            fqn = paths[-1] if paths else ctx.roots.frame_module
            key, t = node.args[0], node.args[1]
            if (t, key) in seen.setdefault(fqn, set()):
                ctx.gm.graph.erase_node(node)  # a second hook on the module: the same leaf again
                continue
            seen[fqn].add((t, key))
            out.setdefault(fqn, []).append((node, t, key))
        return out

    @staticmethod
    def _twins(ctx: PassContext) -> list[str]:
        """FQNs of the other instances of the class of the module whose own frame this graph was
        traced from (``layers.0`` -> ``layers.1``, ``layers.2``, ...): Dynamo runs this graph for
        them too, so their selected modules need capture nodes here (named at run time)."""
        frame = ctx.roots.frame_module
        key = ("self", ())
        obj = ctx.roots.modules.get(key)
        model = ctx.roots.models.get(key)
        if not frame or obj is None or model is None or model is obj:
            return []
        return [name for name, mod in model.named_modules() if type(mod) is type(obj) and name != frame]

    @staticmethod
    def _weights(ctx: PassContext) -> list[tuple[torch.fx.Node, list[str], bool]]:
        """(placeholder, FQNs, is a parameter) of every parameter / buffer input, in graph order."""
        placeholders = {n.name: n for n in ctx.gm.graph.nodes if n.op == "placeholder"}
        out = []
        for t in ctx.analysis.tensors.values():
            node = placeholders.get(t.node)
            if t.kind in ("parameter", "buffer") and t.fqns and node is not None and is_tensor_node(node):
                out.append((node, list(t.fqns), t.kind == "parameter"))
        position = {name: i for i, name in enumerate(placeholders)}
        out.sort(key=lambda w: position[w[0].name])
        return out

    @staticmethod
    def _owner(fqn: str, specs, weights: _Weights) -> tuple[list[torch.fx.Node], str]:
        """The owner placeholders of module ``fqn``'s capture nodes and the first one's FQN."""
        if not weights:
            return [], ""
        first = None
        scope = fqn
        while first is None:
            held = weights.held(scope)
            if held:
                node, f, _ = next((h for h in held if h[2]), held[0])  # parameters before buffers
                first = (node, f)
            elif not scope:
                return [], ""
            else:
                scope = scope.rpartition(".")[0]
        owner, owner_fqn = [first[0]], first[1]
        # A second weight, held outside the captured module but inside every ModelCapture's module
        # that gets this node: tells apart two models that share the captured module itself.
        inner = max((spec.prefix for spec, _ in specs if _within(owner_fqn, spec.prefix)), key=len, default="")
        other = weights.last_outside(first[0], fqn, inner)
        if other is not None:
            owner.append(other)
        return owner, owner_fqn
