"""Padding-safety rules met in doge, gemma3, inkling, inkling2, llama4 and zaya (issue 20): plain-torch reproductions of
each pattern, checked op by op (no violation, or the unsafe near-variant refused naming its op) and bucketed
through graphpass (real rows equal eager's at several lengths).

* a boolean-mask write of a scalar (``ids[ids == image_token] = 0``): ``masked_fill`` in place, row-wise;
* "valid" convolutions (stride 1, no padding) after a left ``F.pad``: every output row that exists at the real
  length reads real input rows only (zaya's CCA);
* a float ``attn_mask`` for ``scaled_dot_product_attention`` that holds ``finfo.min`` above the diagonal and
  finite values on it (doge's dynamic mask ``dt.masked_fill(mask != 0, min)``, inkling's position bias);
* the count of left-padding tokens ``(attention_mask.cumsum(-1) == 0).sum(-1)`` of a zero-padded mask that is
  1 at every real position (llama4's chunked mask);
* ``repeat`` of the rows once per expert, viewed back as ``[experts, tokens, hidden]`` (llama4's MoE);
* sliding windows ``F.pad(x, (k - 1, 0)).unfold(-1, k, 1)`` (inkling2's short convolution).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass
from helpers import dynamo_graph, tied_padding_violations

B, H, C, E, V = 2, 16, 6, 3, 11
LENGTHS = (3, 5, 7, 9, 12, 16)
BUCKETS = [8, 16]


def _check(model, *inputs, zero_padded=("attention_mask",)):
    """Violations of padding dim 1 of every tensor input (tied together), the attention mask padded with 0;
    and the inputs the accepted proofs need to hold 1 at every real position."""
    return tied_padding_violations(dynamo_graph(model, *inputs), zero_padded)


def _bucketed(model, make_inputs, dim_name, lengths=LENGTHS):
    """Compile ``model`` with buckets on ``dim_name``'s dim 1, run every length, compare with eager; returns the
    sequence lengths the delegate compiled for."""
    seen = []

    def record(gm, example_inputs):
        seen.extend(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor))
        return gm.forward

    torch._dynamo.reset()
    gp = graphpass.backend(then=record, static_shapes={"dims": {dim_name: 1}, "buckets": BUCKETS})
    compiled = torch.compile(model, backend=gp)
    with torch.no_grad():
        for n in lengths:
            inputs = make_inputs(n)
            torch.testing.assert_close(
                compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-6, msg=lambda m: f"length {n}: {m}"
            )
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    return {s[1] for s in seen if len(s) >= 2 and s[0] == B}


# --------------------------------------------------------------------------------------------
# x[mask] = scalar
# --------------------------------------------------------------------------------------------


class MaskedIds(nn.Module):
    """gemma3: image tokens out of the vocabulary are replaced by 0 before the embedding."""

    def __init__(self, variant: str = "scalar") -> None:
        super().__init__()
        self.variant = variant
        self.emb = nn.Embedding(V, H)
        self.row = nn.Parameter(torch.randn(H))
        self.lin = nn.Linear(H, H)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.clone()
        if self.variant == "scalar":
            ids[input_ids == 3] = 0
            return self.lin(self.emb(ids))
        if self.variant == "tensor0d":
            ids[input_ids == 3] = torch.tensor(0)
            return self.lin(self.emb(ids))
        h = self.emb(ids)
        h[input_ids == 3] = self.row  # a value tensor with elements of its own
        return self.lin(h)


def _ids(n, seed=0):
    return torch.randint(0, V, (B, n), generator=torch.Generator().manual_seed(seed + n))


@pytest.mark.parametrize("variant", ["scalar", "tensor0d"])
def test_a_scalar_written_through_a_boolean_mask_is_row_wise(variant):
    got, _, _ = _check(MaskedIds(variant), _ids(7))
    assert got == []


def test_a_scalar_written_through_a_boolean_mask_buckets_exactly():
    lengths = _bucketed(MaskedIds(), lambda n: (_ids(n),), "input_ids")
    assert lengths <= {LENGTHS[0], *BUCKETS}, lengths


def test_a_value_tensor_written_through_a_boolean_mask_is_refused():
    got, _, _ = _check(MaskedIds("rows"), _ids(7))
    assert any(v.op == "operator.setitem" and "boolean mask" in v.reason for v in got), got


# --------------------------------------------------------------------------------------------
# valid convolutions after a left pad
# --------------------------------------------------------------------------------------------


class StackedValidConv(nn.Module):
    """zaya's CCA: left-pad by (k1 - 1) + (k2 - 1), a depthwise and a grouped convolution without padding."""

    def __init__(self, padding: int = 0) -> None:
        super().__init__()
        k1, k2 = 3, 2
        self.c1 = nn.Conv1d(C, C, k1, groups=C, padding=padding)
        self.c2 = nn.Conv1d(C, C, k2, groups=2, padding=0)
        self.left = (k1 - 1 - 2 * padding) + (k2 - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(x.transpose(1, 2), (self.left, 0))
        return self.c2(self.c1(h)).transpose(1, 2) + x


def test_valid_convolutions_after_a_left_pad_are_safe():
    got, _, _ = _check(StackedValidConv(), torch.randn(B, 7, C))
    assert got == []


def test_valid_convolutions_after_a_left_pad_bucket_exactly():
    g = torch.Generator().manual_seed(1)
    lengths = _bucketed(StackedValidConv(), lambda n: (torch.randn(B, n, C, generator=g),), "x")
    assert lengths <= {LENGTHS[0], *BUCKETS}, lengths


def test_a_convolution_padded_on_both_sides_by_less_than_its_reach_is_refused():
    got, _, _ = _check(StackedValidConv(padding=1), torch.randn(B, 7, C))  # row i reads row i + 1
    assert [v.op for v in got] == ["torch.conv1d"], got
    assert "reads later rows" in got[0].reason


# --------------------------------------------------------------------------------------------
# a float attention mask for scaled_dot_product_attention
# --------------------------------------------------------------------------------------------


class DynamicMaskAttention(nn.Module):
    """doge: transformers' boolean causal-and-padding mask turned additive (``where(mask, 0, min)``), then the
    per-key ``dt`` values written where that is 0 and ``min`` elsewhere, passed to SDPA; two layers (the second
    layer's ``dt`` is computed from the first attention's output)."""

    def __init__(self, variant: str = "causal") -> None:
        super().__init__()
        self.variant = variant
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.dt = nn.Linear(H, 2)

    def allowed(self, n: int, attention_mask: torch.Tensor) -> torch.Tensor:
        q = torch.arange(n)[None, None, :, None]
        kv = torch.arange(n)[None, None, None, :]
        rule = kv < q if self.variant == "strict" else kv <= q
        pad = attention_mask.to(torch.bool)[torch.arange(attention_mask.shape[0])[:, None, None, None], kv]
        return torch.ones((), dtype=torch.bool) & rule & pad

    def layer(self, x: torch.Tensor, float_mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, 2, H // 2).transpose(1, 2) for p in (self.q, self.k, self.v))
        dt = torch.exp(-F.softplus(self.dt(x))).transpose(-1, -2)  # [b, 2, n]: a value per key
        fill = -1.0 if self.variant == "small_fill" else torch.finfo(x.dtype).min  # inline: a global float is an input
        masked = float_mask[:, :, :, :n] == 0 if self.variant == "masks_the_allowed" else float_mask[:, :, :, :n] != 0
        attn_mask = dt[:, :, None, :].expand(-1, -1, n, -1).masked_fill(masked, fill)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.o(out.transpose(1, 2).reshape(b, n, H)) + x

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed(x.shape[1], attention_mask)
        float_mask = torch.where(allowed, torch.full((), 0.0), torch.finfo(x.dtype).min)
        return self.layer(self.layer(x, float_mask), float_mask)


def _x_am(n, seed=2):
    return torch.randn(B, n, H, generator=torch.Generator().manual_seed(seed + n)), torch.ones(B, n, dtype=torch.long)


def test_sdpa_with_an_additive_mask_proven_causal_is_safe():
    got, relied, zero = _check(DynamicMaskAttention(), *_x_am(7))
    assert got == []
    assert relied == set(zero)  # the diagonal is finite only where the attention mask is 1 (checked per call)


def _left_padded_call_runs_unpadded(model):
    gp = graphpass.backend(then="eager", static_shapes={"dims": {"x": 1}, "buckets": BUCKETS})
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=gp)
    with torch.no_grad():
        for n in (5, 6):
            x, am = _x_am(n)
            compiled(x, am)
        am[0, :2] = 0  # left padding
        with pytest.warns(UserWarning, match="is not 1 everywhere in this call"):
            got = compiled(x, am)
        torch.testing.assert_close(got, model(x, am), rtol=1e-5, atol=1e-6)


def test_sdpa_with_an_additive_mask_buckets_exactly_and_a_mask_with_zeros_runs_unpadded():
    model = DynamicMaskAttention()
    lengths = _bucketed(model, _x_am, "x")
    assert lengths <= {LENGTHS[0], *BUCKETS}, lengths
    _left_padded_call_runs_unpadded(model)


@pytest.mark.parametrize(
    "variant",
    [
        "strict",  # kv < q: row 0 has no key, the diagonal is not finite
        "small_fill",  # -1 does not vanish from a softmax
        "masks_the_allowed",  # == 0: the later keys keep their dt values
    ],
)
def test_sdpa_with_an_additive_mask_not_proven_causal_is_refused(variant):
    got, _, _ = _check(DynamicMaskAttention(variant), *_x_am(7))
    assert got and all(
        v.op == "torch._C._nn.scaled_dot_product_attention" or "scaled_dot_product_attention" in v.op for v in got
    ), got
    assert all(v.reason.startswith("attention over the padded sequence") for v in got), got


# --------------------------------------------------------------------------------------------
# the count of left-padding tokens
# --------------------------------------------------------------------------------------------


class LeftPaddingCount(nn.Module):
    def __init__(self, variant: str = "zero") -> None:
        super().__init__()
        self.variant = variant

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.variant == "zero":  # transformers' masking_utils (chunked attention)
            left = (attention_mask.cumsum(dim=-1) == torch.zeros_like(attention_mask)).sum(dim=-1)
        elif self.variant == "one":  # padding rows hold the real count, which may be 1
            left = (attention_mask.cumsum(dim=-1) == 1).sum(dim=-1)
        else:  # the padding zeros are counted
            left = (attention_mask == 0).sum(dim=-1)
        return x * (left[:, None, None] + 1)


def test_the_count_of_left_padding_tokens_of_a_zero_padded_mask_is_safe():
    got, relied, zero = _check(LeftPaddingCount(), *_x_am(7))
    assert got == []
    assert relied == set(zero)


def test_the_count_of_left_padding_tokens_buckets_exactly_and_a_left_padded_call_runs_unpadded():
    model = LeftPaddingCount()
    lengths = _bucketed(model, _x_am, "x")
    assert lengths <= {LENGTHS[0], *BUCKETS}, lengths
    _left_padded_call_runs_unpadded(model)  # two tokens counted


@pytest.mark.parametrize("variant", ["one", "zeros"])
def test_a_count_that_the_padding_changes_is_refused(variant):
    got, _, _ = _check(LeftPaddingCount(variant), *_x_am(7))
    assert [(v.op, v.reason) for v in got] == [("Tensor.sum", "sum along the padded dim mixes rows")], got


# --------------------------------------------------------------------------------------------
# repeat once per expert
# --------------------------------------------------------------------------------------------


class RepeatPerExpert(nn.Module):
    """llama4's MoE: every token repeated once per expert, scaled by its router score, a batched matmul per
    expert, the experts' results summed."""

    def __init__(self, variant: str = "experts") -> None:
        super().__init__()
        self.variant = variant
        self.router = nn.Linear(H, E, bias=False)
        self.w = nn.Parameter(torch.randn(E, H, H) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, H)
        scores = torch.exp(F.logsigmoid(self.router(h)))
        if self.variant == "pairs":  # a [tokens, tokens] tensor repeated: padding between the copies' rows
            pairs = (h @ h.transpose(0, 1)).repeat(2, 1)
            return pairs[:, :1].reshape(2, -1).sum(0).view(x.shape[0], -1, 1) + x
        routed = h.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1)
        out = torch.bmm(routed.view(E, -1, H), self.w).view(-1, H)
        if self.variant == "sum_over_tokens":
            return out.sum(0) + x
        return out.reshape(E, -1, H).sum(dim=0).view(x.shape)


