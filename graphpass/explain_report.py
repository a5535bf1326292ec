"""``graphpass.explain``: what graphpass would do to a model, as tables and as objects.

Dynamo traces the model (running its graphs eagerly to get past graph breaks); the graphpass
pipeline runs over every graph; the delegate compiles nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate

from .dynamo_backend import CompiledGraph, GraphpassBackend
from .config import GraphpassConfig
from .errors import GraphpassError, surface
from . import dynamo_records
from .formatting import fmt_bytes


@dataclass
class TrapRow:
    graph: int
    label: str
    manual: bool
    tensors: int
    nbytes: int
    first_node: str | None
    last_node: str | None
    fqns: list[str]


@dataclass
class ExplainReport:
    """The result of :func:`explain`: one :class:`CompiledGraph` per Dynamo graph."""

    graphs: list[CompiledGraph]
    config: GraphpassConfig
    notes: list[str] = field(default_factory=list)
    offload: Any = None  # graphpass.offload.OffloadState of the model, when it is offloaded

    def offload_table(self) -> str:
        """The offload plan (budget decision) and each graph's load schedule."""
        if self.offload is None:
            return ""
        parts = [self.offload.plan.table()]
        rows = []
        for g in self.graphs:
            sched = g.analysis.offload
            if sched is None:
                continue
            for grp in sched.groups:
                rows.append(
                    [
                        g.index,
                        grp.label,
                        len(grp.fqns),
                        fmt_bytes(grp.nbytes),
                        grp.start_before,
                        grp.wait_before,
                        grp.evict_after,
                    ]
                )
            rows.append([g.index, "(schedule peak)", "", fmt_bytes(sched.peak_streamed_bytes), "", "", ""])
        parts.append(
            tabulate(
                rows, headers=["graph", "load", "tensors", "bytes", "starts before", "waits before", "evicts after"]
            )
        )
        return "\n".join(parts)

    def trap_rows(self) -> list[TrapRow]:
        rows = []
        for g in self.graphs:
            a = g.analysis
            for trap in a.traps.values():
                # a tensor subclass input is listed with the tensors it wraps (weight, weight.qdata, ...)
                fqns = [f for t in trap.tensors for f in [a.tensors[t].fqn, *a.tensors[t].inner_fqns]]
                rows.append(
                    TrapRow(
                        g.index,
                        trap.label,
                        trap.manual,
                        len(trap.tensors),
                        trap.nbytes,
                        trap.first_node,
                        trap.last_node,
                        fqns,
                    )
                )
        return rows

    @property
    def traps(self) -> dict[str, list[TrapRow]]:
        out: dict[str, list[TrapRow]] = {}
        for r in self.trap_rows():
            out.setdefault(r.label, []).append(r)
        return out

    def tensors(self):
        return [t for g in self.graphs for t in g.analysis.tensors.values()]

    @property
    def distributed(self) -> bool:
        """Whether any graph reads tensors sharded or replicated by torch.distributed."""
        return any(g.analysis.distributed for g in self.graphs)

    @property
    def total_weight_bytes(self) -> int:
        """Every weight counted once, also when tied or read by several graphs (under
        torch.distributed: the bytes the graphs read on this rank)."""
        seen: dict[str, int] = {}
        for t in self.tensors():
            if t.is_weight:
                seen.setdefault(t.fqn, t.nbytes)
        return sum(seen.values())

    def to_dict(self) -> dict:
        """Plain data (JSON-ready): traps per graph and every weight's names and owners."""
        out = {
            "graphs": len(self.graphs),
            "total_weight_bytes": self.total_weight_bytes,
            "traps": [r.__dict__ for r in self.trap_rows()],
            "tensors": [
                {
                    "graph": g.index,
                    "fqns": t.fqns,
                    "kind": t.kind,
                    "parent": t.parent,
                    "holders": t.holders,
                    "consumers": t.consumers,
                    "traps": t.traps,
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "nbytes": t.nbytes,
                    **_distributed_fields(t),
                }
                for g in self.graphs
                for t in g.analysis.tensors.values()
                if t.is_weight
            ],
        }
        if self.distributed:  # keys only under torch.distributed: other reports stay as they were
            out["collectives"] = [
                {"graph": g.index, "node": n, "trap": label}
                for g in self.graphs
                for n, label in g.analysis.collectives.items()
            ]
        return out

    def table(self) -> str:
        rows = [
            [
                r.graph,
                r.label + (" (manual)" if r.manual else ""),
                r.tensors,
                fmt_bytes(r.nbytes),
                r.first_node,
                r.last_node,
                _compact(r.fqns),
            ]
            for r in self.trap_rows()
        ]
        return tabulate(rows, headers=["graph", "trap", "tensors", "bytes", "first node", "last node", "owning FQNs"])

    def tensor_table(self) -> str:
        rows = []
        for g in self.graphs:
            for t in g.analysis.tensors.values():
                if not t.is_weight:
                    continue
                rows.append(
                    [
                        g.index,
                        ", ".join(t.fqns),
                        t.kind,
                        ", ".join(t.consumers) or "-",
                        ", ".join(t.traps) or "-",
                        fmt_bytes(t.nbytes),
                    ]
                )
        return tabulate(rows, headers=["graph", "FQN(s)", "kind", "consumed in", "trap(s)", "bytes"])

    def sharding_table(self) -> str:
        """Under torch.distributed: every weight's placement, mesh, bytes on this rank and in all."""
        rows = []
        for g in self.graphs:
            for t in g.analysis.tensors.values():
                if not t.is_weight:
                    continue
                rows.append(
                    [
                        g.index,
                        ", ".join(t.fqns),
                        t.placement or "(not distributed)",
                        t.mesh or "-",
                        t.sharded_by or "-",
                        list(t.shape),
                        fmt_bytes(t.local_nbytes),
                        fmt_bytes(t.global_nbytes),
                        ", ".join(t.traps) or "-",
                    ]
                )
        return tabulate(
            rows,
            headers=[
                "graph",
                "FQN(s)",
                "placement",
                "mesh",
                "by",
                "shape here",
                "bytes/rank",
                "global bytes",
                "trap(s)",
            ],
        )

    def _distributed_lines(self) -> list[str]:
        rank = (
            torch.distributed.get_rank()
            if torch.distributed.is_available() and torch.distributed.is_initialized()
            else 0
        )
        global_bytes: dict[str, int] = {}
        for t in self.tensors():
            if t.is_weight:
                global_bytes.setdefault(t.fqn, t.global_nbytes)
        lines = [
            "",
            f"rank {rank}: weights sharded or replicated by torch.distributed "
            f"({fmt_bytes(sum(global_bytes.values()))} global)",
            self.sharding_table(),
        ]
        served = [(g.index, n, label) for g in self.graphs for n, label in g.analysis.collectives.items()]
        if served:
            per_trap: dict[str, int] = {}
            for _, _, label in served:
                per_trap[label or "(outside any trap)"] = per_trap.get(label or "(outside any trap)", 0) + 1
            lines += ["", "collectives: " + ", ".join(f"{label} {n}" for label, n in per_trap.items())]
        return lines

    def __str__(self) -> str:
        lines = [
            f"graphpass explain: {len(self.graphs)} graph(s), {len(self.traps)} trap(s), "
            f"{fmt_bytes(self.total_weight_bytes)} of weights; delegate {self.graphs[0].delegate if self.graphs else '-'} (not compiled)",
            "",
            self.table(),
        ]
        untrapped = [t for t in self.tensors() if t.is_weight and not t.traps]
        if untrapped:
            lines += ["", f"outside any trap: {_compact([t.fqn for t in untrapped], 12)}"]
        if self.distributed:
            lines += self._distributed_lines()
        if self.offload is not None:
            lines += ["", self.offload_table()]
        lines += self.notes
        return "\n".join(lines)


