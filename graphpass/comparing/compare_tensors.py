"""One tensor against another, in float64 chunks read from memory-mapped safetensors files
(:class:`LazyTensor`, :func:`compare_tensors`; integer and bool tensors exactly), and
:func:`open_safetensors`. Used by the tree walk (:mod:`compare_runs`) and the shard reassembly
(:mod:`shards`)."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import _TYPES as _ST_DTYPES

from .compare_report import FAIL, PASS, CompareRow

EPS = 1e-30  # guards relative errors against an all-zero reference
CHUNK_ELEMS = 1 << 20  # elements per compared chunk (float64: 8 MiB per temporary)


class LazyTensor:
    """One tensor, read lazily: from a memory-mapped safetensors file (``safe_open`` slice) or from
    memory. ``chunks`` yields pieces of at most ``limit`` elements in row-major order."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, read) -> None:
        self.shape, self.dtype, self._read = shape, dtype, read

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "LazyTensor":
        return cls(tuple(t.shape), t.dtype, lambda index: t[index])

    @classmethod
    def from_slice(cls, sl: Any) -> "LazyTensor":
        dtype = _ST_DTYPES.get(sl.get_dtype())
        if dtype is None:
            raise ValueError(f"unsupported safetensors dtype {sl.get_dtype()}")
        return cls(tuple(int(d) for d in sl.get_shape()), dtype, lambda index: sl[index])

    def chunks(self, limit: int) -> Iterator[torch.Tensor]:
        for index in chunk_indices(self.shape, limit):
            yield self._read(index)


def chunk_indices(shape: tuple[int, ...], limit: int) -> Iterator[tuple]:
    """Index tuples (of slices) covering ``shape`` in row-major order, each at most ``limit`` elements:
    the trailing dims that fit whole, a range of the next dim, single indices of the leading dims."""
    limit = max(1, int(limit))
    if not shape:
        yield ()
        return
    if 0 in shape:
        return
    inner, d = 1, len(shape)
    while d > 0 and inner * shape[d - 1] <= limit:
        inner *= shape[d - 1]
        d -= 1
    if d == 0:
        yield tuple(slice(0, n) for n in shape)
        return
    split = d - 1
    step = max(1, limit // inner)
    whole = tuple(slice(0, n) for n in shape[split + 1 :])
    for lead in itertools.product(*(range(n) for n in shape[:split])):
        head = tuple(slice(i, i + 1) for i in lead)
        for start in range(0, shape[split], step):
            yield head + (slice(start, min(start + step, shape[split])),) + whole


def open_safetensors(path: Path, stack: Any) -> tuple[Any, str]:
    """``safe_open`` (memory-mapped) on ``path``; safetensors takes only UTF-8 paths, so a path with
    undecodable bytes is opened here and handed over as ``/proc/self/fd/N`` where that exists."""
    try:
        name = str(path)
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            fd = os.open(path, os.O_RDONLY)
            stack.callback(os.close, fd)
            if os.path.exists(f"/proc/self/fd/{fd}"):
                name = f"/proc/self/fd/{fd}"
        return stack.enter_context(safe_open(name, framework="pt")), ""
    except Exception as exc:  # corrupt header, truncated file, permission denied, ...
        return None, f"{type(exc).__name__}: {exc}".strip()


def _nanhypot(a: float, b: float) -> float:
    """sqrt(a² + b²) without overflow (exact for b alone), propagating NaN like ``vector_norm``."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return math.hypot(a, b)


def _nanmax(a: float, b: float) -> float:
    """max that propagates NaN whatever the order (like ``Tensor.max``)."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


def _compare_float(
    ref: LazyTensor, test: LazyTensor, limit: int, rtol: float, atol: float
) -> tuple[bool, bool, float, float, float]:
    """The chunked float64 (complex128) comparison: ``(allclose, a NaN in the differences, max |t-r|, relative L2,
    relative Linf)``."""
    wide = torch.complex128 if ref.dtype.is_complex or test.dtype.is_complex else torch.float64
    ok, any_nan, n = True, False, 0
    max_abs, ref_max = 0.0, 0.0
    diff_l2, ref_l2 = 0.0, 0.0
    for rc, tc in zip(ref.chunks(limit), test.chunks(limit)):
        r, t = rc.to(wide).reshape(-1), tc.to(wide).reshape(-1)
        if r.numel() == 0:
            continue
        n += r.numel()
        ok = ok and torch.allclose(t, r, rtol=rtol, atol=atol, equal_nan=True)
        both_nan = torch.isnan(r) & torch.isnan(t)
        diff = torch.where((r == t) | both_nan, 0.0, (t - r).abs())  # equal infs and paired NaNs: 0
        r_fin = torch.where(torch.isfinite(r), r.abs(), 0.0)
        del r, t, both_nan
        max_abs = _nanmax(max_abs, diff.max().item())
        ref_max = _nanmax(ref_max, r_fin.max().item())
        diff_l2 = _nanhypot(diff_l2, torch.linalg.vector_norm(diff).item())
        ref_l2 = _nanhypot(ref_l2, torch.linalg.vector_norm(r_fin).item())
        any_nan = any_nan or bool(torch.isnan(diff).any())
        del diff, r_fin
    if n == 0:
        max_abs = rel_l2 = rel_linf = 0.0
    else:
        rel_l2 = diff_l2 / max(ref_l2, EPS)
        rel_linf = max_abs / max(ref_max, EPS)
    return ok, any_nan, max_abs, rel_l2, rel_linf


def compare_tensors(
    rel: str,
    module: str,
    rank: int,
    key: str,
    ref: "torch.Tensor | LazyTensor",
    test: "torch.Tensor | LazyTensor",
    rtol: float,
    atol: float,
    chunk_elems: int | None = None,
) -> CompareRow:
    """Compare chunk by chunk in float64 (complex128): per chunk ``allclose``, max |t-r|, the sums of
    L2 norms (combined with hypot) and max |r| over finite r; combined, they are the whole-tensor numbers."""
    ref = ref if isinstance(ref, LazyTensor) else LazyTensor.from_tensor(ref.detach())
    test = test if isinstance(test, LazyTensor) else LazyTensor.from_tensor(test.detach())
    notes = []
    kinds = (_kind(ref.dtype), _kind(test.dtype))
    if ref.dtype != test.dtype:
        notes.append(f"dtype {_dtype(ref.dtype)} vs {_dtype(test.dtype)}")
    if ref.shape != test.shape:
        notes.insert(0, f"shape mismatch {list(ref.shape)} vs {list(test.shape)}")
        return CompareRow(rel, module, rank, key, FAIL, note="; ".join(notes))
    if kinds[0] != kinds[1] and _EXACT & set(kinds):
        notes.append(
            f"{kinds[0]} vs {kinds[1]}: integer and bool tensors are compared exactly, and only with "
            "tensors of their own kind"
        )
        return CompareRow(rel, module, rank, key, FAIL, note="; ".join(notes))
    limit = CHUNK_ELEMS if chunk_elems is None else chunk_elems
    if kinds[0] in _EXACT:
        return _compare_exact(CompareRow(rel, module, rank, key, PASS), ref, test, limit, notes)
    try:
        ok, any_nan, max_abs, rel_l2, rel_linf = _compare_float(ref, test, limit, rtol, atol)
    except Exception as exc:  # e.g. a dtype float64 cannot hold: never crash the whole report
        notes.append(f"comparison failed: {type(exc).__name__}: {exc}")
        return CompareRow(rel, module, rank, key, FAIL, note="; ".join(notes))
    if not ok and any_nan:
        notes.append("NaN in only one of ref/test")
    return CompareRow(rel, module, rank, key, PASS if ok else FAIL, max_abs, rel_l2, rel_linf, "; ".join(notes))


_EXACT = {"integer", "bool"}  # kinds compared exactly, whatever the tolerances


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_floating_point or dtype.is_complex:
        return "floating-point"
    return "integer"


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any integer or bool dtype) as int64 high and low 32-bit halves of its value, so two
    values are equal iff both halves are, and ``hi * 2**32 + lo`` is the value (uint64 included)."""
    if x.dtype == torch.uint64:
        bits = x.view(torch.int64)
        return (bits >> 32) & 0xFFFFFFFF, bits & 0xFFFFFFFF
    wide = x.to(torch.int64)
    return wide >> 32, wide & 0xFFFFFFFF


def _as_float(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``hi * 2**32 + lo`` in float64, correctly rounded (both terms are exact in float64)."""
    return hi.to(torch.float64) * 4294967296.0 + lo.to(torch.float64)


