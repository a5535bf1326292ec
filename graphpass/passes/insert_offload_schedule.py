"""Offload schedule: inserts ``graphpass::load_start`` / ``load_wait`` / ``evict`` per trap.

Which inputs are offloaded is read from the example inputs themselves (tensors
:func:`graphpass.offload` registered, or a tensor subclass wrapping registered inner tensors, whose
loads move the inner tensors and return the wrapper); which trap reads them, from the shared analysis. For each
trap (and each stretch of graph between traps that reads an offloaded tensor) the pass:

* loads the tensors that trap reads, once (a tensor several ops read is loaded once; a tied
  tensor once per trap that reads it): ``load_start`` is placed ``prefetch_distance`` traps ahead
  (the first ``prefetch_distance + 1`` loads where the graph starts computing, so they overlap
  whatever runs before the first streamed trap), ``load_wait`` just before the trap's enter node,
  and the trap's ops read the waited tensors;
* evicts them right after their last reader in the trap (``evict`` is the last user, so the
  graph drops the tensors there).

Load nodes are tagged ``recompute=MUST_RECOMPUTE``: in training, AOTAutograd's partitioner
re-runs the load in the backward graph instead of keeping device copies alive between forward
and backward. Guard nodes left by the offloaded modules' pre-hooks are removed; a graph that holds
guard nodes but reads no offloaded tensor (the model's tensors were replaced after ``offload()``)
is refused, as is a graph that writes into an offloaded tensor or a view of it (any write form
:func:`graphpass.fx_utils.writes_into` knows, ``+=`` included).

The pass reads and records the model's compile-time facts (:class:`~graphpass.offloading.facts.OffloadFacts`,
found from the offloaded inputs' records, or for a graph of hooks alone from the graph's roots) and
never touches the transfer engine. When the delegate records CUDA graphs (inductor's
``mode="reduce-overhead"``), the fixed device slots for recorded loads are reserved in those facts
here, before any capture, and storage other than ``"pinned"`` is refused (a replayed copy reads page-locked memory), as is ``then="cudagraphs"``
(it copies every input, parameters included, into memory of its own at each replay).

Assumes the trap boundaries were inserted (it anchors loads at ``trap_enter`` nodes when present,
else at the trap's first reader) and that the analysis holds ``node_trap``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import OffloadError
from ..offloading.ops import EVICT, LOAD_START, LOAD_WAIT, OFFLOAD_GUARD_TARGETS, UNLOADED_READS
from ..offloading.schedule import LoadGroup, OffloadSchedule  # noqa: F401 (re-exported)
from ..offloading.facts import (
    OffloadFacts,
    check_skipped_frames,
    facts_of,
    refuse_unpinned_cuda_graph_loads,
    runs_eagerly,
)
from ..offloading.registry import OffloadedTensor, WrappedOffload, facts_guarding, lookup_input, plain_records
from ..fx_utils import (
    AliasIndex,
    example_of,
    find_calls,
    find_write,
    is_graphpass_node,
    is_noop_data_swap,
    is_view,
    node_order,
    views_of,
)
from ..tensor_utils import fake_mode_of, flatten_wrappers, is_dtensor, is_wrapper_subclass, unflatten_wrappers
from ..ops import is_enter, is_exit
from ..analysis import module_paths
from .base import GraphPass, PassContext


def _last_reader(users: list, order: dict) -> list:
    """The last node (in graph order) that reads the loaded tensors, looking through views
    (``w.t()`` is not the read: the matmul on it is), as the eviction's ordering dependency."""
    readers, todo, seen = [], list(users), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_view(n):
            todo.extend(u for u in n.users if not is_graphpass_node(u))
        if isinstance(n.meta.get("example_value"), torch.Tensor):
            readers.append(n)
    return sorted(readers, key=lambda n: order.get(n, -1))[-1:]


