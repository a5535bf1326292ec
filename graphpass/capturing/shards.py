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
into memory; the compared pieces stay chunked (:func:`compare_runs._compare_tensors`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from ..atomic_files import is_temp_name
from .compare_runs import FAIL, CompareError, CompareReport, CompareRow, _compare_tensors, _natural, _open, _Tensor

__all__ = ["compare_resharded", "merge_roots"]


def compare_resharded(report: CompareReport, rel: str, module: str, files: tuple[dict, dict],
                      layouts: tuple[dict, dict], key_order: list[str]) -> None:
    """Rows for ``module`` whose two runs hold it in different pieces (see the module docstring)."""
    with contextlib.ExitStack() as stack:
        opened = []
        for side, ranks in zip(("ref", "test"), files):
            handles = {}
            for rank, path in sorted(ranks.items()):
                f, err = _open(path, stack)
                if f is None:
                    report.rows.append(CompareRow(rel, module, rank, None, FAIL, note=f"cannot read {side} file: {err}"))
                else:
                    handles[rank] = f
            opened.append(handles)
        ref, test = opened
        if not ref or not test:
            return
        keys = set().union(*(f.keys() for f in ref.values()), *(f.keys() for f in test.values()))
        rank_of = {k: i for i, k in reversed(list(enumerate(key_order)))}
        for key in sorted(keys, key=lambda k: (0, rank_of[k], ()) if k in rank_of else (1, 0, _natural(k))):
            _compare_key(report, rel, module, key, (ref, test), layouts)


def _compare_key(report: CompareReport, rel: str, module: str, key: str, handles: tuple[dict, dict],
                 layouts: tuple[dict, dict]) -> None:
    ref, test = handles
    ref_layout, test_layout = layouts
    try:
        whole, how = _assemble(ref, ref_layout, key)
    except Exception as exc:
        report.rows.append(CompareRow(rel, module, None, key, FAIL, note=f"cannot assemble ref: {exc}"))
        return
    for side, h, layout in (("ref", ref, ref_layout), ("test", test, test_layout)):
        _check_copies(report, rel, module, key, side, h, layout)
    for rank, f in sorted(test.items()):
        if key not in f.keys():
            report.rows.append(CompareRow(rel, module, rank, key, FAIL, note="key missing in test"))
            continue
        piece = _Tensor.from_slice(f.get_slice(key))
        entry = layout_entry(test_layout, rank, key)
        offset = entry.get("global_offset") or [0] * len(piece.shape)
        global_shape = entry.get("global_shape") or list(piece.shape)
        where = f"{_placements(entry)} at {list(offset)} of {list(global_shape)}; ref {how}"
        if list(global_shape) != list(whole.shape):
            report.rows.append(CompareRow(rel, module, rank, key, FAIL,
                                          note=f"shape mismatch {list(whole.shape)} vs {list(global_shape)} (global)"))
            continue
        index = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))
        row = _compare_tensors(rel, module, rank, key, _Tensor.from_tensor(whole[index]), piece,
                               report.rtol, report.atol)
        row.note = "; ".join(n for n in (row.note, where) if n)
        report.rows.append(row)


def layout_entry(layout: dict, rank: int, key: str) -> dict:
    return layout.get(rank, {}).get(key) or {}


def _placements(entry: dict) -> str:
    if not entry.get("placements"):
        return "whole tensor"
    return "[" + ", ".join(entry["placements"]) + f"] on mesh {entry.get('mesh_shape')}"


def _assemble(handles: dict, layout: dict, key: str) -> tuple[torch.Tensor, str]:
    """The global tensor of ``key`` from the ranks' pieces, and how it was made (for the notes)."""
    have = [r for r in sorted(handles) if key in handles[r].keys()]
    if not have:
        raise ValueError("key missing in ref")
    entries = {r: layout_entry(layout, r, key) for r in have}
    sharded = [r for r in have if entries[r].get("global_shape")]
    if not sharded:
        return handles[have[0]].get_tensor(key), f"rank {have[0]}"
    if any(p.startswith("Partial") for r in sharded for p in entries[r].get("placements", [])):
        raise ValueError("a Partial() placement cannot be assembled (its pieces are unreduced sums)")
    first = handles[sharded[0]].get_tensor(key)
    whole = torch.empty(entries[sharded[0]]["global_shape"], dtype=first.dtype)
    filled = torch.zeros(whole.shape, dtype=torch.bool)
    for r in sharded:
        piece = handles[r].get_tensor(key)
        index = tuple(slice(o, o + n) for o, n in zip(entries[r]["global_offset"], piece.shape))
        whole[index] = piece
        filled[index] = True
    if not bool(filled.all()):
        raise ValueError(f"the pieces of ranks {sharded} do not cover the global shape {list(whole.shape)}")
    return whole, f"assembled from ranks {sharded}"


def _check_copies(report: CompareReport, rel: str, module: str, key: str, side: str, handles: dict,
                  layout: dict) -> None:
    """FAIL rows for ranks whose piece sits where a lower rank's does but holds other values."""
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(handles):
        if key not in handles[rank].keys():
            continue
        entry = layout_entry(layout, rank, key)
        shape = tuple(handles[rank].get_slice(key).get_shape())
        groups.setdefault((tuple(entry.get("global_offset") or ()), shape), []).append(rank)
    for ranks in groups.values():
        base = ranks[0]
        for rank in ranks[1:]:
            row = _compare_tensors(rel, module, rank, key, _Tensor.from_slice(handles[base].get_slice(key)),
                                   _Tensor.from_slice(handles[rank].get_slice(key)), report.rtol, report.atol)
            if not row.passed:
                row.note = "; ".join(n for n in (f"{side}: this rank's Replicate() copy differs from rank {base}'s",
                                                  row.note) if n)
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
                    raise CompareError(f"{name}: {rel!r} is in both {str(seen[rel])!r} and {str(root)!r}: each rank's "
                                       "files may be in one root only")
                seen[rel] = root
                (merged / rel).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.path.abspath(here / f), merged / rel)
    return merged, tmp