def _compare_exact(row: CompareRow, ref: "LazyTensor", test: "LazyTensor", limit: int, notes: list[str]) -> CompareRow:
    """Integer / bool tensors: pass iff every element is equal (never through float64, which cannot
    tell 2**53 from 2**53 + 1). The error numbers are the float64 roundings of the exact ones."""
    differ, n, max_abs, ref_max, diff_l2, ref_l2 = 0, 0, 0.0, 0.0, 0.0, 0.0
    try:
        for rc, tc in zip(ref.chunks(limit), test.chunks(limit)):
            (rh, rl), (th, tl) = _halves(rc.reshape(-1)), _halves(tc.reshape(-1))
            if rh.numel() == 0:
                continue
            n += rh.numel()
            differ += int(((rh != th) | (rl != tl)).sum())
            diff = _as_float(th - rh, tl - rl).abs()
            r_abs = _as_float(rh, rl).abs()
            max_abs, ref_max = max(max_abs, diff.max().item()), max(ref_max, r_abs.max().item())
            diff_l2 = math.hypot(diff_l2, torch.linalg.vector_norm(diff).item())
            ref_l2 = math.hypot(ref_l2, torch.linalg.vector_norm(r_abs).item())
    except Exception as exc:  # never crash the whole report
        notes.append(f"comparison failed: {type(exc).__name__}: {exc}")
        row.status, row.note = FAIL, "; ".join(notes)
        return row
    if differ:
        notes.append(f"compared exactly: {differ} of {n} elements differ")
    row.status = FAIL if differ else PASS
    row.max_abs, row.rel_l2, row.rel_linf = max_abs, diff_l2 / max(ref_l2, EPS), max_abs / max(ref_max, EPS)
    row.note = "; ".join(notes)
    return row


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