@dataclass
class _Group:
    """One planned load: the readers of offloaded tensors in one trap (or stretch between traps)."""

    key: str  # trap label, or "between:<n>"
    anchor: torch.fx.Node  # the load waits before this node (the trap's enter, else its first reader)
    last: torch.fx.Node  # the eviction follows this node: the last reader, through views included
    users: list[torch.fx.Node]  # the readers, in graph order
    phs: list[torch.fx.Node]  # the offloaded placeholders it reads, first read first
    done: list[torch.fx.Node] = field(default_factory=list)  # the eviction's ordering dependency (the last reader)


@dataclass
class _Inserted:
    """The nodes inserted so far, by group index (loads may be issued before their group's turn)."""

    starts: dict[int, torch.fx.Node] = field(default_factory=dict)
    evicts: dict[int, torch.fx.Node] = field(default_factory=dict)


class InsertOffloadSchedule(GraphPass):
    name = "insert_offload_schedule"
    requires = ("assign_traps", "insert_trap_boundaries")

    def run(self, ctx: PassContext) -> bool:
        graph = ctx.gm.graph
        guards = find_calls(graph, *OFFLOAD_GUARD_TARGETS)
        records = _offloaded_inputs(ctx)
        shared = _check_shared_frames(ctx, [rec.facts for rec in records.values()] or _facts_of_roots(ctx), records)
        if not records:
            names = guarded_modules(guards, ctx.roots)
            replaced = _replaced_weights(ctx, names)
            if replaced:
                raise OffloadError(
                    f"module {names[0]!r} was offloaded with graphpass.offload(), but this graph reads "
                    f"{replaced[0]!r}, a tensor it holds that offload() does not manage: the tensors were replaced after "
                    f"offload() (.half(), .to(), or a new parameter assigned). Change the model before offloading it, or "
                    f"offload it again on a fresh instance"
                )
            _check_hooks_alone(names, _facts_of_roots(ctx))
            for node in guards:  # a graph of the module's hooks alone (its forward is another graph)
                graph.erase_node(node)
            return bool(guards) or shared
        for node in guards:
            graph.erase_node(node)
        _erase_noop_data_swaps(graph, records)
        _refuse_writes(graph, records)
        _refuse_disk_gradients(graph, records)
        models = {id(r.facts): r.facts for r in records.values()}
        if len(models) > 1:
            raise OffloadError(
                "one graph reads tensors offloaded from two different models; offload and compile them separately"
            )
        facts = next(iter(models.values()))
        check_skipped_frames(facts)
        order = node_order(graph)
        plan = _plan_groups(graph, records, ctx.analysis.node_trap, order)
        if not plan:
            return bool(guards)
        schedule = self._insert(graph, plan, records, facts, order)
        self._check_budget(ctx, graph, schedule, facts)
        if facts.device.type == "cuda" and records_cuda_graphs(ctx.config):
            _prepare_cuda_graphs(facts, [plain_records(records[p] for p in g.phs) for g in plan], ctx.config)
        return True

    def _insert(
        self, graph: torch.fx.Graph, plan: list[_Group], records: dict, facts: OffloadFacts, order: dict
    ) -> list[LoadGroup]:
        """Insert the start / wait / evict nodes of every group; return the schedule."""
        device = facts.device
        window = facts.window
        fake_mode = fake_mode_of([ph.meta.get("example_value") for ph in records])
        done = _Inserted()
        schedule: list[LoadGroup] = []
        # The first window (groups 0..prefetch) starts where the graph starts computing: its copies
        # overlap whatever runs before the first streamed trap (resident traps, embeddings).
        first = next(n for n in graph.nodes if n.op != "placeholder")
        for group in plan:  # what each label's tensors are called here: the runtime relabels a reused graph
            facts.group_owners.setdefault(group.key, records[group.phs[0]].name)
        for k, group in enumerate(plan):
            for j in window.issued_at(k, len(plan)):
                _insert_start(graph, plan, done, j, first if k == 0 else group.anchor, k, device, order)
            start = done.starts[k]
            nxt = window.ahead(k, len(plan))
            ahead = [done.starts[nxt]] if nxt is not None else []
            with graph.inserting_before(group.anchor):
                wait = graph.call_function(LOAD_WAIT, (start, list(group.phs), group.key, device, ahead))
                items = [graph.call_function(operator.getitem, (wait, j)) for j in range(len(group.phs))]
            for n in [start, wait, *items]:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                n.meta["ac_graph_id"] = 100000 + k
                n.meta["graphpass_offload"] = group.key
            token = _fake_values(fake_mode, start, wait, items, group.phs, device)
            for ph, item in zip(group.phs, items):
                for user in group.users:
                    user.replace_input_with(ph, item)
            with graph.inserting_after(group.last):
                ev = graph.call_function(EVICT, (list(items), list(group.phs), group.key, group.done))
            done.evicts[k] = ev
            ev.meta["graphpass_offload"] = group.key
            if token is not None:
                ev.meta["example_value"] = token
            schedule.append(
                LoadGroup(
                    label=group.key,
                    placeholders=[p.name for p in group.phs],
                    fqns=[records[p].name for p in group.phs],
                    nbytes=sum(records[p].nbytes for p in group.phs),
                    start_before=first.name if window.issuer(k) == 0 else plan[window.issuer(k)].anchor.name,
                    wait_before=group.anchor.name,
                    evict_after=group.last.name,
                )
            )
        return schedule

    def _check_budget(
        self, ctx: PassContext, graph: torch.fx.Graph, schedule: list[LoadGroup], facts: OffloadFacts
    ) -> None:
        """Record the schedule and its peak (bytes started and not yet evicted, walking the graph);
        refuse it when the peak and the resident units exceed ``max_device_bytes``."""
        prefetch = facts.window.distance
        group_bytes = {g.label: g.nbytes for g in schedule}
        live = peak = 0
        for n in graph.nodes:
            if n.target is LOAD_START:
                live += group_bytes[n.args[1]]
                peak = max(peak, live)
            elif n.target is EVICT:
                live -= group_bytes[n.args[2]]
        budget = facts.config.max_device_bytes
        resident = facts.resident_bytes
        ctx.analysis.offload = OffloadSchedule(schedule, prefetch, peak, resident, budget)
        if budget is not None and resident + peak > budget:
            raise OffloadError(
                f"offload budget max_device_bytes={budget:,}: this graph's traps need {peak:,} streamed bytes at once "
                f"(prefetch_distance={prefetch}) on top of {resident:,} resident bytes; raise the budget or lower prefetch_distance"
            )
        ctx.log.append(
            f"{self.name}: {len(schedule)} trap loads of {sum(g.nbytes for g in schedule):,} bytes, prefetch {prefetch}, "
            f"schedule peak {peak:,} streamed bytes"
        )


