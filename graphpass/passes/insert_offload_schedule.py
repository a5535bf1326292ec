"""Offload schedule: inserts ``graphpass::load_start`` / ``load_wait`` / ``evict`` per trap.

Which inputs are offloaded is read from the example inputs themselves (tensors
:func:`graphpass.offload` registered); which trap reads them, from the shared analysis. For each
trap (and each stretch of graph between traps that reads an offloaded tensor) the pass:

* loads the tensors that trap reads, once (a tensor several ops read is loaded once; a tied
  tensor once per trap that reads it): ``load_start`` is placed ``prefetch_distance`` traps ahead,
  ``load_wait`` just before the trap's enter node, and the trap's ops read the waited tensors;
* evicts them right after their last reader in the trap (``evict`` is the last user, so the
  graph drops the tensors there).

Load nodes are tagged ``recompute=MUST_RECOMPUTE``: in training, AOTAutograd's partitioner
re-runs the load in the backward graph instead of keeping device copies alive between forward
and backward. Guard nodes left by the offloaded modules' pre-hooks are removed.

Assumes the trap boundaries were inserted (it anchors loads at ``trap_enter`` nodes when present,
else at the trap's first reader) and that the analysis holds ``node_trap``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ..errors import OffloadError
from ..offloading.ops import EVICT, LOAD_START, LOAD_WAIT, is_guard
from ..offloading.runtime import lookup
from ..ops import is_enter, is_exit, is_graphpass_op
from .base import GraphPass, PassContext


@dataclass
class LoadGroup:
    """The offloaded tensors one trap (or one stretch between traps) reads."""

    label: str  # trap label, or "between:<n>" for the stretch after the n-th trap exit
    placeholders: list = field(default_factory=list)  # placeholder node names, first use first
    fqns: list = field(default_factory=list)
    nbytes: int = 0
    start_before: str = ""  # node the load starts before
    wait_before: str = ""
    evict_after: str = ""


@dataclass
class OffloadSchedule:
    groups: list[LoadGroup]
    prefetch_distance: int
    peak_streamed_bytes: int  # the most streamed bytes the schedule keeps on the device at once
    resident_bytes: int
    max_device_bytes: int | None


_VIEW_NAMES = {"view", "view_as", "reshape", "t", "transpose", "permute", "expand", "expand_as", "flatten",
               "unflatten", "squeeze", "unsqueeze", "narrow", "select", "as_strided", "unbind", "split", "chunk",
               "detach", "movedim", "swapaxes", "diagonal", "real", "imag", "view_as_real", "view_as_complex"}


def _is_view(node: torch.fx.Node) -> bool:
    """May ``node``'s result alias its first argument (a view, or an item of split/chunk/unbind)?"""
    if node.op == "call_function" and (node.target is operator.getitem or (
            isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)):
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name in _VIEW_NAMES


def _views_of(ph: torch.fx.Node) -> list:
    """``ph`` and every node that may alias it (views, their views, items of split/chunk)."""
    out, todo = [], [ph]
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.append(n)
        todo.extend(u for u in n.users if _is_view(u) and u.args and u.args[0] is n)
    return out


def _writes(node: torch.fx.Node, ph: torch.fx.Node) -> bool:
    """Does ``node`` write ``ph`` in place (``x.add_()``, ``x[i] = v``, ``copy_``, ``out=``)?"""
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") \
            and not node.target.endswith("__") and node.args and node.args[0] is ph:
        return True
    if node.op == "call_function":
        if node.target is operator.setitem and node.args and node.args[0] is ph:
            return True
        if node.kwargs.get("out") is ph:
            return True
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            for arg, value in zip(schema.arguments, node.args):
                if value is ph and arg.alias_info is not None and arg.alias_info.is_write:
                    return True
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and node.args and node.args[0] is ph:
            return True
    return False


def _last_reader(users: list, order: dict) -> list:
    """The last node (in graph order) that reads the loaded tensors, looking through views
    (``w.t()`` is not the read: the matmul on it is), as the eviction's ordering dependency."""
    readers, todo, seen = [], list(users), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_view(n):
            todo.extend(u for u in n.users if not (u.op == "call_function" and is_graphpass_op(u.target)))
        if isinstance(n.meta.get("example_value"), torch.Tensor):
            readers.append(n)
    return sorted(readers, key=lambda n: order.get(n, -1))[-1:]


