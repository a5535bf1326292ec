"""A bucket longer than a position table (graphpass/static_shapes/position_tables.py).

A learned position embedding (GPT-2's ``wpe``) or a rotary cache read as ``cos[position_ids]`` has a fixed
number of rows. Padding a length the model serves to a bucket past that reads rows past the table with its
padding rows: before this check, ``IndexError: index out of range in self`` from inside the compiled graph. Now
the buckets a table cannot reach run unpadded (exact), with a warning naming the lookup, the table and the
largest bucket that fits; a plan whose every bucket is too long is refused, naming the table.
"""

import warnings

import pytest
import torch

import graphpass

from helpers import bench_conformance


class LearnedPositions(torch.nn.Module):
    """Token and learned position embeddings, then a row-wise MLP: padding-safe, with a 12-row position table."""

    def __init__(self, rows=12, vocab=50, d=8):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(rows, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.Linear(d, d))

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        return self.mlp(self.tok(input_ids) + self.pos(positions))


class CachedRotary(torch.nn.Module):
    """A rotary-style cache (a buffer of 12 rows) read by ``cache[position_ids]``."""

    def __init__(self, rows=12, d=8):
        super().__init__()
        self.register_buffer("cos_cached", torch.randn(rows, d))
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)[None, :]
        return self.proj(x) * self.cos_cached[positions]


def _run(model, buckets, lengths, make, name):
    """Compile with buckets, compare every length with eager (padding changes the GEMM shapes: 1e-6), return the
    plans and graphpass's static-shape warnings."""
    torch.manual_seed(0)
    gp = graphpass.backend(then="eager", static_shapes={"dims": {name: 1}, "buckets": buckets})
    compiled = torch.compile(model, backend=gp)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in lengths:
            x = make(n)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-6, atol=1e-6, msg=lambda m: f"length {n}: {m}")
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    return plans, [str(w.message) for w in caught if "graphpass static_shapes" in str(w.message)]


def test_a_bucket_past_a_learned_position_table_runs_unpadded_and_says_which_table():
    plans, said = _run(LearnedPositions(), [8, 16], [5, 10, 12, 7], lambda n: torch.randint(0, 50, (1, n)), "input_ids")
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    assert set(plans[0].invalid_buckets) == {16}, plans[0].invalid_buckets
    assert said, "no warning for the lengths landing in bucket 16"
    assert all("pos.weight" in m and "12 rows" in m and "buckets up to 12 fit" in m for m in said), said


def test_a_bucket_past_a_cache_read_by_position_runs_unpadded():
    plans, said = _run(CachedRotary(), [8, 16], [3, 9, 11], lambda n: torch.randn(1, n, 8), "x")
    assert set(plans[0].invalid_buckets) == {16}, plans[0].invalid_buckets
    assert said and all("cos_cached" in m and "12 rows" in m for m in said), said


def test_every_bucket_past_the_table_refuses_the_plan_naming_it():
    plans, _ = _run(LearnedPositions(rows=6), [8, 16], [3, 5], lambda n: torch.randint(0, 50, (1, n)), "input_ids")
    assert plans and not plans[0].active
    assert any("pos.weight (6 rows)" in r and "buckets up to 6 fit" in r for r in plans[0].refused), plans[0].refused


def test_buckets_inside_the_table_mark_nothing():
    plans, said = _run(
        LearnedPositions(rows=16), [8, 16], [5, 10, 16], lambda n: torch.randint(0, 50, (1, n)), "input_ids"
    )
    assert plans[0].active and not plans[0].invalid_buckets and not said


def test_gpt2_with_a_bucket_past_its_positions_serves_every_length_it_can():
    """Real GPT-2 (tiny, 128 positions): bucket 144 would read ``wpe`` rows 128..143 with its padding."""
    pytest.importorskip("transformers")
    conformance = bench_conformance()
    model = conformance.build_model("gpt2")
    vocab = model.config.vocab_size

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    g = torch.Generator().manual_seed(3)
    plans, said = _run(
        Logits(),
        [16, conformance.MAX_POS + 16],
        [5, conformance.MAX_POS - 3],
        lambda n: torch.randint(0, vocab, (1, n), generator=g),
        "input_ids",
    )
    assert plans[0].active and set(plans[0].invalid_buckets) == {conformance.MAX_POS + 16}
    assert any("wpe.weight" in m and f"buckets up to {conformance.MAX_POS} fit" in m for m in said), said