def records_cuda_graphs(config) -> bool:
    """Will the delegate record this graph as a CUDA graph (``then="cudagraphs"``, inductor's
    ``mode="reduce-overhead"`` or its ``triton.cudagraphs`` option)?"""
    options = config.delegate_options or {}
    return config.then == "cudagraphs" or config.mode == "reduce-overhead" or bool(options.get("triton.cudagraphs"))


def _prepare_cuda_graphs(facts: OffloadFacts, groups: list, config) -> None:
    """Loads recorded into a CUDA graph copy from page-locked host memory into fixed device slots:
    refuse other storage before anything runs, and reserve the slots now (outside any capture)."""
    if config.then == "cudagraphs":
        raise OffloadError(
            "then='cudagraphs' copies every graph input into memory of its own at each replay, parameters included "
            "(torch's cudagraphs backend fixes no input address when modules are inlined), so the recorded loads "
            "could not tell one model's weights from another's; offloaded graphs record CUDA graphs through inductor: "
            "graphpass.backend(then='inductor', mode='reduce-overhead')"
        )
    if config.static_shapes is not None:
        raise OffloadError(
            "static-shape buckets, offload and CUDA graphs together: the buckets' graphs are compiled when first "
            "used, outside Dynamo's tracing context, so inductor records them treating every input, parameters "
            "included, as copied at each replay, and the recorded loads could not tell one model's weights from "
            "another's; drop static_shapes (one CUDA graph per shape Dynamo compiles) or mode='reduce-overhead'"
        )
    refuse_unpinned_cuda_graph_loads(
        [r for g in groups for r in g], facts.storage, "the delegate records CUDA graphs of this graph"
    )
    facts.reserve_graph_slots(groups)


