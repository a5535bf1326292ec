"""Tables looked up by position: the buckets a model's position table cannot reach.

GPT-2's learned position embedding (``wpe(position_ids)``), a rotary cache read as ``cos[position_ids]``:
the padding analysis (:mod:`.padding_safety`, which inserts nothing) proves such a read row-preserving, since
real row ``i`` reads table row ``i + offset`` with or without padding. But the padding rows read table rows
too: at bucket ``b`` the last one reads row ``b - 1 + offset``. A table of ``T`` rows (a model's
``max_position_embeddings``) has none past ``T - 1``, so a bucket with ``b + offset > T`` fails inside the
lookup (``IndexError: index out of range``) on a length the model itself serves, or, on a device whose
gather does not check, reads past the table.

:class:`TableRead` records one such lookup (found by the padding proof, ``PaddingProof.table_reads``);
``padding_proof.conditions.TableBuckets`` marks the buckets whose padding would read past a table as not proven
(``BucketPlan.invalid_buckets``): calls landing there run unpadded, with a warning naming the table and the
largest bucket it allows. Every bucket marked: the plan is refused, naming the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

__all__ = ["TableRead"]


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
