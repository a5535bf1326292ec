"""The allocation audit's report (:func:`graphpass.audit`, see :mod:`.allocation_audit`): the verdicts and their
rules, one :class:`AllocationRow` per allocation, the dynamic dims, and :class:`AuditReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tabulate import tabulate

from ..formatting import fmt_bytes

VERDICTS = ("YES", "PARTIAL", "NO")

#: The verdict rules, first match wins. Documented in docs/static-shapes.md.
RULES = (
    (
        "NO",
        "data-dependent",
        "the size depends on tensor values (an unbacked symbol u*, or nonzero/masked_select/"
        "unique/repeat_interleave/bool-mask index), or it is randperm over a variable count",
    ),
    ("NO", "checkpoint", "the node lies in an activation-checkpoint region"),
    ("NO", "unbounded", "a dynamic dim in the size has no upper bound (give max in dynamic= or max_sizes=)"),
    ("PARTIAL", "product", "the size grows with a product of dynamic dims (s0*s1, s0**2)"),
    ("PARTIAL", "ratio", "the bound is more than partial_factor (16) times the size at the example inputs"),
    ("PARTIAL", "cat", "a cat along a dynamic dim of pieces that are themselves variable-size allocations"),
    ("YES", "bounded", "the size depends only on input sizes and has a finite bound"),
)


# ----------------------------------------------------------------------------------------- rows


@dataclass
class AllocationRow:
    """One allocating aten node of one graph."""

    graph: str  # "<dynamo graph>/<forward|backward|inference>", e.g. "0/forward"
    node: str  # the node's name in that aten graph
    op: str  # e.g. "aten.cat.default"
    source: str  # "file.py:LINE" of the user's frame that made it, "-" when unknown
    shape: str  # sympy shape, e.g. "[s0, 4*s1 + 1, 16]"; several outputs joined by "; "
    bound_elems: int | None  # upper bound on elements over the dims' ranges (None: unbounded)
    bound_bytes: int | None
    verdict: str  # YES | PARTIAL | NO
    reason: str
    rule: str = ""  # which rule of RULES decided the verdict
    code: str = ""  # the source line's code
    example_elems: int | None = None  # elements at the example inputs (None: data-dependent)


@dataclass
class DynamicDim:
    """One dim named in ``dynamic=`` and the symbol Dynamo gave it."""

    input: str
    dim: int
    example: int
    min: int | None
    max: int | None
    symbol: str | None = None  # None: the code specialized it (see notes)
    range: tuple[int | None, int | None] | None = None  # the range the bounds used (None: unbounded above)


@dataclass
class AuditReport:
    """The result of :func:`audit`."""

    rows: list[AllocationRow]
    graphs: list[str]
    dims: list[DynamicDim]
    training: bool
    partial_factor: float
    notes: list[str] = field(default_factory=list)

    def by_verdict(self) -> dict[str, list[AllocationRow]]:
        out: dict[str, list[AllocationRow]] = {v: [] for v in VERDICTS}
        for r in self.rows:
            out[r.verdict].append(r)
        return out

    def table(self) -> str:
        rows = [
            [
                r.graph,
                r.source,
                r.op.removeprefix("aten."),
                r.shape,
                _fmt_int(r.bound_elems),
                "unbounded" if r.bound_bytes is None else fmt_bytes(r.bound_bytes),
                r.verdict,
                r.reason,
            ]
            for r in self.rows
        ]
        headers = ["graph", "source", "op", "shape", "bound (elems)", "bound (bytes)", "verdict", "reason"]
        return tabulate(rows, headers=headers, maxcolwidths=[None] * 7 + [72], disable_numparse=True)

    def __str__(self) -> str:
        mode = "training (forward + backward)" if self.training else "inference (no_grad)"
        dims = ", ".join(
            f"{d.symbol or '(specialized)'} = {d.input}.size({d.dim}) in "
            f"[{_fmt_int((d.range or (d.min, d.max))[0], '?')}, {_fmt_int((d.range or (d.min, d.max))[1])}] (example {d.example})"
            for d in self.dims
        )
        lines = [
            f"graphpass audit: {len(self.rows)} variable-size allocation(s) in {len(self.graphs)} aten graph(s), {mode}",
            f"dynamic: {dims or '-'}",
            "",
            self.table() if self.rows else "(no variable-size allocations)",
            "",
        ]
        groups = self.by_verdict()
        meaning = {
            "YES": "a fixed max-size buffer, sliced per call, works",
            "PARTIAL": "bounded, but a max-size buffer is a poor fit (buckets or producer rewrites first)",
            "NO": "data-dependent, unbounded or inside activation checkpointing",
        }
        for v in VERDICTS:
            rows = groups[v]
            total = sum(r.bound_bytes or 0 for r in rows if r.bound_bytes is not None)
            extra = f", {fmt_bytes(total)} at the bounds" if v != "NO" and rows else ""
            lines.append(f"{v}: {len(rows)} ({meaning[v]}{extra})")
        lines += self.notes
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "training": self.training,
            "partial_factor": self.partial_factor,
            "graphs": list(self.graphs),
            "dynamic": [asdict(d) for d in self.dims],
            "counts": {v: len(rs) for v, rs in self.by_verdict().items()},
            "rows": [asdict(r) for r in self.rows],
            "notes": list(self.notes),
        }


def _fmt_int(n: int | None, none: str = "unbounded") -> str:
    return none if n is None else f"{n:,}"
