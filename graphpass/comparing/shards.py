"""Compare across shardings: a module captured in other pieces by the two runs (TP=2 against TP=1 or
single-process eager, or another layout) is compared piece by piece against the reference's
global tensor.

Each rank's meta entry of a DTensor value records its placements, mesh shape, global shape and the
global offset of the rank's local shard (:func:`graphpass.capturing.ops.dtensor_layout`). The
reference side is assembled into the global tensor (its ``Shard(dim)`` pieces put at their
offsets; a value without a layout is the whole tensor, so its lowest rank's copy is used). Every
test rank's piece is then compared with the matching slice of it, one row per rank, so a rank whose
shard diverges is named. Pieces at the same place on several ranks (``Replicate()`` copies, or the
replicated plain outputs of a row-parallel layer) are also checked against the lowest such rank's
copy: a copy that differs is a ``FAIL`` row naming its rank. Assembling loads one tensor's pieces
into memory; the compared pieces stay chunked (:func:`compare_tensors.compare_tensors`).

The meta is not trusted (:func:`piece_boxes`): before anything is allocated, each side's pieces
must lie inside the global shape, must not overlap (only ``Replicate()`` copies may share a
place), and must cover it exactly. So the global tensor has as many elements as the pieces on disk
hold, whatever ``global_shape`` a meta file claims. Pieces that do not cover the global tensor are
a ``FAIL`` row that says what is missing, on either side.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from ..atomic_files import is_temp_name
from ..capture_format import GLOBAL_OFFSET, GLOBAL_SHAPE, PLACEMENTS
from .compare_report import FAIL, CompareError, CompareReport, CompareRow
from .compare_tensors import LazyTensor, compare_tensors, open_safetensors
from .completeness import fmt_ranks, natural

__all__ = ["compare_resharded", "merge_roots", "piece_boxes"]


class Incomplete(ValueError):
    """A side's pieces do not cover the global tensor: something of it is missing."""


def compare_resharded(
    report: CompareReport,
    rel: str,
    module: str,
    files: tuple[dict, dict],
    layouts: tuple[dict, dict],
    key_order: list[str],
) -> None:
    """Rows for ``module`` whose two runs hold it in different pieces (see the module docstring)."""
    with contextlib.ExitStack() as stack:
        opened = []
        for side, ranks in zip(("ref", "test"), files):
            handles = {}
            for rank, path in sorted(ranks.items()):
                f, err = open_safetensors(path, stack)
                if f is None:
                    report.rows.append(
                        CompareRow(rel, module, rank, None, FAIL, note=f"cannot read {side} file: {err}")
                    )
                else:
                    handles[rank] = f
            opened.append(handles)
        ref, test = opened
        if not ref or not test:
            return
        keys = set().union(*(f.keys() for f in ref.values()), *(f.keys() for f in test.values()))
        for handles, layout in zip(opened, layouts):  # keys a rank's meta lists must be in its file too
            keys |= {k for r in handles for k in layout.get(r, {})}
        rank_of = {k: i for i, k in reversed(list(enumerate(key_order)))}
        for key in sorted(keys, key=lambda k: (0, rank_of[k], ()) if k in rank_of else (1, 0, natural(k))):
            _compare_key(report, rel, module, key, (ref, test), layouts)


def _compare_key(
    report: CompareReport, rel: str, module: str, key: str, handles: tuple[dict, dict], layouts: tuple[dict, dict]
) -> None:
    ref, test = handles
    ref_layout, test_layout = layouts
    try:
        whole, how = _assemble(ref, ref_layout, key)
    except Exception as exc:
        report.rows.append(
            CompareRow(
                rel,
                module,
                None,
                key,
                FAIL,
                note=f"cannot assemble ref: {exc}",
                missing="ref" if isinstance(exc, Incomplete) else None,
            )
        )
        return
    for side, h, layout in (("ref", ref, ref_layout), ("test", test, test_layout)):
        _check_copies(report, rel, module, key, side, h, layout)
    _check_test_cover(report, rel, module, key, test, test_layout)
    for rank, f in sorted(test.items()):
        if key not in f.keys():
            report.rows.append(CompareRow(rel, module, rank, key, FAIL, note="key missing in test", missing="test"))
            continue
        piece = LazyTensor.from_slice(f.get_slice(key))
        entry = layout_entry(test_layout, rank, key)
        try:
            offset, global_shape = _place(entry, piece.shape)
        except ValueError as exc:
            report.rows.append(CompareRow(rel, module, rank, key, FAIL, note=f"test meta: {exc}"))
            continue
        where = f"{_placements(entry)} at {list(offset)} of {list(global_shape)}; ref {how}"
        if global_shape != tuple(whole.shape):
            report.rows.append(
                CompareRow(
                    rel,
                    module,
                    rank,
                    key,
                    FAIL,
                    note=f"shape mismatch {list(whole.shape)} vs {list(global_shape)} (global)",
                )
            )
            continue
        index = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))
        row = compare_tensors(
            rel, module, rank, key, LazyTensor.from_tensor(whole[index]), piece, report.rtol, report.atol
        )
        row.note = "; ".join(n for n in (row.note, where) if n)
        report.rows.append(row)


