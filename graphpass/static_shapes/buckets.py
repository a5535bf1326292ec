"""Bucket sizes chosen from a workload's lengths: fewest padded tokens for a budget of graphs.

Each bucket is one static graph, so one compilation (minutes each on AWS Neuron). Given the
lengths a model will see (prompt token counts, say), :func:`choose_buckets` returns at most
``max_graphs`` bucket sizes that minimize the total number of padding tokens, exactly;
:func:`padding_report` measures any bucket list on the same lengths, and
:func:`power_of_two_buckets` builds the powers-of-two list AWS NxD Inference uses by default.

How: a length pads to the smallest bucket that holds it, so an optimal bucket either is the top
one or equals some length (rounded up to ``multiple_of``): lowering it to the largest length it
serves pads less. Over those candidates ``u_1 < ... < u_n`` (with counts), ``f[k][j]`` = the
fewest padding tokens for the lengths up to ``u_j`` with ``k`` buckets, the top one at ``u_j``::

    f[k][j] = min_i  f[k-1][i] + u_j * (C_j - C_i) - (S_j - S_i)      (C, S: prefix counts and sums)
            = u_j * C_j - S_j + min_i (f[k-1][i] + S_i - u_j * C_i)

The inner minimum is the lower envelope of lines of slope ``-C_i`` (strictly decreasing in ``i``)
evaluated at ``u_j`` (increasing in ``j``): the monotone convex-hull trick answers each layer in
O(n), in exact integer arithmetic. Total O(N + max_graphs * n) for N lengths with n distinct.
"""

from __future__ import annotations

import logging
import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .config import check_buckets
from ..errors import ConfigError

log = logging.getLogger("graphpass.static_shapes.buckets")

__all__ = ["choose_buckets", "padding_report", "PaddingReport", "power_of_two_buckets"]


@dataclass(frozen=True)
class PaddingReport:
    """What a bucket list costs on a set of lengths.

    real_tokens: the sum of the lengths. padded_tokens: padding added (bucket - length, summed).
    fraction: ``padded_tokens / (real_tokens + padded_tokens)``, the share of the computed
    positions that are padding. graphs: the number of buckets the lengths actually use (graphs
    compiled when every bucket that is hit gets compiled); ``len(buckets)`` when all are compiled.
    """

    buckets: tuple[int, ...]
    real_tokens: int
    padded_tokens: int
    graphs: int

    @property
    def fraction(self) -> float:
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else 0.0

    @property
    def overhead(self) -> float:
        """Padded tokens per real token (``padded_tokens / real_tokens``)."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0


def _positive_int(key: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise ConfigError(key, value, "expected an integer, not a bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(key, value, f"expected an integer, not {type(value).__name__}") from None
    if v < minimum:
        raise ConfigError(key, value, f"must be >= {minimum}")
    return v


def _histogram(lengths: Iterable[int] | Mapping[int, int]) -> Counter:
    """``lengths`` as length -> count: a sequence of lengths, or a mapping length -> count."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (Iterable, Mapping)):
        raise ConfigError("lengths", lengths, "expected a sequence of lengths or a dict length -> count")
    hist: Counter = Counter()
    if isinstance(lengths, Mapping):
        for length, count in lengths.items():
            c = _positive_int(f"lengths[{length!r}]", count, minimum=0)
            if c:
                hist[_positive_int("lengths", length)] += c
    else:
        for length in lengths:
            hist[_positive_int("lengths", length)] += 1
    if not hist:
        raise ConfigError("lengths", lengths, "no lengths given (an empty workload has no buckets to choose)")
    return hist


