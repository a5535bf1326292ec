"""Soundness of the padding proof (issue 33): the five classes an adversarial review found accepted and silently
wrong, each closed at its root, with variants beyond the review's examples.

1. attention whose query and key rows do not line up (keys a shifted slice of the queries' rows, static queries
   over padded keys) accepted as causal: SDPA ``is_causal``, a boolean mask proven causal, an additive mask;
2. integer position facts kept through a cast to a type that wraps them (``arange(L).to(torch.int8)``);
3. a causal ``conv1d``'s extra output rows (which read the convolution's own zero padding unpadded, and padding
   rows bucketed) left in, or sliced from the right or the centre;
4. reshapes that merge the padded dim with another dim and split it back in another order;
5. library functions trusted as row-wise by path suffix and name alone (now by source digest too).

Every case runs through graphpass with buckets at lengths past a bucket and checks the real rows against eager
(the property that matters), and checks that the proof refuses it (the reason the property holds). Each class
also has sound near-variants that must stay accepted and exact, so the fixes are not "refuse everything".
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass
from helpers import dynamo_graph, tied_padding_violations

B, H = 2, 8


def _run(model, make_inputs, lengths, buckets, dim_name="x"):
    """Compile ``model`` with buckets on ``dim_name``'s dim 1 and run each length; every output must equal eager's.
    Returns (whether every plan was active, the set of lengths the delegate compiled)."""
    seen: list[tuple] = []

    def record(gm, example_inputs):
        seen.extend(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor))
        return gm.forward

    torch._dynamo.reset()
    gp = graphpass.backend(then=record, static_shapes={"dims": {dim_name: 1}, "buckets": list(buckets)})
    compiled = torch.compile(model, backend=gp)
    with torch.no_grad():
        for n in lengths:
            inputs = make_inputs(n)
            torch.testing.assert_close(
                compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5, msg=lambda m: f"length {n}: {m}"
            )
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    return bool(plans) and all(p.active for p in plans), {s[1] for s in seen if len(s) >= 2 and s[0] == B}


def _violations(model, *inputs):
    return tied_padding_violations(dynamo_graph(model, *inputs))[0]


def _x(n, seed=0):
    return (torch.randn(B, n, H, generator=torch.Generator().manual_seed(seed + n)),)


# --------------------------------------------------------------------------------------------
# 1. attention: query and key rows must line up
# --------------------------------------------------------------------------------------------


class ShiftedAttention(nn.Module):
    """Attention over keys that are not the queries' rows: ``variant`` picks the queries, the keys and the mask."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.static_q = nn.Parameter(torch.randn(1, 2, 24, H // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = x.view(b, n, 2, H // 2).transpose(1, 2)  # [B, 2, L, H/2]
        v = self.variant
        if v == "sdpa_causal_k_shifted":  # the review's example: k = h[:, :, 1:] against all of h's queries
            out = F.scaled_dot_product_attention(h, h[:, :, 1:], h[:, :, 1:], is_causal=True)
        elif v == "sdpa_causal_q_shorter":  # queries h[1:] over keys h: unpadded, query i sees keys <= i
            out = F.scaled_dot_product_attention(h[:, :, 1:], h, h, is_causal=True)
        elif v == "sdpa_causal_static_queries":  # learned queries over the padded keys
            out = F.scaled_dot_product_attention(self.static_q.expand(b, -1, -1, -1), h, h, is_causal=True)
            return out.sum(2).reshape(b, 1, H).expand(b, n, H)
        elif v in ("bool_mask_k_shifted", "additive_mask_k_shifted"):
            q_idx = torch.arange(n)[:, None]
            kv_idx = torch.arange(n - 1)[None, :]
            mask = kv_idx <= q_idx  # proven causal on its own dims, [L, L - 1]
            if v == "additive_mask_k_shifted":
                mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
            out = F.scaled_dot_product_attention(h, h[:, :, 1:], h[:, :, 1:], attn_mask=mask)
        elif v == "sdpa_causal_same_shift":  # sound: queries h[:-1], keys h[1:], both L - 1 rows from row 0
            out = F.scaled_dot_product_attention(h[:, :, :-1], h[:, :, 1:], h[:, :, 1:], is_causal=True)
        elif v == "sdpa_causal_aligned":  # sound: the plain causal self-attention
            out = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        else:
            raise AssertionError(v)
        return out.transpose(1, 2).reshape(b, -1, H)


# sdpa_causal_q_shorter is exact (a query i < L - 1 sees keys <= i, all real) but outside the rule "queries and keys
# start at row 0 and have the same padded length": refused, conservatively
NOT_ALIGNED = [
    "sdpa_causal_k_shifted",
    "sdpa_causal_q_shorter",
    "sdpa_causal_static_queries",
    "bool_mask_k_shifted",
    "additive_mask_k_shifted",
]