def test_repeat_per_expert_viewed_back_is_safe():
    got, _, _ = _check(RepeatPerExpert(), torch.randn(B, 7, H))
    assert got == []


def test_repeat_per_expert_buckets_exactly():
    g = torch.Generator().manual_seed(3)
    lengths = _bucketed(RepeatPerExpert(), lambda n: (torch.randn(B, n, H, generator=g),), "x")
    assert lengths <= {LENGTHS[0], *BUCKETS}, lengths


def test_repeat_of_a_tensor_padded_twice_or_a_sum_over_the_repeated_rows_is_refused():
    got, _, _ = _check(RepeatPerExpert("pairs"), torch.randn(B, 7, H))
    assert any(v.op == "Tensor.repeat" and "puts padding in the middle" in v.reason for v in got), got
    got, _, _ = _check(RepeatPerExpert("sum_over_tokens"), torch.randn(B, 7, H))
    assert any(v.op == "Tensor.sum" and v.reason == "sum along the padded dim mixes rows" for v in got), got


# --------------------------------------------------------------------------------------------
# sliding windows (Tensor.unfold)
# --------------------------------------------------------------------------------------------


class WindowConv(nn.Module):
    """inkling2's short convolution: left-pad by k - 1, trim to the last n + k - 1 rows, windows of k rows (the
    token ``lag`` steps back at ``[..., lag]`` after the flip), a weighted sum per window."""

    def __init__(self, step: int = 1) -> None:
        super().__init__()
        self.k, self.step = 4, step
        self.w = nn.Parameter(torch.randn(C, self.k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        context = F.pad(x.transpose(1, 2), (self.k - 1, 0))[..., -(n + self.k - 1) :]
        windows = context.unfold(-1, self.k, self.step).flip(-1).transpose(1, 2)  # [b, n, C, k]
        return (windows * self.w).sum(-1) + x


def test_sliding_windows_after_a_left_pad_are_safe():
    got, _, _ = _check(WindowConv(), torch.randn(B, 7, C))
    assert got == []


def test_sliding_windows_after_a_left_pad_bucket_exactly():
    g = torch.Generator().manual_seed(4)
    lengths = _bucketed(WindowConv(), lambda n: (torch.randn(B, n, C, generator=g),), "x")
    assert lengths <= {LENGTHS[0], *BUCKETS}, lengths


def test_sliding_windows_with_a_step_are_refused():
    x = torch.randn(B, 9, C)
    got, _, _ = _check(lambda x: x.transpose(1, 2).unfold(-1, 3, 2).sum(-1).transpose(1, 2), x)
    assert [(v.op, v.reason) for v in got] == [
        ("Tensor.unfold", "unfold along the padded dim with step 2: not proven")
    ], got