def _facts_of_roots(ctx: PassContext) -> list[OffloadFacts]:
    """The offload facts of the models behind the graph's sources (``ctx.roots``)."""
    found = {}
    for obj in [*ctx.roots.models.values(), *ctx.roots.modules.values()]:
        facts = facts_of(obj)
        if facts is not None:
            found[id(facts)] = facts
    return list(found.values())


def guarded_modules(guards: list[torch.fx.Node], roots) -> list[str]:
    """The FQN of the module behind each ``offload_guard`` node, in graph order, without repeats.

    A hook traced by Dynamo passes no name (``offload_guard("")``): a per-module constant in the
    graph would be a Dynamo guard, and one compiled frame could not serve the instances of a class
    (an MoE's experts compiled once per expert, past ``recompile_limit``). The node runs inside the
    module's call, so the innermost entry of its ``nn_module_stack``, placed in the whole model by
    ``roots``, is that module; an empty stack is the frame's own module."""
    out: dict[str, None] = {}
    for g in guards:
        name = g.args[0] if g.args and g.args[0] else None
        if name is None:
            paths = module_paths(g, roots)
            name = paths[-1] if paths else (roots.frame_module if roots is not None else "")
        out[name] = None
    return list(out)


def _check_shared_frames(ctx: PassContext, facts_list: list[OffloadFacts], records: dict) -> bool:
    """A graph traced from a module's own forward frame (a graph break above it made it one) that
    reads that module's weights serves every instance of its class: Dynamo guards neither on which
    instance runs nor on its hooks. When some instances hold streamed tensors and others do not:

    * compiled for an instance that streams nothing (no loads here), the graph gets a check,
      ``graphpass::unloaded_reads``, that warns (host memory: right, not streamed) or refuses (device
      stand-ins) when it runs for an instance that does, as for a frame Dynamo skips;
    * compiled for one that does, a run for one that does not fails in its first load, naming the
      tensor (it is not a tensor offload() manages)."""
    if not facts_list or not ctx.roots.frame_module or records:
        return False
    root = ctx.roots.modules.get(("self", ()))
    model = ctx.roots.models.get(("self", ()))
    prefix = ctx.roots.frame_module + "."
    placeholders = {n.name: n for n in ctx.gm.graph.nodes if n.op == "placeholder"}
    reads = [
        placeholders[t.node]
        for t in ctx.analysis.weights()
        if t.node in placeholders and any(f.startswith(prefix) for f in t.fqns)
    ]
    if root is None or model is None or not reads:
        return False
    if any(is_dtensor(example_of(n)) or is_wrapper_subclass(example_of(n)) for n in reads):
        return False  # the check takes plain tensors (a sharded or wrapped weight keeps today's behaviour)
    guarded = [g for facts in dict.fromkeys(facts_list) for g in facts.guarded_code]
    for name, mod in model.named_modules():
        if (
            type(mod) is type(root)
            and next(iter(mod.parameters()), None) is not None
            and any(g == name or g.startswith(name + ".") for g in guarded)
        ):
            break
    else:
        return False
    graph = ctx.gm.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        graph.call_function(UNLOADED_READS, (reads, ctx.roots.frame_module))
    return True