def _check_test_cover(report: CompareReport, rel: str, module: str, key: str, test: dict, layout: dict) -> None:
    """A FAIL row when the test's pieces of ``key`` (if it is sharded there) do not tile its global
    shape: a piece missing (a lost rank, a host's root not passed), overlapping or misplaced."""
    if not any(key in f.keys() and layout_entry(layout, r, key).get(GLOBAL_SHAPE) is not None for r, f in test.items()):
        return
    try:
        piece_boxes(test, layout, key, "test")
    except Incomplete as exc:
        report.rows.append(CompareRow(rel, module, None, key, FAIL, note=f"missing in test: {exc}", missing="test"))
    except ValueError as exc:
        report.rows.append(CompareRow(rel, module, None, key, FAIL, note=f"test pieces: {exc}"))


def layout_entry(layout: dict, rank: int, key: str) -> dict:
    return layout.get(rank, {}).get(key) or {}


def _placements(entry: dict) -> str:
    placements = entry.get(PLACEMENTS)
    if not placements:
        return "whole tensor"
    if not isinstance(placements, list) or not all(isinstance(p, str) for p in placements):
        return f"placements {placements!r}"
    return "[" + ", ".join(placements) + f"] on mesh {entry.get('mesh_shape')}"


def _ints(value: Any, what: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints >= 0, or ValueError naming ``what`` (a meta file may be tampered with)."""
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise ValueError(f"{what} {value!r} is not a list of ints >= 0")
    return tuple(int(v) for v in value)


def _place(entry: dict, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, global shape) of a piece of ``shape`` with meta ``entry``; a piece without a
    layout is the whole tensor. ValueError when the layout is malformed or the piece lies outside."""
    if entry.get(GLOBAL_SHAPE) is None:
        return (0,) * len(shape), tuple(shape)
    global_shape = _ints(entry[GLOBAL_SHAPE], "global_shape")
    offset = _ints(entry.get(GLOBAL_OFFSET), "global_offset")
    if not len(offset) == len(shape) == len(global_shape) or any(
        o + n > g for o, n, g in zip(offset, shape, global_shape)
    ):
        raise ValueError(
            f"the piece {list(shape)} at {list(offset)} lies outside the global shape {list(global_shape)}"
        )
    return offset, global_shape


def _replica(entry: dict) -> bool:
    placements = entry.get(PLACEMENTS)
    return isinstance(placements, list) and any(isinstance(p, str) and p.startswith("Replicate") for p in placements)


def _overlap(a: tuple, b: tuple) -> bool:
    (ao, an), (bo, bn) = a, b
    return all(max(x, y) < min(x + m, y + k) for x, m, y, k in zip(ao, an, bo, bn))


def piece_boxes(handles: dict, layout: dict, key: str, side: str) -> tuple[tuple[int, ...], dict]:
    """(global shape, rank -> (offset, shape)) for the sharded pieces of ``key``: one rank per
    place (the lowest of ``Replicate()`` copies). Raises ValueError for pieces that disagree on the
    global shape or dtype, lie outside it, or overlap (two ranks at one place whose placements do
    not replicate it included), and :class:`Incomplete` when they do not cover it; so the pieces on
    disk hold exactly as many elements as the global shape, which bounds any allocation of it."""
    boxes, global_shape, dtypes = {}, None, set()
    for rank in sorted(handles):
        entry = layout_entry(layout, rank, key)
        if key not in handles[rank].keys() or entry.get(GLOBAL_SHAPE) is None:
            continue
        sl = handles[rank].get_slice(key)
        dtypes.add(sl.get_dtype())
        shape = tuple(int(d) for d in sl.get_shape())
        offset, _ = _place(entry, shape)
        g = _ints(entry[GLOBAL_SHAPE], "global_shape")
        if global_shape is not None and g != global_shape:
            raise ValueError(f"ranks disagree on the global shape: {list(global_shape)} and rank {rank}'s {list(g)}")
        global_shape, boxes[rank] = g, (offset, shape)
    if len(dtypes) > 1:
        raise ValueError(f"the pieces have different dtypes {sorted(dtypes)}")
    places: dict[tuple, list[int]] = {}
    for rank, box in boxes.items():
        places.setdefault(box, []).append(rank)
    for box, ranks in places.items():
        if len(ranks) > 1 and not all(_replica(layout_entry(layout, r, key)) for r in ranks):
            raise ValueError(
                f"ranks {fmt_ranks(ranks)} hold the same piece {list(box[1])} at {list(box[0])}, but "
                "their placements shard the tensor (overlapping shards)"
            )
    distinct = [(box, ranks[0]) for box, ranks in places.items() if math.prod(box[1]) > 0]
    for (a, ra), (b, rb) in itertools.combinations(distinct, 2):
        if _overlap(a, b):
            raise ValueError(
                f"the pieces of rank {ra} ({list(a[1])} at {list(a[0])}) and rank {rb} "
                f"({list(b[1])} at {list(b[0])}) overlap"
            )
    covered, total = sum(math.prod(box[1]) for box, _ in distinct), math.prod(global_shape or ())
    if covered != total:
        raise Incomplete(
            f"the {side}'s pieces (ranks {fmt_ranks(boxes)}) hold {covered} of the {total} elements "
            f"of the global shape {list(global_shape)}"
        )
    return global_shape, {rank: box for box, rank in distinct}


def _assemble(handles: dict, layout: dict, key: str) -> tuple[torch.Tensor, str]:
    """The global tensor of ``key`` from the ranks' pieces, and how it was made (for the notes).
    Allocates only after :func:`piece_boxes` has checked the pieces tile the global shape."""
    have = [r for r in sorted(handles) if key in handles[r].keys()]
    if not have:
        raise Incomplete("key missing in ref")
    entries = {r: layout_entry(layout, r, key) for r in have}
    sharded = [r for r in have if entries[r].get(GLOBAL_SHAPE) is not None]
    if not sharded:
        return handles[have[0]].get_tensor(key), f"rank {have[0]}"
    for r in sharded:
        placements = entries[r].get(PLACEMENTS) or []
        if not isinstance(placements, list):
            raise ValueError(f"rank {r}'s placements {placements!r} are not a list")
        if any(str(p).startswith("Partial") for p in placements):
            raise ValueError("a Partial() placement cannot be assembled (its pieces are unreduced sums)")
    global_shape, boxes = piece_boxes(handles, layout, key, "ref")
    first = handles[sharded[0]].get_slice(key)
    whole = torch.empty(global_shape, dtype=LazyTensor.from_slice(first).dtype)
    for r, (offset, shape) in boxes.items():
        whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))] = handles[r].get_tensor(key)
    return whole, f"assembled from ranks {sharded}"