class InsertOffloadSchedule(GraphPass):
    name = "insert_offload_schedule"

    def run(self, ctx: PassContext) -> None:
        graph = ctx.gm.graph
        analysis = ctx.analysis
        for node in [n for n in graph.nodes if is_guard(n)]:
            graph.erase_node(node)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        records = {}
        for i, ph in enumerate(placeholders):
            if i < len(ctx.example_inputs):
                rec = lookup(ctx.example_inputs[i])
                if rec is not None:
                    records[ph] = rec
        if not records:
            ctx.gm.recompile()
            return
        for ph, rec in records.items():
            writer = next(((u, v) for v in _views_of(ph) for u in v.users if _writes(u, v)), (None, None))[0]
            if writer is not None:
                raise OffloadError(
                    f"the graph writes offloaded tensor {rec.name!r} in place ({writer.format_node()}): a write to a "
                    f"loaded copy would be lost at eviction. Keep it on the device with exclude_patterns"
                )
        runtimes = {id(r.runtime): r.runtime for r in records.values()}
        runtime = next(iter(runtimes.values()))
        if len(runtimes) > 1:
            raise OffloadError("one graph reads tensors offloaded from two different models; offload and compile them separately")
        device = runtime.device
        prefetch = runtime.config.prefetch_distance

        order: dict[torch.fx.Node, int] = {}
        segment: dict[torch.fx.Node, int] = {}
        exits = 0
        for i, n in enumerate(graph.nodes):
            order[n] = i
            segment[n] = exits
            if is_exit(n):
                exits += 1

        # group the readers of every offloaded input by trap
        groups: dict[str, dict] = {}
        for ph, rec in records.items():
            for user in ph.users:
                if user.op == "call_function" and is_graphpass_op(user.target):
                    continue  # boundary deps keep reading the host tensor
                label = analysis.node_trap.get(user.name)
                key = label if label is not None else f"between:{segment[user]}"
                g = groups.setdefault(key, {"users": {}, "phs": {}})
                g["users"][user] = None
                g["phs"][ph] = min(g["phs"].get(ph, order[user]), order[user])  # first read
        if not groups:
            ctx.gm.recompile()
            return
        enters = {}
        for n in graph.nodes:
            if is_enter(n):
                enters.setdefault(n.args[0], []).append(n)
        plan = []
        for key, g in groups.items():
            users = sorted(g["users"], key=order.__getitem__)
            first, last = users[0], users[-1]
            anchor = first
            for e in enters.get(key, []):
                if order[e] < order[first]:
                    anchor = e
            phs = sorted(g["phs"], key=lambda p: (g["phs"][p], order[p]))
            plan.append((order[anchor], key, anchor, first, last, users, phs))
        plan.sort(key=lambda t: t[0])

        fake_mode = None
        for ph in records:
            ev = ph.meta.get("example_value")
            fake_mode = getattr(ev, "fake_mode", None)
            if fake_mode is not None:
                break

        schedule: list[LoadGroup] = []
        n_groups = len(plan)
        starts: dict[int, torch.fx.Node] = {}
        evicts: dict[int, torch.fx.Node] = {}

        def make_start(j: int, before: torch.fx.Node, k: int) -> None:
            _, key_j, _, _, _, _, phs_j = plan[j]
            after = []
            prev = k - 1  # the eviction this load must follow (the trap before the one it is issued at)
            if prev >= 0 and prev in evicts and order[plan[prev][4]] < order[before]:
                after = [evicts[prev]]
            with graph.inserting_before(before):
                starts[j] = graph.call_function(LOAD_START, (list(phs_j), key_j, device, after))

        for k, (_, key, anchor, first, last, users, phs) in enumerate(plan):
            issue = range(0, min(prefetch, n_groups - 1) + 1) if k == 0 else [k + prefetch]
            for j in issue:
                if j < n_groups:
                    make_start(j, anchor, k)
            start = starts[k]
            ahead = [starts[k + prefetch]] if prefetch and k + prefetch < n_groups else []
            with graph.inserting_before(anchor):
                wait = graph.call_function(LOAD_WAIT, (start, list(phs), key, device, ahead))
                items = [graph.call_function(operator.getitem, (wait, j)) for j in range(len(phs))]
            for n in [start, wait, *items]:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                n.meta["ac_graph_id"] = 100000 + k
                n.meta["graphpass_offload"] = key
            if fake_mode is not None:
                with fake_mode:
                    start.meta["example_value"] = torch.empty((), dtype=torch.int64)
                    vals = [torch.empty(p.meta["example_value"].shape, dtype=p.meta["example_value"].dtype, device=device)
                            for p in phs]
                    token = torch.empty((), dtype=torch.int64)
                wait.meta["example_value"] = vals
                for item, v in zip(items, vals):
                    item.meta["example_value"] = v
            for ph, item in zip(phs, items):
                for user in users:
                    user.replace_input_with(ph, item)
            done = _last_reader(users, order)
            with graph.inserting_after(last):
                ev = graph.call_function(EVICT, (list(items), list(phs), key, done))
            evicts[k] = ev
            ev.meta["graphpass_offload"] = key
            if fake_mode is not None:
                ev.meta["example_value"] = token
            schedule.append(LoadGroup(
                label=key,
                placeholders=[p.name for p in phs],
                fqns=[records[p].name for p in phs],
                nbytes=sum(records[p].nbytes for p in phs),
                start_before=plan[max(0, k - prefetch)][2].name,
                wait_before=anchor.name,
                evict_after=last.name,
            ))
        graph.lint()
        ctx.gm.recompile()

        # the schedule's own peak: bytes started and not yet evicted, walking the graph
        group_bytes = {g.label: g.nbytes for g in schedule}
        live = peak = 0
        for n in graph.nodes:
            if n.target is LOAD_START:
                live += group_bytes[n.args[1]]
                peak = max(peak, live)
            elif n.target is EVICT:
                live -= group_bytes[n.args[2]]
        budget = runtime.config.max_device_bytes
        resident = runtime.resident_bytes
        analysis.offload = OffloadSchedule(schedule, prefetch, peak, resident, budget)
        if budget is not None and resident + peak > budget:
            raise OffloadError(
                f"offload budget max_device_bytes={budget:,}: this graph's traps need {peak:,} streamed bytes at once "
                f"(prefetch_distance={prefetch}) on top of {resident:,} resident bytes; raise the budget or lower prefetch_distance"
            )
        ctx.log.append(
            f"{self.name}: {len(schedule)} trap loads of {sum(g.nbytes for g in schedule):,} bytes, prefetch {prefetch}, "
            f"schedule peak {peak:,} streamed bytes"
        )