def _candidates(hist: Counter, multiple_of: int, max_length: int | None) -> tuple[list[int], list[int], list[int]]:
    """Candidate bucket sizes ascending, with the count and the sum of the lengths each one serves
    when it is the smallest candidate that holds them. A ``max_length`` above every length is the
    last candidate, serving none."""
    grouped: dict[int, list[int]] = {}
    for length, count in hist.items():
        u = -(-length // multiple_of) * multiple_of
        c_s = grouped.setdefault(u, [0, 0])
        c_s[0] += count
        c_s[1] += count * length
    sizes = sorted(grouped)
    counts = [grouped[u][0] for u in sizes]
    sums = [grouped[u][1] for u in sizes]
    if max_length is not None and max_length > sizes[-1]:
        sizes.append(max_length)
        counts.append(0)
        sums.append(0)
    return sizes, counts, sums


def _check_max_length(max_length: Any, largest: int, multiple_of: int) -> int | None:
    if max_length is None:
        return None
    m = _positive_int("max_length", max_length)
    if m < largest:
        raise ConfigError(
            "max_length", max_length, f"is below the largest length ({largest}): the top bucket must hold it"
        )
    if m % multiple_of:
        raise ConfigError("max_length", max_length, f"is not a multiple of multiple_of={multiple_of}")
    return m


def _layer(prev: list[float], sizes: list[int], pc: list[int], ps: list[int], k: int) -> tuple[list[float], list[int]]:
    """One DP layer: ``f[k][j]`` for j = k..n from ``prev = f[k-1]`` (1-based j, index 0 = nothing
    covered), and the split ``i`` each came from. Monotone convex-hull trick over the lines
    ``y = -pc[i] * x + prev[i] + ps[i]``; all arithmetic is on Python ints."""
    n = len(sizes)
    cur: list[float] = [math.inf] * (n + 1)
    arg = [-1] * (n + 1)
    hull: list[int] = []  # line indices i, slopes strictly decreasing
    head = 0

    def intercept(i: int) -> Any:
        return prev[i] + ps[i]

    def value(i: int, x: int) -> Any:
        return intercept(i) - pc[i] * x

    def add(i: int) -> None:
        if prev[i] == math.inf:
            return
        while len(hull) - head >= 2:
            a, b = hull[-2], hull[-1]
            # b is never the minimum once i is there: x(a, i) <= x(a, b)
            if (intercept(i) - intercept(a)) * (pc[b] - pc[a]) <= (intercept(b) - intercept(a)) * (pc[i] - pc[a]):
                hull.pop()
            else:
                break
        hull.append(i)

    add(k - 1)
    for j in range(k, n + 1):
        x = sizes[j - 1]
        while len(hull) - head >= 2 and value(hull[head + 1], x) <= value(hull[head], x):
            head += 1
        if len(hull) > head:
            i = hull[head]
            cur[j] = value(i, x) + x * pc[j] - ps[j]
            arg[j] = i
        if j < n:
            add(j)
    return cur, arg


def choose_buckets(
    lengths: Iterable[int] | Mapping[int, int], max_graphs: int, *, max_length: int | None = None, multiple_of: int = 1
) -> list[int]:
    """The bucket sizes that pad ``lengths`` least with at most ``max_graphs`` buckets.

    lengths: the lengths the workload sees (one per call, repeats count), or a dict length -> count.
    max_graphs: the budget: at most this many buckets (one static graph, one compilation each).
    max_length: the top bucket (the model's context, say); default the largest length.
    multiple_of: every bucket a multiple of this (hardware tiles); padding is still counted from
        the real lengths.

    Returns a strictly increasing list of ints, a valid ``static_shapes["buckets"]``: the top one
    is ``max_length`` (or the largest length rounded up to ``multiple_of``). The total padding is
    the minimum over all bucket lists within the budget. The list is ``max_graphs`` long unless
    there are fewer candidate sizes (then each length, rounded up, is a bucket: no padding beyond
    the rounding), since every further bucket at a candidate pads strictly less.
    Raises :class:`~graphpass.ConfigError` naming the argument at fault before computing anything.
    """
    k_max = _positive_int("max_graphs", max_graphs)
    step = _positive_int("multiple_of", multiple_of)
    hist = _histogram(lengths)
    top = _check_max_length(max_length, max(hist), step)
    sizes, counts, sums = _candidates(hist, step, top)
    n = len(sizes)
    pc, ps = [0] * (n + 1), [0] * (n + 1)
    for j in range(n):
        pc[j + 1], ps[j + 1] = pc[j] + counts[j], ps[j] + sums[j]
    prev: list[float] = [0] + [math.inf] * n
    args: list[list[int]] = []
    # every candidate below the top serves some length, so each added bucket pads strictly less:
    # the optimum uses all min(max_graphs, n) buckets
    used = min(k_max, n)
    for k in range(1, used + 1):
        prev, arg = _layer(prev, sizes, pc, ps, k)
        args.append(arg)
    buckets, j = [], n
    for k in range(used, 0, -1):
        buckets.append(sizes[j - 1])
        j = args[k - 1][j]
    buckets.reverse()
    log.debug(
        "choose_buckets: %d lengths, %d candidates, budget %d -> %s (%d padded tokens)",
        pc[n],
        n,
        k_max,
        buckets,
        prev[n],
    )
    return buckets


def padding_report(lengths: Iterable[int] | Mapping[int, int], buckets: Iterable[int]) -> PaddingReport:
    """Pad every length to the smallest bucket that holds it and count the padding.

    A length above the largest bucket raises :class:`~graphpass.ConfigError` (``key="buckets"``):
    at run time such a call is not padded at all but compiled with dynamic shapes.
    """
    hist = _histogram(lengths)
    if not isinstance(buckets, (list, tuple, str, bytes)) and isinstance(buckets, Iterable):
        buckets = list(buckets)
    bs = check_buckets("buckets", buckets)
    if max(hist) > bs[-1]:
        raise ConfigError("buckets", list(bs), f"the largest bucket is below the largest length ({max(hist)})")
    real = padded = 0
    used = set()
    lengths_sorted = sorted(hist)
    b = 0
    for length in lengths_sorted:
        while bs[b] < length:
            b += 1
        used.add(b)
        real += hist[length] * length
        padded += hist[length] * (bs[b] - length)
    return PaddingReport(bs, real, padded, len(used))


def power_of_two_buckets(max_length: int, min_length: int = 128) -> list[int]:
    """AWS NxD Inference's default buckets (``enable_bucketing`` with no bucket list): the powers
    of two from ``min_length`` (rounded down to a power of two) up to, not including,
    ``2 ** round(log2(max_length))``, then ``max_length`` itself. So 128..2048 and 4096 for 4096,
    but 128..2048 and 5000 for 5000 (4096 is left out: round(log2(5000)) = 12)."""
    top = _positive_int("max_length", max_length)
    low = _positive_int("min_length", min_length)
    if low >= top:
        return [top]
    buckets = [2**e for e in range(int(math.log2(low)), round(math.log2(top)))]
    return sorted({b for b in buckets if b < top} | {top})
