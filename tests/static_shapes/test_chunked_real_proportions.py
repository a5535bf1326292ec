"""State-space and linear-attention models at real proportions (issue 38, item 1): lengths over several chunks, the
multiples of the chunk included, buckets that are multiples of the chunk (as a real Mamba-2's powers of two are of
its 256).

A length that is a multiple of the chunk takes the branch of ``mamba2_chunk_scan`` that pads nothing, so Dynamo
traces a second graph guarded on ``Mod(8 - Mod(s, 8), 8) <= 0``, whose row counts read ``s + Mod(8 - Mod(s, 8), 8)``.
The proof reads that guard as "the length is a multiple of 8" (``padding_proof/guards.py``): the row counts are the
padded length at every multiple, and the buckets that are not a multiple are invalid for that graph. Both graphs
then run at the buckets only, through the static-only stand-in, with logits equal to eager's.
"""

import pytest
import torch

from graphpass.backends import NeuronDelegate

from helpers import bench_conformance, sweep_buckets

transformers = pytest.importorskip("transformers")
# slow (make test-slow; the transformers-next leg runs it too): real models, each compiled at every bucket
pytestmark = pytest.mark.slow

conformance = bench_conformance()

CHUNK = 8
BUCKETS = [16, 32, 64]
# 14 lengths over all three buckets and 2 to 8 chunks, 5 of them multiples of the chunk (the first call, 5, is
# Dynamo's static first compile)
LENGTHS = [5, 9, 16, 17, 23, 24, 31, 32, 33, 40, 47, 56, 58, 63]
# lengths of one chunk or less: Dynamo specializes a single chunk (its guards pin the chunk count to 1, a size-1
# dim), so that graph runs only at a bucket of one chunk; with the chunk as the smallest bucket they bucket too
SHORT_BUCKETS = [8, 16, 32, 64]
SHORT_LENGTHS = [5, 3, 8, 9, 16, 2, 24, 7, 40, 63, 6]
# fp32; a padded call scans more chunks than eager, so the inter-chunk sums are added in another order
RTOL = ATOL = 1e-5


def _model(family: str, chunk: int = CHUNK):
    cfg = conformance.tiny_config(family)
    for key in ("chunk_size", "mamba_chunk_size"):
        if hasattr(cfg, key):
            setattr(cfg, key, chunk)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def _sweep(model, backend, lengths, buckets=BUCKETS, batch=1):
    return sweep_buckets(model, backend, lengths, buckets, batch=batch, tol=RTOL)[1]


def _assert_bucketed(strict_backend, plans, lengths, buckets, invalid_ok=False, batch=1):
    assert plans and all(p.active and (invalid_ok or not p.invalid_buckets) for p in plans), [
        (p.refused, p.invalid_buckets) for p in plans
    ]
    seq_lens = {s[1] for shapes in strict_backend.shapes for s in shapes if len(s) == 2 and s[0] == batch}
    seq_lens.discard(conformance.MAX_POS)
    # the first call is traced static (Dynamo's first compile), every other call runs at a bucket
    assert seq_lens <= set(buckets) | {lengths[0]}, sorted(seq_lens)
    assert len(seq_lens) <= len(buckets) + 1


@pytest.mark.parametrize("family", ["mamba2", "bamba", "qwen3_next", "mamba", "jamba"])
def test_chunked_families_bucket_over_several_chunks(strict_backend, family):
    """Mamba (v1) and Jamba have no chunk (a selective scan, traced as one scan op): the same lengths and buckets."""
    plans = _sweep(_model(family), NeuronDelegate(registered_name="strict_aten_standin", module=None), LENGTHS)
    _assert_bucketed(strict_backend, plans, LENGTHS, BUCKETS)


@pytest.mark.parametrize("family", ["mamba2", "qwen3_next"])
def test_lengths_of_one_chunk_bucket_at_a_bucket_of_one_chunk(strict_backend, family):
    plans = _sweep(
        _model(family), NeuronDelegate(registered_name="strict_aten_standin", module=None), SHORT_LENGTHS, SHORT_BUCKETS
    )
    # Mamba-2's graph of one chunk is invalid at the longer buckets (Dynamo's guard pins one chunk) and runs at 8;
    # its graphs of several chunks are invalid at 8
    _assert_bucketed(strict_backend, plans, SHORT_LENGTHS, SHORT_BUCKETS, invalid_ok=True)


def test_the_multiple_of_chunk_graph_is_refused_at_buckets_that_are_not_multiples():
    """The counter-example: buckets 12 and 20 are not multiples of 8. At 12 the graph traced at 16 (no padding
    inside the scan) would reshape 12 rows into chunks of 8: those buckets are invalid for it, calls that would land
    there run unpadded, and the result stays exact."""
    plans = _sweep(_model("mamba2"), "eager", [5, 9, 16, 24, 11, 40], buckets=[12, 20, 64])
    multiple = [p for p in plans if any("multiple of 8" in str(why) for why in p.invalid_buckets.values())]
    assert multiple and all(set(p.invalid_buckets) == {12, 20} for p in multiple), [
        (p.refused, p.invalid_buckets) for p in plans
    ]
    assert all(p.active for p in multiple)


@pytest.mark.parametrize("family", ["qwen3_next", "mixtral", "qwen3_moe"])
def test_moe_families_bucket_at_batch_three(strict_backend, family):
    """Deployments pad batches of several rows. A mixture of experts flattens the ``[B, L]`` tokens (the padding of
    each row then sits between the rows: an interleaved dim), regroups them by expert, gathers them back and views
    them as ``[B, L]`` again. The experts' function is proven row-wise as a whole, so its result keeps each token row
    where its input had it (``padding_proof/layout.py``, ``_rows_kept``); before, the gathered result counted as a
    fresh prefix dim and the view back was refused, so every MoE at batch > 1 ran unpadded."""
    lengths = [5, 9, 17, 24, 40, 63]
    plans = _sweep(_model(family), NeuronDelegate(registered_name="strict_aten_standin", module=None), lengths, batch=3)
    _assert_bucketed(strict_backend, plans, lengths, BUCKETS, batch=3)
