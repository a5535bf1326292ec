"""choose_buckets: exact optimum against brute force and a plain DP, edge cases, errors, and the
result used as ``static_shapes["buckets"]``."""

import itertools
import random
import time
from collections import Counter

import pytest
import torch

import graphpass
from graphpass import ConfigError
from graphpass.config import GraphpassConfig
from graphpass.models.corpus import build
from graphpass.static_shapes import PaddingReport, choose_buckets, padding_report, power_of_two_buckets

from helpers import CountingBackend


def padding(lengths, buckets):
    """Independent of the module: each length to the smallest bucket that holds it."""
    return sum(min(b for b in buckets if b >= n) - n for n in lengths)


def brute_force(lengths, k, top, step):
    """Every strictly increasing list of at most k multiples of ``step`` ending at ``top`` (all of
    them, not only the lengths): the least padding, and the fewest buckets reaching it."""
    sizes = range(step, top, step)
    best = None
    for r in range(k):
        for lower in itertools.combinations(sizes, r):
            cost = padding(lengths, (*lower, top))
            if best is None or cost < best[0]:
                best = (cost, r + 1)
    return best


def reference_dp(lengths, k, top=None):
    """The textbook O(k n^2) DP over the distinct lengths, no hull: f[j] over prefixes."""
    hist = Counter(lengths)
    u = sorted(hist)
    if top is not None and top > u[-1]:
        u.append(top)
    n = len(u)
    count, total = [0], [0]  # prefix counts and sums of lengths
    for v in u:
        count.append(count[-1] + hist.get(v, 0))
        total.append(total[-1] + hist.get(v, 0) * v)
    inf = float("inf")
    f = [0] + [inf] * n
    best = inf
    for _ in range(min(k, n)):
        g = [inf] * (n + 1)
        for j in range(1, n + 1):
            for i in range(j):  # lengths u[i:j] pad to u[j - 1]
                if f[i] < inf:
                    g[j] = min(g[j], f[i] + u[j - 1] * (count[j] - count[i]) - (total[j] - total[i]))
        f = g
        best = min(best, f[n])
    return best


def random_lengths(rng, n_max, size):
    shape = rng.choice(["uniform", "skewed", "clustered"])
    if shape == "uniform":
        return [rng.randint(1, n_max) for _ in range(size)]
    if shape == "skewed":
        return [min(n_max, 1 + int(rng.expovariate(3 / n_max))) for _ in range(size)]
    centres = [rng.randint(1, n_max) for _ in range(3)]
    return [max(1, min(n_max, rng.choice(centres) + rng.randint(-1, 1))) for _ in range(size)]