@pytest.mark.parametrize("variant", NOT_ALIGNED)
def test_attention_with_keys_not_aligned_to_queries_is_refused(variant):
    got = _violations(ShiftedAttention(variant), torch.randn(B, 7, H))
    assert any("scaled_dot_product_attention" in v.op for v in got), got
    active, _ = _run(ShiftedAttention(variant), _x, (5, 9, 13, 17, 31), (16, 32))
    assert not active


@pytest.mark.parametrize("variant", ["sdpa_causal_same_shift", "sdpa_causal_aligned"])
def test_attention_with_aligned_rows_still_buckets(variant):
    assert _violations(ShiftedAttention(variant), torch.randn(B, 7, H)) == []
    active, lengths = _run(ShiftedAttention(variant), _x, (5, 9, 13, 17, 31), (16, 32))
    assert active and lengths <= {5, 16, 32}


# --------------------------------------------------------------------------------------------
# 2. integer facts survive a cast only when the values fit
# --------------------------------------------------------------------------------------------


class CastPositions(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        v = self.variant
        if v.startswith("mask_") and v != "mask_int16_offset":
            dtype = getattr(torch, v.split("_", 1)[1])
            pos = torch.arange(n).to(dtype)
            mask = pos[None, :] <= pos[:, None]
            h = x.view(b, n, 2, H // 2).transpose(1, 2)
            out = F.scaled_dot_product_attention(h, h, h, attn_mask=mask)
            return out.transpose(1, 2).reshape(b, n, H)
        if v == "index_int8_widened":  # wrapped, then widened back: the identity index is gone
            return x[:, torch.arange(n).to(torch.int8).long()]
        if v == "mask_int16_offset":  # arange in int16 plus an offset that overflows it past row 67
            pos = torch.arange(n, dtype=torch.int16) + 32700
            h = x.view(b, n, 2, H // 2).transpose(1, 2)
            out = F.scaled_dot_product_attention(h, h, h, attn_mask=pos[None, :] <= pos[:, None])
            return out.transpose(1, 2).reshape(b, n, H)
        if v == "index_int32":  # sound: int32 holds every position of every bucket
            return x[:, torch.arange(n).to(torch.int32)]
        raise AssertionError(v)


@pytest.mark.parametrize(
    "variant,lengths,buckets",
    [
        ("mask_int8", (5, 131, 150, 200), (64, 256)),
        ("mask_uint8", (5, 131, 300), (64, 512)),
        ("index_int8_widened", (5, 131, 150, 200), (64, 256)),
        ("mask_int16_offset", (5, 70, 100), (64, 128)),
    ],
    ids=["mask_int8", "mask_uint8", "index_int8", "mask_int16_offset"],
)
def test_position_facts_do_not_survive_a_wrapping_cast(variant, lengths, buckets):
    active, _ = _run(CastPositions(variant), lambda n: _x(n), lengths, buckets)
    assert not active


def test_position_facts_survive_a_cast_that_fits_every_bucket():
    active, lengths = _run(CastPositions("index_int32"), lambda n: _x(n), (5, 131, 150, 200), (64, 256))
    assert active and lengths <= {5, 64, 256}
    active, _ = _run(CastPositions("mask_int16"), lambda n: _x(n), (5, 131, 200), (64, 256))
    assert active  # int16 holds positions up to 255


def test_a_cast_that_fits_the_buckets_but_not_every_length_is_refused_past_them():
    # int8 holds 0 .. 127: buckets up to 128 keep the fact, so the plan is active; past the largest bucket the
    # call runs unpadded anyway
    active, lengths = _run(CastPositions("mask_int8"), lambda n: _x(n), (5, 33, 100), (64, 128))
    assert active and lengths <= {5, 64, 128}


# --------------------------------------------------------------------------------------------
# 3. a causal conv1d's extra rows must be sliced off before anything reads them
# --------------------------------------------------------------------------------------------


class CausalConv(nn.Module):
    def __init__(self, variant: str, k: int = 3, dilation: int = 1, extra: int = 0) -> None:
        super().__init__()
        self.variant = variant
        self.conv = nn.Conv1d(H, H, k, padding=(k - 1) * dilation + extra, dilation=dilation, groups=H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        y = self.conv(x.transpose(1, 2))
        v = self.variant
        if v == "unsliced":
            return y
        if v == "right":
            return y[..., 2:]
        if v == "centred":
            return y[..., 1:-1]
        if v == "sum_then_slice":  # read (summed over time) before the slice
            return y[..., :n] + y.sum(-1, keepdim=True)
        if v == "act_then_slice":  # sound: pointwise ops keep the extra rows at the end
            return F.silu(y)[..., :n].transpose(1, 2)
        if v == "sliced":  # sound: Mamba's conv1d(x)[..., :seq_len]
            return y[..., :n].transpose(1, 2)
        raise AssertionError(v)


@pytest.mark.parametrize("variant", ["unsliced", "right", "centred", "sum_then_slice"])
@pytest.mark.parametrize("k,dilation,extra", [(3, 1, 0), (4, 2, 0), (3, 1, 2)], ids=["k3", "k4d2", "k3extra2"])
def test_causal_conv_extra_rows_must_be_sliced_off(variant, k, dilation, extra):
    active, _ = _run(CausalConv(variant, k, dilation, extra), _x, (5, 9, 17), (16, 32))
    assert not active


@pytest.mark.parametrize("variant", ["sliced", "act_then_slice"])
@pytest.mark.parametrize("k,dilation,extra", [(3, 1, 0), (4, 2, 0), (3, 1, 2)], ids=["k3", "k4d2", "k3extra2"])
def test_causal_conv_sliced_to_the_length_still_buckets(variant, k, dilation, extra):
    active, lengths = _run(CausalConv(variant, k, dilation, extra), _x, (5, 9, 17), (16, 32))
    assert active and lengths <= {5, 16, 32}


# --------------------------------------------------------------------------------------------
# 4. merging the padded dim with another dim and splitting it back
# --------------------------------------------------------------------------------------------


class MergeSplit(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        v = self.variant
        if v == "flat_then_swapped":  # the review's example: [B, L, H] -> [B, L*H] -> [B, H, L]
            return x.reshape(b, n * h).reshape(b, h, n).transpose(1, 2) * 2
        if v == "flat_view_swapped":
            return x.view(b, -1).view(b, h, n).permute(0, 2, 1) + 1
        if v == "inner_merge_output":  # [B, H, L] -> [B, H*L]: padding between the rows of every channel
            return x.transpose(1, 2).reshape(b, h * n)[:, None, :].expand(b, n, h * n)[..., :h]
        if v == "batch_merge_cumsum":  # tokens of both batch rows in one dim, then a scan over it
            return x.reshape(b * n, h).cumsum(0).view(b, n, h)
        if v == "batch_merge_sum":  # a sum over every token of the batch
            return x.reshape(-1, h).sum(0) + x
        if v == "batch_merge_cat":  # a static row after the merged tokens, split back
            flat = torch.cat([x.reshape(-1, h), torch.ones(1, h)])[:-1]
            return flat.view(b, n, h)
        if v == "batch_merge_back":  # sound: merged with the batch, row-wise, split back in the same order
            return (x.reshape(-1, h) @ torch.eye(h)).relu().view(b, n, h)
        if v == "flat_back":  # sound: [B, L, H] -> [B, L*H] -> [B, L, H]
            return (x.reshape(b, -1) * 3).reshape(b, n, h)
        if v == "heads":  # sound: [B, L, 2, H/2] -> [B, 2, L, H/2] -> back
            return x.view(b, n, 2, h // 2).transpose(1, 2).transpose(1, 2).reshape(b, n, h)
        raise AssertionError(v)


@pytest.mark.parametrize(
    "variant",
    [
        "flat_then_swapped",
        "flat_view_swapped",
        "inner_merge_output",
        "batch_merge_cumsum",
        "batch_merge_sum",
        "batch_merge_cat",
    ],
)
def test_merge_and_split_in_another_order_is_refused(variant):
    assert _violations(MergeSplit(variant), torch.randn(B, 7, H))
    active, _ = _run(MergeSplit(variant), _x, (5, 9, 17), (16, 32))
    assert not active


@pytest.mark.parametrize("variant", ["batch_merge_back", "flat_back", "heads"])
def test_merge_and_split_in_the_same_order_still_buckets(variant):
    assert _violations(MergeSplit(variant), torch.randn(B, 7, H)) == []
    active, lengths = _run(MergeSplit(variant), _x, (5, 9, 17), (16, 32))
    assert active and lengths <= {5, 16, 32}


# --------------------------------------------------------------------------------------------
# 5. library functions trusted as a whole only with the proven source
# --------------------------------------------------------------------------------------------


_VENDORED = '''
import torch


def batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """An edited copy: the same path suffix and name as transformers', a sum over the tokens inside."""
    return hidden_states + hidden_states.mean(0, keepdim=True)
'''


def test_a_vendored_copy_of_a_trusted_function_is_checked_op_by_op(tmp_path, monkeypatch):
    path = tmp_path / "vendor" / "transformers" / "integrations" / "moe.py"
    path.parent.mkdir(parents=True)
    path.write_text(_VENDORED)
    spec = importlib.util.spec_from_file_location("graphpass_test_vendored_moe", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)

    class Experts(nn.Module):
        def forward(self, x):
            b, n, h = x.shape
            flat = x.reshape(-1, h)
            return mod.batched_mm_experts_forward(self, flat, None, None).view(b, n, h)

    got = _violations(Experts(), torch.randn(B, 7, H))
    assert any("mean" in v.op for v in got), got
    active, _ = _run(Experts(), _x, (5, 9, 17), (16, 32))
    assert not active


def test_every_function_trusted_as_a_whole_has_a_digest():
    from graphpass.static_shapes.padding_safety import ROW_WISE_FUNCTIONS

    assert ROW_WISE_FUNCTIONS
    for (suffix, name), trust in ROW_WISE_FUNCTIONS.items():
        assert len(trust.digest) == 16 and trust.reason, (suffix, name)


def test_the_installed_transformers_moe_functions_match_their_digests():
    pytest.importorskip("transformers")
    import transformers.integrations.moe as moe

    from graphpass.static_shapes.causal_functions import source_digest
    from graphpass.static_shapes.padding_safety import ROW_WISE_FUNCTIONS

    for (_suffix, name), trust in ROW_WISE_FUNCTIONS.items():
        assert source_digest(moe.__file__, name, trust.helpers) == trust.digest, name


# --------------------------------------------------------------------------------------------
# 6. tensor_split at the padded length (transformers 5.25's state-space layers, issue 38)
# --------------------------------------------------------------------------------------------


class SplitAtLength(nn.Module):
    """``torch.tensor_split(x, [L - k], dim=1)``, as transformers 5.25 splits a state-space layer's input before
    its scan (``k``: the recurrent states a cache keeps, 0 without one); ``read_tail``: the last ``k`` rows are
    used too (flipped and appended), which reads rows that move with the padding."""

    def __init__(self, k: int, read_tail: bool = False) -> None:
        super().__init__()
        self.k, self.read_tail = k, read_tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head, tail = torch.tensor_split(x, [x.shape[1] - self.k], dim=1)
        out = torch.cumsum(head, dim=1) * 2  # causal along the rows
        if self.read_tail:
            return torch.cat([out, tail.flip(1)], dim=1)
        return out


@pytest.mark.parametrize("k", [0, 3])
def test_tensor_split_at_the_padded_length_is_accepted_and_exact(k):
    """k 0: the whole tensor and an empty piece. k 3: the first piece is a prefix k rows short of the length (its
    output is cut at the real length minus k, as ``x[:, :L - 3]`` is); growing it back to the length (pad, cat) is
    refused by those ops' own rules."""
    model = SplitAtLength(k)
    lengths = [5, 9, 12, 17, 23, 30, 31]
    active, seen = _run(model, _x, lengths, [16, 32])
    assert active and seen <= {16, 32, lengths[0]}, seen
    assert not _violations(model, *_x(9))


def test_tensor_split_whose_tail_is_read_is_refused_and_exact():
    # eager at length 5, k 2: head rows 0..2, tail rows 3, 4 flipped to 4, 3; padded to 16 the tail would be
    # padding rows 14, 15 and the real rows 3, 4 would come out unflipped
    model = SplitAtLength(2, read_tail=True)
    active, _ = _run(model, _x, [5, 9, 11], [16, 32])
    assert not active
    assert any("tensor_split" in v.op for v in _violations(model, *_x(9)))


def test_tensor_split_whose_tail_is_read_as_the_last_piece_is_refused_and_exact():
    """The tail read through ``parts[-1]`` (not ``parts[1]``) is still a read of rows that move with the padding."""

    class LastPiece(nn.Module):
        def forward(self, x):
            parts = torch.tensor_split(x, [x.shape[1] - 2], dim=1)
            return torch.cumsum(parts[0], dim=1) + parts[-1].sum(1, keepdim=True)

    model = LastPiece()
    assert any("tensor_split" in v.op for v in _violations(model, *_x(9)))
    active, _ = _run(model, _x, [5, 9, 11], [16, 32])
    assert not active


def test_tensor_split_at_another_boundary_is_refused():
    class Sections(nn.Module):
        def forward(self, x):
            a, b = torch.tensor_split(x, 2, dim=1)  # halves: the boundary moves with the padding
            return torch.cat([b, a], dim=1)

    assert any("tensor_split" in v.op for v in _violations(Sections(), *_x(9)))
    active, _ = _run(Sections(), _x, [5, 9, 11], [16, 32])
    assert not active