def _check_hooks_alone(names: list[str], facts_of_roots: list[OffloadFacts]) -> None:
    """A graph of a module's hooks alone: the module was called from code running eagerly, and its
    forward is meant to be a graph of its own. Where Dynamo compiles no frame of its own for that
    forward (an inbuilt ``torch.nn`` module on torch 2.9, ``GuardedCode.own_frame``), it runs eagerly.
    The facts come from the graph's roots; a graph whose roots reach no offloaded model (a frame
    without a module ``self``) reads those of the live models guarding a module of that name."""
    for name in names:
        mine = [f for f in facts_of_roots if name in f.guarded_code]
        for facts in mine or facts_guarding(name):
            if facts.guarded_code[name].own_frame or name in facts.eager_warned:
                continue
            runs_eagerly(
                facts,
                name,
                "it is called from code running eagerly (a frame Dynamo skipped), and this "
                "torch's Dynamo compiles no frame of its own for the forward of an inbuilt module",
                "remove the graph break in the code that calls it (TORCH_LOGS=graph_breaks shows it)",
            )


def _offloaded_inputs(ctx: PassContext) -> dict[torch.fx.Node, OffloadedTensor | WrappedOffload]:
    """Placeholder -> its offload record, for the graph inputs :func:`graphpass.offload` registered
    (a wrapper subclass whose inner tensors it registered: all of theirs)."""
    placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
    records = {}
    for ph, value in zip(placeholders, ctx.example_inputs):
        rec = lookup_input(value)
        if rec is not None:
            records[ph] = rec
    return records


def _replaced_weights(ctx: PassContext, guarded: list[str]) -> list[str]:
    """FQNs of weights this graph reads that a guarded (offloaded) module holds, when none of the
    graph's inputs is an offloaded tensor: they were replaced after offload()."""
    out = []
    for t in ctx.analysis.weights():
        if any(h == m or h.startswith(m + ".") for m in guarded for h in t.holders):
            out.append(t.fqn)
    return out


def _erase_noop_data_swaps(graph: torch.fx.Graph, records: dict) -> None:
    """``w.data = w.to(w.dtype)`` on an offloaded weight gives it its own data back: not a write, and
    left in the graph it would be a reader outside the weight's trap. Erased with its ``to`` (when
    nothing else reads it), so the layer's real readers are what the loads serve."""
    for node in dict.fromkeys(
        n for ph in records for n in list(ph.users) if n.args and n.args[0] is ph and is_noop_data_swap(n)
    ):
        src = node.args[1]
        graph.erase_node(node)
        if isinstance(src, torch.fx.Node) and src is not node.args[0] and not src.users:
            graph.erase_node(src)


def _refuse_writes(graph: torch.fx.Graph, records: dict) -> None:
    """A write into an offloaded tensor (or a view of it) would land in a loaded copy and be lost."""
    aliases = AliasIndex(graph)
    for ph, rec in records.items():
        hit = find_write(ph, aliases)
        if hit is not None:
            raise OffloadError(
                f"the graph writes offloaded tensor {rec.name!r} in place ({hit[0].format_node()}): a write to a "
                f"loaded copy would be lost at eviction. Keep it on the device with exclude_patterns"
            )


def _refuse_disk_gradients(graph: torch.fx.Graph, records: dict) -> None:
    """A weight streamed from a file has no host copy to take its gradient: a graph that computes
    one (traced with grad enabled, the weight requiring grad) is refused. Under ``no_grad`` or
    ``inference_mode`` (Dynamo compiles in the caller's grad mode, and guards on it) the graph runs:
    an op that may return its input (``w.to(w.dtype)``) still "requires grad" there, and is no use."""
    if not torch.is_grad_enabled():
        return
    for ph, rec in records.items():
        if rec.location is None or not getattr(example_of(ph), "requires_grad", False):
            continue
        for alias in views_of(ph):
            # a view of a weight that requires grad does too, even under no_grad: look at what reads it
            needs = [
                u
                for u in alias.users
                if not is_graphpass_node(u) and not is_view(u) and getattr(example_of(u), "requires_grad", False)
            ]
            if needs:
                raise OffloadError(
                    f"the graph needs the gradient of {rec.name!r}, which graphpass.offload streams from a file "
                    f"(storage='disk'), where no gradient can be kept ({needs[0].format_node()}). Run it under "
                    f"torch.no_grad() or torch.inference_mode(), call requires_grad_(False) on the weights, or offload "
                    f"with storage='cpu' or 'pinned' to train"
                )


