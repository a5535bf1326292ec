"""Padding safety of attention sinks applied through ``logsumexp`` over the keys (granite_swa, granitemoe_swa:
``attn_output * sigmoid(logsumexp(scores + mask) - sink)``) and of sliding windows taken with ``Tensor.unfold``
(inkling2's short convolution), op by op in plain torch, and through graphpass's bucketing. Unsafe near-variants
are still refused with the op named."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass
from graphpass.static_shapes.padding_safety import check_padding_safety

from helpers import dynamo_graph, tied_padding_violations

B, L, H = 2, 7, 16


def _bool_mask(b: int, n: int, attention_mask: torch.Tensor, window: int | None, rule: str = "causal") -> torch.Tensor:
    """transformers' ``and_masks(causal[, sliding window], padding)`` written out."""
    q = torch.arange(n)[None, None, :, None]
    kv = torch.arange(n)[None, None, None, :]
    allowed = (kv <= q) if rule == "causal" else (q <= kv)
    if window is not None:
        allowed = allowed & (kv > q - window)
    pad = attention_mask.to(torch.bool)[torch.arange(b)[:, None, None, None], kv]
    return torch.ones((), dtype=torch.bool) & allowed & pad


class LseSinkAttention(nn.Module):
    """Two layers of granite_swa's eager attention: the sink as a post-attention scale
    ``sigmoid(logsumexp(scores + mask, -1) - sink)``, the second layer with a sliding window (its padding rows see
    padding keys only, so their logsumexp is a fill value). Unsafe variants change one step."""

    def __init__(self, variant: str = "sink") -> None:
        super().__init__()
        self.variant = variant
        self.sinks = nn.Parameter(torch.randn(2, 2))
        self.proj = nn.Linear(H, H)

    def layer(self, x: torch.Tensor, attention_mask: torch.Tensor, i: int, window: int | None) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.proj(x).view(b, n, 2, H // 2).transpose(1, 2)
        rule = "anti" if self.variant == "anti" else "causal"
        mask = torch.where(
            _bool_mask(b, n, attention_mask, window, rule), torch.zeros((), dtype=x.dtype), torch.finfo(x.dtype).min
        )
        scores = h @ h.transpose(2, 3) * 0.25 + mask
        lse = torch.logsumexp(scores, dim=-1)
        if self.variant == "lse_over_queries":  # over the queries: a key's column reads later (padding) rows
            lse = torch.logsumexp(scores, dim=-2)
        shifted = lse - self.sinks[i].view(1, -1, 1)
        # the unbounded variant: the scale is the raw logsumexp, a fill value in a fully masked padding row, which
        # the next layer's scores then carry (a fill value plus a mask need not vanish)
        scale = shifted if self.variant == "unbounded" else shifted.float().sigmoid()
        w = F.softmax(scores, dim=-1, dtype=torch.float32)
        out = (w @ h) * scale.unsqueeze(-1)
        return out.transpose(1, 2).reshape(b, n, H)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.layer(x, attention_mask, 0, None)
        return x + self.layer(x, attention_mask, 1, 3)


def _check(model: nn.Module):
    return tied_padding_violations(dynamo_graph(model, torch.randn(B, L, H), torch.ones(B, L, dtype=torch.long)))


def test_logsumexp_sink_scale_over_masked_keys_is_safe():
    got, relied, zero = _check(LseSinkAttention("sink"))
    assert got == []
    assert relied == set(zero)  # the proof needs the attention mask to be 1 at every real position


@pytest.mark.parametrize(
    "variant,op",
    [
        ("anti", "torch.logsumexp"),  # q <= kv: a real row's logsumexp sums the later (padding) keys
        ("lse_over_queries", "torch.logsumexp"),  # logsumexp over the padded query rows
        ("unbounded", "torch.nn.functional.softmax"),  # no sigmoid: the next layer's scores may hold fill values
    ],
)
def test_logsumexp_sink_scale_variants_that_read_the_padding_are_refused(variant, op):
    got, _, _ = _check(LseSinkAttention(variant))
    assert any(v.op == op and "along the padded dim mixes rows" in v.reason for v in got), got


def test_logsumexp_sink_scale_buckets_and_equals_eager(strict_backend):
    from graphpass.backends import NeuronDelegate

    torch.manual_seed(0)
    model = LseSinkAttention("sink")
    then = NeuronDelegate(registered_name="strict_aten_standin", module=None)
    gp = graphpass.backend(then=then, static_shapes={"dims": {"x": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp)
    with torch.no_grad():
        for n in (3, 5, 7, 9, 12, 16):
            x, am = torch.randn(B, n, H), torch.ones(B, n, dtype=torch.long)
            torch.testing.assert_close(compiled(x, am), model(x, am), rtol=1e-5, atol=1e-6)
    lengths = {shape[1] for shapes in strict_backend.shapes for shape in shapes if len(shape) == 3 and shape[0] == B}
    assert lengths == {3, 8, 16}


class UnfoldShortConv(nn.Module):
    """inkling2's dynamic short convolution: a left pad by ``k - 1``, the last ``L + k - 1`` rows, sliding windows
    ``unfold(-1, k, 1)`` (window ``t`` = tokens ``t - k + 1 .. t``), flipped to lags, weighted per token, summed.
    Unsafe variants change one step."""

    def __init__(self, variant: str = "causal", k: int = 4) -> None:
        super().__init__()
        self.variant, self.k = variant, k
        self.weight_proj = nn.Linear(H, k)
        self.static_weight = nn.Parameter(torch.randn(H, k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        k = self.k
        weights = self.static_weight + self.weight_proj(x)[:, :, None, :]  # [b, n, H, k]
        amounts = (0, k - 1) if self.variant == "right_pad" else (k - 1, 0)  # right: the last tokens read the padding
        context = F.pad(x.transpose(1, 2), amounts)[..., -(n + k - 1) :]
        if self.variant == "length_size":  # windows as wide as half the (padded) length: they grow with the padding
            return context.unfold(-1, n // 2, 1).sum(-1)[..., :n].transpose(1, 2) + x
        elif self.variant == "im2col":  # F.unfold (im2col): not the sliding-window Tensor.unfold
            windows = F.unfold(context[:, :, None, :], (1, k)).view(b, H, k, n).transpose(2, 3).flip(-1).transpose(1, 2)
        else:
            windows = context.unfold(-1, k, 1).flip(-1).transpose(1, 2)  # [b, n, H, k]
        return (windows * weights).sum(-1) + x


def test_unfold_windows_after_a_left_pad_are_safe():
    assert check_padding_safety(*_trace(UnfoldShortConv("causal"))) == []


@pytest.mark.parametrize(
    "variant,op",
    [
        ("right_pad", "torch._C._nn.pad"),
        ("length_size", "Tensor.unfold"),
        ("im2col", "torch.nn.functional.unfold"),
    ],
)
def test_unfold_variants_that_read_the_padding_are_refused(variant, op):
    got = check_padding_safety(*_trace(UnfoldShortConv(variant)))
    assert any(v.op == op for v in got), got


def _trace(model: nn.Module):
    graphs = []
    f = torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True)
    with torch.no_grad():
        f(torch.randn(B, L, H))
    gm = graphs[0]
    x = next(
        n
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and isinstance(n.meta.get("example_value"), torch.Tensor)
        and n.meta["example_value"].dim() == 3
    )
    return gm, {x.meta["example_value"].shape[1].node.expr}


def test_unfold_short_conv_buckets_and_equals_eager(strict_backend):
    from graphpass.backends import NeuronDelegate

    torch.manual_seed(0)
    model = UnfoldShortConv("causal")
    then = NeuronDelegate(registered_name="strict_aten_standin", module=None)
    gp = graphpass.backend(then=then, static_shapes={"dims": {"x": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp)
    with torch.no_grad():
        for n in (3, 5, 7, 9, 12, 16):
            x = torch.randn(B, n, H)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    lengths = {shape[1] for shapes in strict_backend.shapes for shape in shapes if len(shape) == 3 and shape[0] == B}
    assert lengths == {3, 8, 16}