def _place_key(entry: dict) -> tuple:
    try:
        return _ints(entry.get(GLOBAL_OFFSET) or (), "global_offset")
    except ValueError:
        return ("?", repr(entry.get(GLOBAL_OFFSET)))


def _check_copies(
    report: CompareReport, rel: str, module: str, key: str, side: str, handles: dict, layout: dict
) -> None:
    """FAIL rows for ranks whose piece sits where a lower rank's does but holds other values."""
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(handles):
        if key not in handles[rank].keys():
            continue
        entry = layout_entry(layout, rank, key)
        shape = tuple(handles[rank].get_slice(key).get_shape())
        groups.setdefault((_place_key(entry), shape), []).append(rank)
    for ranks in groups.values():
        base = ranks[0]
        for rank in ranks[1:]:
            row = compare_tensors(
                rel,
                module,
                rank,
                key,
                LazyTensor.from_slice(handles[base].get_slice(key)),
                LazyTensor.from_slice(handles[rank].get_slice(key)),
                report.rtol,
                report.atol,
            )
            if not row.passed:
                row.note = "; ".join(
                    n for n in (f"{side}: this rank's Replicate() copy differs from rank {base}'s", row.note) if n
                )
                report.rows.append(row)


# --- several roots: captures of one run spread over hosts ---------------------------------------


def merge_roots(roots: Sequence[str | os.PathLike], name: str) -> tuple[Path, Any]:
    """One folder that holds the files of every root (symbolic links to them), for a run whose
    ranks wrote on several hosts; returns it and the ``TemporaryDirectory`` to clean it up. The
    same file under two roots (the same rank written twice) raises :class:`CompareError`."""
    tmp = tempfile.TemporaryDirectory(prefix="graphpass-compare-")
    merged = Path(tmp.name)
    seen: dict[str, Path] = {}
    for root in map(Path, roots):
        if not root.is_dir():
            tmp.cleanup()
            raise CompareError(f"{name} {str(root)!r} does not exist or is not a directory")
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            here = Path(dirpath)
            for f in filenames:
                if is_temp_name(f) or f == "compare_summary.json":
                    continue
                rel = (here / f).relative_to(root).as_posix()
                if rel in seen:
                    tmp.cleanup()
                    raise CompareError(
                        f"{name}: {rel!r} is in both {str(seen[rel])!r} and {str(root)!r}: each rank's "
                        "files may be in one root only"
                    )
                seen[rel] = root
                (merged / rel).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.path.abspath(here / f), merged / rel)
    return merged, tmp