def _plan_groups(graph: torch.fx.Graph, records: dict, node_trap: dict[str, str], order: dict) -> list[_Group]:
    """Group the readers of every offloaded input by trap (readers outside traps by the stretch
    between two trap exits), anchored at the trap's enter node; in graph order of the anchors."""
    segment: dict[torch.fx.Node, int] = {}
    exits = 0
    for n in graph.nodes:
        segment[n] = exits
        if is_exit(n):
            exits += 1
    groups: dict[str, dict] = {}
    for ph in records:
        for user in ph.users:
            if is_graphpass_node(user):
                continue  # boundary deps keep reading the host tensor
            label = node_trap.get(user.name)
            key = label if label is not None else f"between:{segment[user]}"
            g = groups.setdefault(key, {"users": {}, "phs": {}})
            g["users"][user] = None
            g["phs"][ph] = min(g["phs"].get(ph, order[user]), order[user])  # first read
    enters: dict[str, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if is_enter(n):
            enters.setdefault(n.args[0], []).append(n)
    plan = []
    for key, g in groups.items():
        users = sorted(g["users"], key=order.__getitem__)
        anchor = users[0]
        for e in enters.get(key, []):
            if order[e] < order[users[0]]:
                anchor = e
        phs = sorted(g["phs"], key=lambda p: (g["phs"][p], order[p]))
        done = _last_reader(users, order)
        # A reader through a view can come after the last direct reader (an expert's slice of a
        # stacked MoE weight, ``w[e]``, taken early and multiplied later): evict after both.
        last = max([users[-1], *done], key=order.__getitem__)
        plan.append(_Group(key, anchor, last, users, phs, done))
    plan.sort(key=lambda grp: order[grp.anchor])
    return plan


def _insert_start(
    graph, plan: list[_Group], done: _Inserted, j: int, before: torch.fx.Node, k: int, device, order: dict
) -> None:
    """Insert group ``j``'s ``load_start`` before ``before`` (issued at group ``k``), after the
    eviction of the group before ``k`` when that eviction comes earlier in the graph."""
    after = []
    prev = k - 1
    if prev >= 0 and prev in done.evicts and order[plan[prev].last] < order[before]:
        after = [done.evicts[prev]]
    with graph.inserting_before(before):
        done.starts[j] = graph.call_function(LOAD_START, (list(plan[j].phs), plan[j].key, device, after))


def _loaded_like(value: torch.Tensor, device) -> torch.Tensor:
    """What a load of ``value`` returns: a fresh tensor on ``device`` (a DTensor keeps its spec)."""
    if is_dtensor(value):
        return torch.empty_like(value)
    if is_wrapper_subclass(value):  # the same wrapper around fresh inner tensors
        flat, metas = flatten_wrappers([value])
        return unflatten_wrappers([_loaded_like(t, device) for t in flat], metas)[0]
    return torch.empty(value.shape, dtype=value.dtype, device=device)


def _fake_values(fake_mode, start, wait, items, phs, device):
    """Example values for the inserted nodes (fake tensors on ``device``); the eviction token, or None."""
    if fake_mode is None:
        return None
    with fake_mode:  # ticket and token live on the compute device, as the ops make them
        start.meta["example_value"] = torch.empty((), dtype=torch.int64, device=device)
        vals = [_loaded_like(p.meta["example_value"], device) for p in phs]
        token = torch.empty((), dtype=torch.int64, device=device)
    wait.meta["example_value"] = vals
    for item, v in zip(items, vals):
        item.meta["example_value"] = v
    return token