def test_optimal_against_brute_force_over_every_bucket_list():
    rng = random.Random(20)
    for _ in range(300):
        step = rng.choice([1, 1, 2, 3])
        lengths = random_lengths(rng, 13, rng.randint(1, 12))
        k = rng.randint(1, 5)
        rounded = -(-max(lengths) // step) * step
        top = rng.choice([None, rounded, rounded + step * rng.randint(1, 2)])
        got = choose_buckets(lengths, k, max_length=top, multiple_of=step)
        want_cost, want_count = brute_force(lengths, k, top or rounded, step)
        assert padding(lengths, got) == want_cost, (lengths, k, top, step, got)
        assert len(got) == want_count and len(got) <= k
        assert got[-1] == (top or rounded) and all(b % step == 0 for b in got)
        assert all(a < b for a, b in zip(got, got[1:]))


def test_equal_to_the_plain_dp_on_larger_inputs():
    """The convex-hull layers give the textbook DP's optimum (hundreds of distinct lengths)."""
    rng = random.Random(3)
    for _ in range(12):
        lengths = random_lengths(rng, 400, rng.randint(50, 600))
        k = rng.randint(1, 9)
        top = rng.choice([None, max(lengths) + rng.randint(0, 50)])
        got = choose_buckets(lengths, k, max_length=top)
        assert padding(lengths, got) == reference_dp(lengths, k, top)


def test_no_bucket_list_within_budget_pads_less_than_powers_of_two_would_suggest():
    rng = random.Random(5)
    lengths = [1 + int(rng.lognormvariate(5, 1.2)) for _ in range(5000)]
    pow2 = power_of_two_buckets(max(lengths))
    chosen = choose_buckets(lengths, len(pow2))
    assert chosen[-1] == pow2[-1] == max(lengths)
    assert padding_report(lengths, chosen).padded_tokens < padding_report(lengths, pow2).padded_tokens


def test_edge_cases():
    assert choose_buckets([7], 3) == [7]
    assert choose_buckets([5, 5, 5], 1) == [5]
    assert choose_buckets([3, 9, 4, 9, 3], 10) == [3, 4, 9]  # room for every length: no padding
    assert choose_buckets([3, 9, 4], 1) == [9]
    assert choose_buckets([3, 9, 4], 1, max_length=16) == [16]
    assert choose_buckets([3, 9, 4], 2, max_length=16) == [4, 16]  # pads 1 + 7, not 6 + 5
    assert choose_buckets([3, 9, 4], 3, max_length=16, multiple_of=8) == [8, 16]  # nothing better with 3
    assert choose_buckets([1] * 1000 + [100], 2) == [1, 100]


def test_input_forms_agree():
    lengths = [12, 40, 40, 7, 90, 12, 12, 64]
    want = choose_buckets(lengths, 3)
    assert choose_buckets(Counter(lengths), 3) == want
    assert choose_buckets({**Counter(lengths), 500: 0}, 3) == want  # zero counts are ignored
    assert choose_buckets(iter(lengths), 3) == want
    assert choose_buckets(torch.tensor(lengths), 3) == want
    assert choose_buckets(tuple(lengths), torch.tensor(3).item()) == want
    assert all(type(b) is int for b in choose_buckets(torch.tensor(lengths), 3))


def test_fast_on_a_hundred_thousand_lengths():
    """O(N + k n): the plain O(k n^2) DP in Python would take minutes here."""
    rng = random.Random(1)
    lengths = [1 + int(rng.lognormvariate(6.5, 1.0)) for _ in range(100_000)]
    assert len(set(lengths)) > 3000
    t0 = time.perf_counter()
    buckets = choose_buckets(lengths, 32)
    assert time.perf_counter() - t0 < 30
    assert len(buckets) == 32 and buckets[-1] == max(lengths)


def test_padding_report():
    r = padding_report([1, 2, 3, 10, 10], [4, 16])
    assert isinstance(r, PaddingReport)
    assert (r.real_tokens, r.padded_tokens, r.graphs) == (26, 3 + 2 + 1 + 6 + 6, 2)
    assert r.fraction == pytest.approx(18 / 44) and r.overhead == pytest.approx(18 / 26)
    assert padding_report({8: 3}, [4, 8, 64]).graphs == 1  # buckets no length reaches are not counted
    assert padding_report([8], [8]).fraction == 0.0
    assert padding_report([3, 5], iter([4, 8])).padded_tokens == 4  # any iterable of sizes


def test_power_of_two_buckets_is_nxd_default():
    assert power_of_two_buckets(128) == [128]
    assert power_of_two_buckets(512) == [128, 256, 512]
    assert power_of_two_buckets(256, 64) == [64, 128, 256]
    assert power_of_two_buckets(4096) == [128, 256, 512, 1024, 2048, 4096]
    assert power_of_two_buckets(5000) == [128, 256, 512, 1024, 2048, 5000]  # round(log2(5000)) = 12
    assert power_of_two_buckets(100) == [100]


@pytest.mark.parametrize(
    "call, key",
    [
        (lambda: choose_buckets([], 2), "lengths"),
        (lambda: choose_buckets({4: 0}, 2), "lengths"),
        (lambda: choose_buckets([4, 0], 2), "lengths"),
        (lambda: choose_buckets([4, -3], 2), "lengths"),
        (lambda: choose_buckets([4, 2.5], 2), "lengths"),
        (lambda: choose_buckets([4, True], 2), "lengths"),
        (lambda: choose_buckets("128", 2), "lengths"),
        (lambda: choose_buckets(128, 2), "lengths"),
        (lambda: choose_buckets({4: -1}, 2), "lengths[4]"),
        (lambda: choose_buckets([4], 0), "max_graphs"),
        (lambda: choose_buckets([4], True), "max_graphs"),
        (lambda: choose_buckets([4], 2.0), "max_graphs"),
        (lambda: choose_buckets([4, 9], 2, max_length=8), "max_length"),
        (lambda: choose_buckets([4, 9], 2, max_length=12, multiple_of=8), "max_length"),
        (lambda: choose_buckets([4], 2, multiple_of=0), "multiple_of"),
        (lambda: padding_report([4, 90], [8, 64]), "buckets"),
        (lambda: padding_report([4], [8, 8]), "buckets"),
        (lambda: padding_report([4], []), "buckets"),
        (lambda: padding_report([4], 8), "buckets"),
        (lambda: power_of_two_buckets(0), "max_length"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_argument(call, key):
    with pytest.raises(ConfigError) as e:
        call()
    assert e.value.key == key and isinstance(e.value, graphpass.GraphpassError)


def test_result_is_a_valid_static_shapes_buckets_value():
    rng = random.Random(9)
    lengths = [rng.randint(2, 300) for _ in range(400)]
    buckets = choose_buckets(lengths, 5, multiple_of=8)
    cfg = GraphpassConfig.from_options({"static_shapes": {"dims": {"ids": 1}, "buckets": buckets}})
    assert cfg.static_shapes.buckets == tuple(buckets)
    # the run-time choice of bucket is the one the report counted
    assert sum(cfg.static_shapes.bucket_for(n) - n for n in lengths) == padding_report(lengths, buckets).padded_tokens


def test_chosen_buckets_drive_a_compiled_model():
    """From a workload's lengths to compiled static graphs: at most one graph per chosen bucket
    (plus Dynamo's first exact-size graph), outputs equal eager's."""
    model, _ = build("tiny_transformer")
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(2, 60, (24,), generator=g).tolist()
    buckets = choose_buckets(lengths, 3)
    counter = CountingBackend()
    compiled = torch.compile(
        model, backend=graphpass.backend(then=counter, static_shapes={"dims": {"ids": 1}, "buckets": buckets})
    )
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, 64, (1, n), generator=g)
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)
    assert counter.calls <= len(buckets) + 1