def _distributed_fields(t) -> dict:
    """The torch.distributed fields of a tensor's JSON record (none for a tensor that is not distributed)."""
    if t.placement is None:
        return {}
    return {
        "placement": t.placement,
        "mesh": t.mesh,
        "sharded_by": t.sharded_by,
        "global_shape": list(t.global_shape),
        "local_nbytes": t.local_nbytes,
        "global_nbytes": t.global_nbytes,
    }


def _compact(names: list[str], limit: int = 6) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", ... (+{len(names) - limit})"


def explain(model: Any, *inputs: Any, dynamic: bool | None = None, **options: Any) -> ExplainReport:
    """Trace ``model(*inputs)`` with Dynamo and report graphpass's ownership and traps.

    ``options`` are the graphpass options (``traps=[...]``, ``then=...``); ``then`` is validated
    but not compiled. Returns an :class:`ExplainReport`; ``print()`` it for the tables.
    """
    gp = GraphpassBackend(options)

    def recorder(gm: torch.fx.GraphModule, example_inputs):
        try:
            gp.transform(gm, example_inputs, gp.config)
        except GraphpassError as err:
            raise surface(err) from err.__cause__
        return gm.forward

    recorder.__name__ = "graphpass_explain"
    compiled = torch.compile(model, backend=recorder, dynamic=dynamic)
    before = dynamo_records.snapshot()
    with torch.no_grad():
        compiled(*inputs)
    from .offloading import offload_state

    notes = [] if gp.graphs else ["", dynamo_records.skipped_frame_message(dynamo_records.new_reasons(before))]
    return ExplainReport(graphs=gp.graphs, config=gp.config, notes=notes, offload=offload_state(model))
