"""Padding-safety analysis: which ops of a dynamic-shape Dynamo graph break padding the sequence dim."""

from __future__ import annotations

import math

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass
from graphpass.models.transformer import TinyTransformer, TransformerConfig
from graphpass.static_shapes.padding_safety import PaddingViolation, check_padding_safety, padded_dims
from graphpass.torch_compat import source_name

B, L, H, V = 2, 7, 16, 11  # distinct sizes: Dynamo would give equal sizes one symbol


@torch.library.custom_op("padtest::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def seq_input(gm: torch.fx.GraphModule, dim: int = 1) -> tuple[str, sympy.Symbol]:
    """The graph's first tensor input (not a parameter or buffer) with a dim ``dim``, and the symbol Dynamo gave
    its dim ``dim`` (read off the placeholder's example value). Needs the placeholders' ``grapharg``
    metadata, which Dynamo keeps only while the backend runs."""
    for n in gm.graph.nodes:
        if n.op != "placeholder" or not isinstance(n.meta.get("example_value"), torch.Tensor):
            continue
        source = source_name(n.meta["grapharg"].source)
        if "_parameters" in source or "_buffers" in source or n.meta["example_value"].dim() <= dim:
            continue
        size = n.meta["example_value"].shape[dim]
        assert isinstance(size, torch.SymInt), f"dim {dim} of {source} was specialized to {size}"
        assert isinstance(size.node.expr, sympy.Symbol)
        return n.name, size.node.expr
    raise AssertionError("no tensor input")


class Recorder:
    """A torch.compile backend that keeps every graph Dynamo hands it, with its seq input."""

    def __init__(self, dim: int = 1) -> None:
        self.dim = dim
        self.graphs: list[torch.fx.GraphModule] = []
        self.inputs: list[tuple[str, sympy.Symbol]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        self.inputs.append(seq_input(gm, self.dim))
        return gm.forward


def trace(fn, *inputs, dim: int = 1, mark: bool = False) -> tuple[torch.fx.GraphModule, sympy.Symbol]:
    """The single Dynamo graph of ``fn(*inputs)`` traced with dynamic shapes, and the seq symbol."""
    torch._dynamo.reset()
    rec = Recorder(dim)
    if mark:
        torch._dynamo.mark_dynamic(inputs[0], dim)
        compiled = torch.compile(fn, backend=rec, dynamic=False)
    else:
        compiled = torch.compile(fn, backend=rec, dynamic=True)
    with torch.no_grad():
        compiled(*inputs)
    assert len(rec.graphs) == 1, f"expected one graph, got {len(rec.graphs)} (graph break?)"
    return rec.graphs[0], rec.inputs[0][1]


def check(fn, *inputs, causal_ok: bool = True, **kw) -> list[PaddingViolation]:
    gm, sym = trace(fn, *inputs, **kw)
    return check_padding_safety(gm, {sym}, causal_ok=causal_ok)


def x3() -> torch.Tensor:
    return torch.randn(B, L, H)


def node_target(gm: torch.fx.GraphModule, name: str):
    return next(n for n in gm.graph.nodes if n.name == name).target


# --------------------------------------------------------------------------------------------
# safe graphs
# --------------------------------------------------------------------------------------------


def test_mlp_is_row_wise():
    mlp = nn.Sequential(nn.Linear(H, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, H), nn.SiLU()).eval()
    gm, sym = trace(mlp, x3())
    assert check_padding_safety(gm, {sym}) == []
    x = next(
        n
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and isinstance(n.meta["example_value"], torch.Tensor)
        and n.meta["example_value"].dim() == 3
    )
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert padded_dims(x, {sym}) == (1,)
    assert padded_dims(out.meta["example_value"], {sym}) == (1,)


def test_softmax_over_the_vocab_is_safe():
    head = nn.Linear(H, V)
    gm, sym = trace(lambda x: torch.softmax(head(x), dim=-1), x3())
    assert check_padding_safety(gm, {sym}) == []


def test_layer_norm_and_rms_norm_are_safe():
    ln, rms = nn.LayerNorm(H), nn.RMSNorm(H)
    assert check(lambda x: rms(ln(x)) * 2, x3()) == []


def test_rms_norm_written_by_hand_is_safe():
    assert check(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), x3()) == []


def test_views_indexing_and_masks_that_keep_rows_are_safe():
    def fn(x):
        b, s, _ = x.shape
        heads = x.view(b, s, 4, H // 4).transpose(1, 2)  # [B, 4, L, H/4]
        back = heads.transpose(1, 2).reshape(b, s, H)
        tokens = back.reshape(-1, H).view(b, s, H)  # merge with the batch dim and back
        mask = torch.full((s, s), float("-inf")).triu(1)  # built from the length, position-wise
        pos = torch.arange(s)[None, :, None].float()
        return tokens[:, 1:] + x[:, :-1], x[..., 0], mask, x + pos, torch.cat([x[:, :2], x], dim=1)

    assert check(fn, x3()) == []


def test_scalar_arithmetic_on_the_length_is_safe():
    # SymInt arithmetic nodes themselves have no tensor output; using them as sizes is fine
    assert check(lambda x: x.new_zeros(x.size(0), x.size(1) * 2, 3), x3()) == []


def test_mark_dynamic_graph():
    gm, sym = trace(lambda x: (x.softmax(-1), x.sum(1)), x3(), mark=True)
    got = check_padding_safety(gm, {sym})
    assert [(v.node, v.dim) for v in got] == [("sum_1", 1)]


# --------------------------------------------------------------------------------------------
# reductions, scans, sorts
# --------------------------------------------------------------------------------------------


def test_sum_along_the_padded_dim():
    got = check(lambda x: x.sum(dim=1), x3())
    assert len(got) == 1
    v = got[0]
    assert (v.node, v.op, v.dim) == ("sum_1", "Tensor.sum", 1)
    assert v.reason == "sum along the padded dim mixes rows"
    assert v.source.startswith("test_padding_safety.py:")
    line = int(v.source.split(":")[1])
    assert "x.sum(dim=1)" in open(__file__).read().splitlines()[line - 1]


@pytest.mark.parametrize(
    "fn, op, dim",
    [
        (lambda x: torch.sum(x, 1), "torch.sum", 1),
        (lambda x: x.sum(-2), "Tensor.sum", 1),
        (lambda x: x.mean(dim=(0, 1)), "Tensor.mean", 1),
        (lambda x: x.amax(dim=[-2]), "Tensor.amax", 1),
        (lambda x: torch.logsumexp(x, 1), "torch.logsumexp", 1),
        (lambda x: F.softmax(x, dim=1), "torch.nn.functional.softmax", 1),
        (lambda x: x.max(dim=1).values, "Tensor.max", 1),
        (lambda x: x.var(1), "Tensor.var", 1),
        (lambda x: x.norm(2, 1), "Tensor.norm", 1),
        (lambda x: x.sum(), "Tensor.sum", None),
        (lambda x: x.max(), "Tensor.max", None),
    ],
)
def test_reductions_along_the_padded_dim(fn, op, dim):
    got = check(fn, x3())
    assert [(v.op, v.dim) for v in got] == [(op, dim)]


@pytest.mark.parametrize("fn", [lambda x: x.sum(-1), lambda x: x.amax(dim=(0, 2)), lambda x: torch.max(x, x)])
def test_reductions_along_other_dims_are_safe(fn):
    assert check(fn, x3()) == []


def test_cumsum_along_the_padded_dim():
    """A prefix scan: row i reads rows <= i, so with the padding at the end real rows never read
    it (causal_ok); without causal_ok it mixes rows."""
    fn = lambda x: (x.cumsum(-1), x.cumsum(1), torch.cummax(x, 1).values, torch.logcumsumexp(x, 1))  # noqa: E731
    assert check(fn, x3()) == []
    got = check(fn, x3(), causal_ok=False)
    assert [(v.node, v.op, v.dim) for v in got][0] == ("cumsum_1", "Tensor.cumsum", 1) and len(got) == 3
    assert "cumsum along the padded dim" in got[0].reason


def test_diff_along_the_padded_dim_is_causal_unless_it_appends():
    """transformers' packed-sequence mask: ``torch.diff(position_ids, prepend=..., dim=-1)``, then a cumsum."""
    fn = lambda x: (torch.diff(x, dim=1), torch.diff(x, prepend=x[:, :1], dim=1).cumsum(1))  # noqa: E731
    assert check(fn, x3()) == []
    got = check(lambda x: torch.diff(x, dim=1, append=x[:, :1]), x3())
    assert [(v.op, v.dim) for v in got] == [("torch.diff", 1)]


def test_topk_along_the_padded_dim():
    got = check(lambda x: (torch.topk(x, 3, dim=-1).values, torch.topk(x, 3, dim=1).values), x3())
    assert [(v.op, v.dim) for v in got] == [("torch.topk", 1)]


def test_flip_roll_and_diff_along_the_padded_dim():
    got = check(lambda x: (x.flip(2), x.flip(1), torch.roll(x, 1, 1), torch.diff(x, dim=1)), x3(), causal_ok=False)
    assert [(v.op, v.dim) for v in got] == [("Tensor.flip", 1), ("torch.roll", 1), ("torch.diff", 1)]


def test_group_norm_over_a_padded_length():
    gn = nn.GroupNorm(2, H)
    got = check(lambda x: gn(x.transpose(1, 2)), x3())
    assert [(v.op, v.dim) for v in got] == [("torch.nn.functional.group_norm", 2)]
    assert "normalises over the padded dim" in got[0].reason


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------


class HandAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-1, -2) / math.sqrt(H)  # [B, L, L]: fine by itself
        probs = scores.softmax(-1)
        return probs @ v


def test_hand_written_attention():
    gm, sym = trace(HandAttention(), x3())
    got = check_padding_safety(gm, {sym})
    assert len(got) == 2
    first, second = got
    assert first.op == "Tensor.softmax" and first.dim == 2
    assert first.reason == "softmax along the padded dim mixes rows"
    assert second.op == "operator.matmul" and second.dim == 2
    assert second.reason == "matmul contracts over the padded dim"
    order = [n.name for n in gm.graph.nodes]
    assert order.index(first.node) < order.index(second.node)
    # q @ k^T contracts over the head dim: not a violation, though its output is [B, L, L]
    matmuls = [n.name for n in gm.graph.nodes if n.target is node_target(gm, second.node)]
    assert len(matmuls) == 2 and matmuls[1] == second.node


class SdpaAttention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.qkv = nn.Linear(H, 3 * H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, H // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return y.transpose(1, 2).reshape(b, s, H)


def test_sdpa_non_causal():
    got = check(SdpaAttention(causal=False), x3())
    assert len(got) == 1
    assert got[0].op == "torch.nn.functional.scaled_dot_product_attention"
    assert got[0].reason == "attention over the padded sequence without is_causal or a mask proven causal"
    assert got[0].dim == 2


def test_sdpa_causal():
    assert check(SdpaAttention(causal=True), x3()) == []
    got = check(SdpaAttention(causal=True), x3(), causal_ok=False)
    assert [v.reason for v in got] == ["attention over the padded sequence"]


def test_sdpa_with_padded_queries_only_is_safe():
    kv = torch.randn(B, 2, 5, 8)  # a static memory: only the queries are padded
    got = check(lambda q, kv: F.scaled_dot_product_attention(q, kv, kv), torch.randn(B, 2, L, 8), kv, dim=2)
    assert got == []


# --------------------------------------------------------------------------------------------
# cat, indexing, reshapes, values
# --------------------------------------------------------------------------------------------


def test_cat_along_the_padded_dim():
    got = check(lambda x: (torch.cat([x, x], dim=-1), torch.cat([x, x], dim=1)), x3())
    assert [(v.node, v.op, v.dim, v.reason) for v in got] == [("cat_1", "torch.cat", 1, "cat along the padded dim")]


def test_indexing_from_the_end_reads_padding():
    got = check(lambda x: (x[:, 0], x[:, 2:], x[:, -1], x[:, -3:]), x3())
    assert [(v.op, v.dim) for v in got] == [("operator.getitem", 1)] * 2
    assert "counts from the end" in got[0].reason


def test_reshape_that_scrambles_rows():
    got = check(lambda x: (x.reshape(x.size(0), -1), x.reshape(x.size(0), H, -1)), x3())
    assert [(v.op, v.dim) for v in got] == [("Tensor.reshape", 1)]
    assert "moves padding rows" in got[0].reason


def test_length_used_as_a_value():
    got = check(lambda x: x * x.size(1), x3())
    assert [(v.op, v.dim) for v in got] == [("operator.mul", None)]
    assert "padded length" in got[0].reason


def test_pad_after_the_padded_dim():
    got = check(lambda x: (F.pad(x, (0, 0, 2, 0)), F.pad(x, (0, 0, 0, 2))), x3())
    assert [v.dim for v in got] == [1]


# --------------------------------------------------------------------------------------------
# unknown and graphpass ops
# --------------------------------------------------------------------------------------------


def test_custom_op_is_unknown():
    got = check(lambda x: _double(x) + 1, x3())
    assert len(got) == 1
    assert got[0].op == "padtest.double.default"
    assert got[0].reason == "unknown op padtest.double.default: cannot prove row independence"


def test_custom_op_on_unpadded_tensors_is_fine():
    w = torch.randn(H)
    assert check(lambda x, w: x * _double(w), x3(), w) == []


def test_graphpass_ops_are_ignored():
    def fn(x):
        torch.ops.graphpass.trap_enter("blk", [x])
        y = graphpass.capture_tensor("h", x * 2)
        torch.ops.graphpass.trap_exit("blk", [y])
        return y

    gm, sym = trace(fn, x3())
    assert any(str(n.target).startswith("graphpass.") for n in gm.graph.nodes)
    assert check_padding_safety(gm, {sym}) == []


def test_graphpass_pipeline_graph_of_the_bundled_transformer():
    """The graph graphpass hands its delegate (trap boundaries inserted) is padding-safe: causal
    attention, RMSNorm, gated MLP, tied head. Without causal_ok each layer's attention is named."""
    cfg = TransformerConfig(vocab=64, hidden=32, heads=2, layers=2, mlp=48, max_seq=32)
    model = TinyTransformer(cfg).eval()
    rec = Recorder()
    compiled = torch.compile(model, backend=graphpass.backend(then=rec), dynamic=True)
    with torch.no_grad():
        compiled(torch.randint(0, cfg.vocab, (B, L)))
    assert len(rec.graphs) == 1
    gm = rec.graphs[0]
    assert sum(1 for n in gm.graph.nodes if str(n.target).startswith("graphpass.trap_enter")) == cfg.layers
    sym = rec.inputs[0][1]
    assert check_padding_safety(gm, {sym}) == []
    got = check_padding_safety(gm, {sym}, causal_ok=False)
    assert [v.reason for v in got] == ["attention over the padded sequence"] * cfg.layers


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def test_padded_dims_helper():
    gm, sym = trace(lambda x: x.transpose(0, 1).unsqueeze(0), x3())
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert padded_dims(out, {sym}) == (1,)
    assert padded_dims(out.meta["example_value"], {sympy.Symbol(str(sym))}) == (1,)  # matched by name
    assert padded_dims(torch.zeros(3, 4), {sym}) == ()
    assert padded_dims(5, {sym}) == ()


def test_violations_in_graph_order_and_printable():
    got = check(lambda x: (x.cumsum(1), x.sum(1), x.softmax(1)), x3(), causal_ok=False)
    assert [v.op for v in got] == ["Tensor.cumsum", "Tensor.sum", "Tensor.softmax"]
    assert str(got[0]).startswith(f"{got[0].node} [Tensor.cumsum] (dim 1): cumsum along the padded dim")


def test_aten_graph_after_aot_autograd():
    """The same rules read an AOTAutograd (aten) graph: ops are named by their overload."""
    from torch._dynamo.backends.common import aot_autograd

    got: list[PaddingViolation] = []

    def fw(gm: torch.fx.GraphModule, example_inputs):
        x = next(n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))
        got.extend(check_padding_safety(gm, {x.meta["val"].shape[1].node.expr}))
        return gm.forward

    fn = torch.compile(
        lambda x: (x.softmax(-1), x.sum(1), (x @ x.transpose(1, 2)).softmax(-1) @ x),
        backend=aot_autograd(fw_compiler=fw),
        dynamic=True,
    )
    with torch.no_grad():
        fn(x3())
    assert [(v.op, v.dim) for v in got] == [
        ("aten.sum.dim_IntList", 1),
        ("aten._softmax.default", 2),
        ("aten.bmm.default", 2),
    ]


# --------------------------------------------------------------------------------------------
# index provenance: position indices and explicit causal masks (transformers' mask functions)
# --------------------------------------------------------------------------------------------


class MaskedSdpa(nn.Module):
    """SDPA with an explicit boolean mask built the way transformers' ``sdpa_mask`` builds it:
    ``arange`` indices viewed to [1, 1, L, 1] / [1, 1, 1, L], positions looked up through
    ``position_ids[batch, q]``, and the mask functions combined with ``&``."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant

    def mask(self, b: int, n: int) -> torch.Tensor:
        q = (torch.arange(n) + 0)[None, None, :, None]
        kv = torch.arange(n)[None, None, None, :]
        v = self.variant
        if v == "causal":
            return kv <= q
        if v == "causal_window":
            return (kv <= q) & (kv > q - 3)
        if v == "positions":
            pos = torch.arange(n).unsqueeze(0).expand(b, -1)
            batch = torch.arange(b)[:, None, None, None]
            return torch.ones((), dtype=torch.bool) & (pos[batch, kv] <= pos[batch, q])
        if v == "strict":
            return kv < q + 1
        if v == "lenient":
            return kv <= q + 1
        if v == "anti":
            return q <= kv
        if v == "or":
            return (kv <= q) | (kv > q)
        if v == "shifted_positions":
            pos = torch.arange(n).unsqueeze(0).expand(b, -1)
            batch = torch.arange(b)[:, None, None, None]
            return pos[batch, kv] <= pos[batch, q - 1]  # row 0 reads index -1: the last row, padding
        raise AssertionError(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = x.view(b, n, 2, H // 2).transpose(1, 2)
        out = F.scaled_dot_product_attention(h, h, h, attn_mask=self.mask(b, n))
        return out.transpose(1, 2).reshape(b, n, H)


@pytest.mark.parametrize("variant", ["causal", "causal_window", "positions", "strict"])
def test_an_explicit_mask_proven_causal_lets_attention_over_the_padding(variant):
    assert check(MaskedSdpa(variant), x3()) == []
    got = check(MaskedSdpa(variant), x3(), causal_ok=False)  # causal proofs off: refused as before
    assert [v.reason for v in got] == ["attention over the padded sequence"]


@pytest.mark.parametrize("variant", ["lenient", "anti", "or"])
def test_a_mask_that_lets_a_row_see_a_later_row_is_refused(variant):
    got = check(MaskedSdpa(variant), x3())
    assert [(v.op, v.reason) for v in got] == [
        (
            "torch.nn.functional.scaled_dot_product_attention",
            "attention over the padded sequence without is_causal or a mask proven causal",
        )
    ]


def test_a_tensor_index_that_is_not_the_identity_is_refused():
    got = check(MaskedSdpa("shifted_positions"), x3())
    assert got and got[0].op == "operator.getitem"
    assert "indexes the padded dim with an index that is a tensor" in got[0].reason


def test_identity_index_and_causal_mask_bucket_exactly_through_graphpass(strict_backend):
    from graphpass.backends import NeuronDelegate

    strict = strict_backend
    model = MaskedSdpa("positions")
    then = NeuronDelegate(registered_name="strict_aten_standin", module=None)
    gp = graphpass.backend(then=then, static_shapes={"dims": {"x": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp)
    for n in (3, 5, 7, 9, 12, 16):
        x = torch.randn(B, n, H)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    lengths = {shape[1] for shapes in strict.shapes for shape in shapes if len(shape) == 3 and shape[0] == B}
    assert lengths == {3, 8, 16}  # the first exact call, then one shape per bucket, never another length
    assert len(strict.graphs) == 3


class PaddingMaskedSdpa(nn.Module):
    """Bidirectional attention whose mask is the (zero-padded) attention mask read in place, as
    transformers' bidirectional mask builds it: ``attention_mask[batch, kv]`` ANDed in."""

    def __init__(self, read: str = "in_place") -> None:
        super().__init__()
        self.read = read

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        pm = attention_mask.to(torch.bool)
        kv = torch.arange(n)[None, None, None, :]
        if self.read == "shifted":
            kv = kv - 1  # key j reads the mask of key j - 1: the first padding key reads a real row's True
        mask = torch.ones((), dtype=torch.bool) & pm[torch.arange(b)[:, None, None, None], kv]
        h = x.view(b, n, 2, H // 2).transpose(1, 2)
        out = F.scaled_dot_product_attention(h, h, h, attn_mask=mask.expand(b, 1, n, n))
        return out.transpose(1, 2).reshape(b, n, H)


def _bidirectional_check(read, pad_value):
    from graphpass.static_shapes.padding_safety import check_padding_safety

    graphs = []
    model = PaddingMaskedSdpa(read)
    f = torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True)
    f(torch.randn(B, L, H), torch.ones(B, L, dtype=torch.long))
    gm = graphs[0]
    names = [
        n.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
    ]
    syms = {n.meta["example_value"].shape[1].node.expr for n in gm.graph.nodes if n.name in names}
    zero = [n for n in names if "attention_mask" in n] if pad_value == 0 else []
    return check_padding_safety(gm, syms, zero_padded=zero, ties={s: min(syms, key=str) for s in syms})


def test_a_mask_read_in_place_from_a_zero_padded_attention_mask_hides_the_padding_keys():
    assert _bidirectional_check("in_place", 0) == []


@pytest.mark.parametrize("read,pad_value", [("in_place", 1), ("shifted", 0)])
def test_a_mask_that_may_keep_a_padding_key_is_refused(read, pad_value):
    got = _bidirectional_check(read, pad_value)
    assert got and any("scaled_dot_product_attention" in v.op or "getitem" in v.op for v in got)


class CausalConv(nn.Module):
    def __init__(self, padding: int, kernel: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv1d(H, H, kernel, groups=H, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        return self.conv(x.transpose(1, 2))[..., :n].transpose(1, 2)


def test_a_causal_conv1d_along_the_padded_dim_is_safe_and_a_centered_one_is_not():
    assert check(CausalConv(padding=3), x3()) == []
    got = check(CausalConv(padding=1), x3())
    assert [v.reason for v in got] == [
        "conv1d along the padded dim reads later rows (not stride 1 with padding >= (kernel - 1) * dilation)"
    ]


# --------------------------------------------------------------------------------------------
# padding rows written into a buffer that is not padded (a key/value cache's slots)
# --------------------------------------------------------------------------------------------

SLOTS = 32  # the buffer's slot count (static); the padded rows land in slots length + L ..


class SlotCache(nn.Module):
    """A static key/value cache in miniature: ``x``'s rows written at slots ``length + i`` of buffers
    that outlive the call, then read as the keys and values of an attention. ``read``: how they are read."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.keys = torch.zeros(B, 1, SLOTS, H)
        self.length = torch.tensor(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        q = x[:, None]  # [B, 1, n, H]
        slots = torch.arange(n) + self.length
        self.keys.index_copy_(2, slots, q)
        keys = self.keys[:, :, None].expand(B, 1, 2, SLOTS, H).reshape(B, 2, SLOTS, H)
        q2 = q.expand(B, 2, n, H)
        if self.read == "sum":
            return self.keys.sum(2) + x.sum(-1, keepdim=True)  # every slot read as data
        q_pos = torch.arange(n) + self.length.to(torch.long)
        if self.read == "other_offset":
            q_pos = torch.arange(n) + 4  # positions that do not start where the rows were written
        mask = torch.arange(SLOTS)[None, None, None, :] <= q_pos[None, None, :, None]
        if self.read == "no_mask":
            return F.scaled_dot_product_attention(q2, keys, keys)
        return F.scaled_dot_product_attention(q2, keys, keys, attn_mask=mask.expand(B, 1, n, SLOTS))


def test_padding_rows_written_to_slots_an_attention_mask_hides_are_safe():
    """Real query ``i`` (position ``length + i``) sees slots ``<= length + i``; the padding rows sit at
    slots ``length + L ..``: no real row reads them."""
    assert check(SlotCache("masked"), x3()) == []


@pytest.mark.parametrize("read", ["sum", "no_mask", "other_offset"])
def test_padding_rows_written_to_slots_that_are_read_as_data_are_refused(read):
    """Before the check these graphs passed: the write's destination is not padded, so nothing
    downstream looked padded, and summing the slots (or attending to all of them) read the padding."""
    got = check(SlotCache(read), x3())
    assert got and "writes padding rows into" in got[0].reason, got


class EagerMaskedAttention(nn.Module):
    """Eager attention as transformers' ``eager_attention_forward`` runs it: scores plus the additive mask
    ``eager_mask`` builds (``where(bool_mask, 0, finfo.min)`` of ``and_masks(causal, padding)``), a softmax over
    the keys, a product with the values. Unsafe variants change one step."""

    def __init__(self, variant: str = "causal") -> None:
        super().__init__()
        self.variant = variant

    def bool_mask(self, b: int, n: int, attention_mask: torch.Tensor) -> torch.Tensor:
        q = torch.arange(n)[None, None, :, None]
        kv = torch.arange(n)[None, None, None, :]
        v = self.variant
        rule = {
            "strict": kv < q,
            "anti": q <= kv,
            "window": (kv <= q) & (kv > q - 3),
            "bidirectional": q >= 0,
            "bidirectional_shifted": q >= 1,
        }.get(v, kv <= q)
        pad = attention_mask.to(torch.bool)[torch.arange(b)[:, None, None, None], kv]
        return torch.ones((), dtype=torch.bool) & rule & pad

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = x.view(b, n, 2, H // 2).transpose(1, 2)
        fill = -1.0 if self.variant == "small_fill" else torch.finfo(x.dtype).min
        allowed = self.bool_mask(b, n, attention_mask)
        mask = torch.where(allowed, torch.zeros((), dtype=x.dtype), fill)
        scores = h @ h.transpose(2, 3) * 0.25
        if self.variant in ("masked_fill", "mpt", "masked_fill_allowed"):  # masked_fill takes the masked entries
            masked = {"masked_fill": ~allowed, "mpt": mask.to(torch.bool), "masked_fill_allowed": allowed}[self.variant]
            scores, mask = scores.masked_fill(masked, torch.finfo(x.dtype).min), torch.zeros((), dtype=x.dtype)
        if self.variant == "softcap":
            scores = torch.tanh(scores / 5.0) * 5.0
        if self.variant == "masked_scores":  # a fill value already in the scores: a row may be all fill values
            scores = torch.where(torch.rand(n, n) > 0.5, scores, torch.tensor(torch.finfo(x.dtype).min))
        scores = scores + mask
        if self.variant == "clamped":  # xglm: max(scores + mask, finfo.min)
            scores = torch.max(scores, torch.full((), torch.finfo(x.dtype).min))
        w = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        w = F.dropout(w, p=0.0, training=False)
        return (w @ h).transpose(1, 2).reshape(b, n, H)


def _eager_mask_check(variant, pad_value=0):
    from graphpass.static_shapes.padding_safety import check_padding_safety

    graphs = []
    f = torch.compile(
        EagerMaskedAttention(variant), backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True
    )
    with torch.no_grad():
        f(torch.randn(B, L, H), torch.ones(B, L, dtype=torch.long))
    gm = graphs[0]
    names = [
        n.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
    ]
    syms = {n.meta["example_value"].shape[1].node.expr for n in gm.graph.nodes if n.name in names}
    zero = [n for n in names if "attention_mask" in n] if pad_value == 0 else []
    relied: set[str] = set()
    got = check_padding_safety(gm, syms, zero_padded=zero, ties={s: min(syms, key=str) for s in syms}, relied_on=relied)
    return got, relied, zero


@pytest.mark.parametrize("variant", ["causal", "window", "softcap", "masked_fill", "mpt", "bidirectional", "clamped"])
def test_softmax_of_scores_plus_an_additive_causal_mask_is_safe_when_the_mask_is_all_ones(variant):
    got, relied, zero = _eager_mask_check(variant)
    assert got == []
    assert relied == set(zero)  # the proof needs the attention mask to be 1 on every real position (checked per call)


@pytest.mark.parametrize(
    "variant,pad_value",
    [
        ("strict", 0),  # kv < q: row 0 has no key, its softmax is uniform over the (padded) length
        ("anti", 0),  # q <= kv: rows see later keys
        ("small_fill", 0),  # -1 does not vanish from a softmax
        ("masked_scores", 0),  # the scores may already hold fill values on the diagonal
        ("causal", 1),  # the attention mask padded with 1: the padding keys are not masked
        ("masked_fill_allowed", 0),  # masked_fill of the allowed entries: every row sees the later keys only
        ("bidirectional", 1),  # a bidirectional mask whose padding keys are not masked
        ("bidirectional_shifted", 0),  # q >= 1: row 0 sees no key
    ],
)
def test_an_additive_mask_not_proven_causal_with_a_key_per_row_is_refused(variant, pad_value):
    got, _, _ = _eager_mask_check(variant, pad_value)
    ops = {v.op for v in got}
    assert "torch.nn.functional.softmax" in ops or "torch.nn.functional.scaled_dot_product_attention" in ops, got
    assert any(v.reason == "softmax along the padded dim mixes rows" for v in got)
    assert any(v.reason == "matmul contracts over the padded dim" for v in got)


def test_additive_mask_buckets_exactly_and_a_mask_with_zeros_runs_unpadded(strict_backend):
    from graphpass.backends import NeuronDelegate

    model = EagerMaskedAttention("causal")
    then = NeuronDelegate(registered_name="strict_aten_standin", module=None)
    gp = graphpass.backend(then=then, static_shapes={"dims": {"x": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp)
    with torch.no_grad():
        for n in (3, 5, 7, 9, 12, 16):
            x, am = torch.randn(B, n, H), torch.ones(B, n, dtype=torch.long)
            torch.testing.assert_close(compiled(x, am), model(x, am), rtol=1e-5, atol=1e-6)
        lengths = {
            shape[1] for shapes in strict_backend.shapes for shape in shapes if len(shape) == 3 and shape[0] == B
        }
        assert lengths == {3, 8, 16}
        x, am = torch.randn(B, 6, H), torch.ones(B, 6, dtype=torch.long)
        am[0, :2] = 0  # left padding: rows 0 and 1 of sequence 0 see no key
        with pytest.warns(UserWarning, match="is not 1 everywhere in this call"):
            got = compiled(x, am)
        torch.testing.assert_close(got, model(x, am), rtol=1e-5, atol=1e-6)


def _unused_max(x):
    seq_len = torch.max(x) + 1  # noqa: F841 (the point: phimoe's rotary embedding: computed, then unused with the default rope type
    return x * 2


def _max_written_into_a_scratch(x):
    scratch = x.clone()
    scratch[:, 0] = scratch.amax(1)  # a write: its ancestors count, although scratch reaches no output
    return x * 2


def test_dead_code_over_the_padded_dim_is_not_a_violation_but_a_write_still_is():
    assert check(_unused_max, x3()) == []
    got = check(lambda x: x * (torch.max(x) + 1), x3())
    assert [v.reason for v in got] == ["max over every dim includes the padded dim 1 and mixes rows"]
    got = check(_max_written_into_a_scratch, x3())
    assert any(v.reason == "amax along the padded dim mixes rows" for v in got), got


class SinkAttention(nn.Module):
    """gpt-oss's eager attention: a per-head sink logit appended after the keys, the row max subtracted, a softmax,
    the sink column dropped again, the product with the values. Unsafe variants change one step."""

    def __init__(self, variant: str = "sink") -> None:
        super().__init__()
        self.variant = variant
        self.sinks = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = x.view(b, n, 2, H // 2).transpose(1, 2)
        allowed = EagerMaskedAttention().bool_mask(b, n, attention_mask)
        scores = h @ h.transpose(2, 3) * 0.25 + torch.where(
            allowed, torch.zeros((), dtype=x.dtype), torch.finfo(x.dtype).min
        )
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, n, -1)
        pieces = [sinks, scores] if self.variant == "sink_first" else [scores, sinks]
        logits = torch.cat(pieces, dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)
        kept = {"sink": probs[..., :-1], "sink_first": probs[..., 1:], "keep_sink": probs[..., :n]}[
            "sink" if self.variant == "sink_returned" else self.variant
        ]
        out = (kept @ h).transpose(1, 2).reshape(b, n, H)
        return (out, logits) if self.variant == "sink_returned" else out


def _sink_check(variant):
    from graphpass.static_shapes.padding_safety import check_padding_safety

    graphs = []
    f = torch.compile(SinkAttention(variant), backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True)
    with torch.no_grad():
        f(torch.randn(B, L, H), torch.ones(B, L, dtype=torch.long))
    gm = graphs[0]
    names = [
        n.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
    ]
    syms = {
        n.meta["example_value"].shape[1].node.expr
        for n in gm.graph.nodes
        if n.name in names and n.meta["example_value"].dim() > 1
    }
    zero = [n for n in names if "attention_mask" in n]
    relied: set[str] = set()
    got = check_padding_safety(gm, syms, zero_padded=zero, ties={s: min(syms, key=str) for s in syms}, relied_on=relied)
    return got, relied, zero


def test_attention_sinks_appended_after_the_masked_keys_and_dropped_again_are_safe():
    got, relied, zero = _sink_check("sink")
    assert got == []
    assert relied == set(zero)


@pytest.mark.parametrize(
    "variant",
    [
        "sink_first",  # the sink before the keys: the slice [..., 1:] is not the key dim's prefix
        "keep_sink",  # [..., :n] keeps the first padding key (or the sink) instead of dropping the sink
        "sink_returned",  # the logits with the sink column after the padding are an output: sliced back wrongly
    ],
)
def test_attention_sinks_anywhere_else_are_refused(variant):
    got, _, _ = _sink_check(variant)
    assert got, variant
    assert any(v.op == "torch.cat" for v in got) or any("matmul" in v.op for v in got), got


# --------------------------------------------------------------------------------------------
# run-time offsets (static-generate) meeting the diagonal / additive-mask facts (static-archs)
# --------------------------------------------------------------------------------------------


class OffsetMasks(nn.Module):
    """Positions with a run-time offset ``X`` (a 0-d length tensor) used where only offset-free positions
    are sound: as an index into the padded dim, through a gather, or as the queries of an additive mask."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.length = torch.tensor(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        if self.variant == "index":  # x[:, X + i]: row i reads row X + i, not itself
            return x[:, torch.arange(n) + self.length] * 2
        h = x.view(b, n, 2, H // 2).transpose(1, 2)
        kv = torch.arange(n)[None, None, None, :]
        if self.variant == "gathered":  # table[X + i] == X + i: the offset survives the gather
            q = torch.arange(SLOTS)[torch.arange(n) + self.length][None, None, :, None]
            return F.scaled_dot_product_attention(h, h, h, attn_mask=kv <= q)
        q = (torch.arange(n) + self.length)[None, None, :, None]  # row i sees keys <= X + i: padding
        mask = torch.where(kv <= q, torch.zeros(()), torch.finfo(x.dtype).min)
        w = F.softmax(h @ h.transpose(2, 3) + mask, dim=-1)
        return w @ h


@pytest.mark.parametrize("variant", ["index", "gathered", "additive"])
def test_positions_with_a_run_time_offset_are_not_offset_free(variant):
    """``index``: an offset index is not the identity; ``gathered``: a gather keeps the index's offset, so
    ``kv <= table[X + i]`` is not a plain causal mask; ``additive``: a causal fact with an offset is not
    proven true on its diagonal and never makes an additive-mask softmax over the padded keys safe."""
    got = check(OffsetMasks(variant), x3())
    assert got, variant


def test_an_offset_causal_mask_anded_with_all_true_keeps_its_offset():
    """transformers' ``and_masks`` starts from ``new_ones((), bool)``: the AND must keep the offset, so the
    cache write whose slots start at the same offset stays proven hidden."""

    class AndedSlotCache(SlotCache):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[1]
            q = x[:, None]
            self.keys.index_copy_(2, torch.arange(n) + self.length, q)
            keys = self.keys.expand(B, 2, SLOTS, H)
            q_pos = torch.arange(n) + self.length
            mask = torch.ones((), dtype=torch.bool) & (
                torch.arange(SLOTS)[None, None, None, :] <= q_pos[None, None, :, None]
            )
            return F.scaled_dot_product_attention(
                q.expand(B, 2, n, H), keys, keys, attn_mask=mask.expand(B, 1, n, SLOTS)
            )

    assert check(AndedSlotCache("masked"), x3()) == []
