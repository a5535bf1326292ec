"""Tables looked up by position: the buckets a model's position table cannot reach.

GPT-2's learned position embedding (``wpe(position_ids)``), a rotary cache read as ``cos[position_ids]``:
the padding analysis (:mod:`.padding_safety`, which inserts nothing) proves such a read row-preserving, since
real row ``i`` reads table row ``i + offset`` with or without padding. But the padding rows read table rows
too: at bucket ``b`` the last one reads row ``b - 1 + offset``. A table of ``T`` rows (a model's
``max_position_embeddings``) has none past ``T - 1``, so a bucket with ``b + offset > T`` fails inside the
lookup (``IndexError: index out of range``) on a length the model itself serves, or, on a device whose
gather does not check, reads past the table.

:class:`TableRead` records one such lookup (found by ``check_padding_safety(..., table_reads=)``);
:func:`table_invalid_buckets` marks the buckets whose padding would read past a table as not proven
(``BucketPlan.invalid_buckets``): calls landing there run unpadded, with a warning naming the table and the
largest bucket it allows. Every bucket marked: the plan is refused, naming the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import sympy

__all__ = ["TableRead", "table_invalid_buckets"]


@dataclass(frozen=True)
class TableRead:
    """A lookup into a static-size table by a position index (value ``i + offset`` at row ``i``)."""

    what: str  # the lookup's op and node, with its source line
    table: str  # the table's node (its placeholder: a module's weight or buffer)
    rows: int  # the table's size along the looked-up dim
    last: sympy.Expr  # the largest position the lookup reads, in the padded sizes (``s - 1 + offset``)


def _last_at(read: TableRead, bucket: int, names: set[str]) -> int | None:
    v = read.last.xreplace({s: sympy.Integer(bucket) for s in read.last.free_symbols if str(s) in names})
    return int(v) if not v.free_symbols and v.is_integer else None


def _largest_fitting(read: TableRead, names: set[str]) -> int | None:
    """The largest bucket whose padding stays inside the table, when ``last`` is the padded length plus a constant."""
    padded = [s for s in read.last.free_symbols if str(s) in names]
    if len(padded) != 1 or (read.last - padded[0]).free_symbols:
        return None
    return read.rows - 1 - int(read.last - padded[0])


def table_invalid_buckets(plan: Any, syms: Iterable[Any], buckets: tuple[int, ...], reads: list[TableRead]) -> None:
    """Mark ``plan.invalid_buckets`` where a padding row would read past a position table (see the module
    docstring); every bucket marked: the plan is refused."""
    names = {str(s) for s in syms}
    for read in reads:
        largest = _largest_fitting(read, names)
        fits = f"; buckets up to {largest} fit" if largest is not None else ""
        for b in buckets:
            last = _last_at(read, b, names)
            if b in plan.invalid_buckets or (last is not None and last < read.rows):
                continue
            plan.invalid_buckets[b] = (
                f"not proven: {read.what} reads row {last if last is not None else read.last} of {read.table}, which "
                f"has {read.rows} rows, at bucket {b} (its padding rows read positions past the table){fits}")
        if len(plan.invalid_buckets) == len(buckets):
            plan.refused.append(f"{read.what} reads {read.table} ({read.rows} rows) by position: every bucket "
                                f"({', '.join(map(str, buckets))}) would read past it with its padding rows{fits}")
            return
