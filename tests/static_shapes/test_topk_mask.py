"""Sparse-attention indexers (DeepSeek-V3.2's DSA and its copies): a top-k over the masked index scores, scattered
into a "kept keys" mask ANDed with the attention mask (graphpass/static_shapes/topk_mask.py).

Padding is proven exact only at buckets ``b`` where ``k(b) >= b``: every unmasked key of a real row is then kept,
whatever the tie-breaking, and the ANDed mask equals the attention mask on every real row. At other buckets a real
row may have more unmasked keys than ``k``, and a tie at the ``k``-th index score (frequent: the scores are sums of
``relu``'d head scores, so exact zeros) is broken differently with padding: those buckets run unpadded, and a plan
without any valid bucket is refused, naming the ``topk``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass

from helpers import bench_conformance

BUCKETS = [8, 16]
LENGTHS = [3, 5, 8, 9, 12, 16, 6]


class Indexed(nn.Module):
    """One sparse-attention layer written like transformers' DeepSeek-V3.2 (SDPA path): ``variant`` makes the
    near-variants the proof must not accept."""

    def __init__(self, k: int, variant: str = "dsa", d: int = 16, vocab: int = 50):
        super().__init__()
        torch.manual_seed(0)
        self.k, self.variant = k, variant
        self.emb = nn.Embedding(vocab, d)
        self.iq, self.ik = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.q, self.kk, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, n = ids.shape
        pos = torch.arange(n, device=ids.device)
        if "anti_causal" in self.variant:
            causal = pos[None, None, None, :] >= pos[None, None, :, None]  # keys after the query: not causal
        else:
            causal = pos[None, None, None, :] <= pos[None, None, :, None]
        mask = causal.expand(b, 1, n, n)  # [B, 1, S, T]
        scores = F.relu(self.iq(x) @ self.ik(x).transpose(-1, -2))  # exact zeros: ties
        if "additive" in self.variant:  # eager attention's float mask (transformers' other branch)
            return self._additive(x, mask, scores)
        scores = scores.masked_fill(~mask[:, 0, :, :], float("-inf"))
        k = min(self.k, scores.shape[-1])
        idx = scores.topk(k, dim=-1).indices.to(torch.int32)
        index_mask = idx.new_ones((b, n, n), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
        if self.variant == "other_mask":
            full = torch.ones_like(mask)  # not the mask the scores were masked by
            mask = full & ~index_mask
        else:
            mask = mask & ~index_mask
        q, kk, v = (f(x)[:, None] for f in (self.q, self.kk, self.v))
        out = F.scaled_dot_product_attention(q, kk, v, attn_mask=mask)[:, 0]
        if self.variant == "gather":  # the indices also used as data
            out = out + torch.gather(x, 1, idx.long()[..., :1].expand(b, n, x.shape[-1]))
        return self.head(out)

    def _additive(self, x, mask, scores):
        b, n = x.shape[:2]
        fmask = torch.where(mask, 0.0, torch.finfo(x.dtype).min)  # [B, 1, S, T]
        scores = scores + fmask[:, 0, :, :]
        idx = scores.topk(min(self.k, scores.shape[-1]), dim=-1).indices.to(torch.int32)
        index_mask = idx.new_ones((b, n, n), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
        fmask = fmask.masked_fill(index_mask, torch.finfo(x.dtype).min)
        q, kk, v = (f(x)[:, None] for f in (self.q, self.kk, self.v))
        weights = torch.softmax(q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5 + fmask, dim=-1)
        return self.head((weights @ v)[:, 0])


def _sweep(model: nn.Module, lengths=LENGTHS, vocab: int = 50, call=None):
    """Compile through graphpass with BUCKETS; every length's logits equal eager's. The graphpass backend, the
    sequence lengths the delegate compiled, and the static_shapes warnings."""
    seen: list[tuple[int, ...]] = []

    def delegate(gm, example_inputs):
        seen.extend(
            tuple(t.shape)
            for t in example_inputs
            if isinstance(t, torch.Tensor)
            and t.dim() == 2
            and t.dtype == torch.long
            and all(isinstance(s, int) for s in t.shape)
        )  # not a dynamic fallback
        return gm

    torch._dynamo.reset()
    gp = graphpass.backend(
        then=delegate, static_shapes={"dims": {"input_ids" if call else "ids": 1}, "buckets": BUCKETS}
    )
    compiled = torch.compile(model, backend=gp)
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in lengths:
            ids = torch.randint(0, vocab, (2 if call is None else 1, n), generator=g)
            got = compiled(ids) if call is None else call(compiled, ids)
            ref = model(ids) if call is None else call(model, ids)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"length {n}: {m}")
    plans = [gr.analysis.bucket_plan for gr in gp.graphs if getattr(gr.analysis, "bucket_plan", None) is not None]
    return plans, {s[1] for s in seen}, [str(w.message) for w in caught if "static_shapes" in str(w.message)]


def test_indexer_with_k_at_least_every_bucket_pads_and_matches_eager():
    plans, lens, _ = _sweep(Indexed(k=16))
    assert plans and all(p.active and not p.invalid_buckets for p in plans), [
        (p.refused, p.invalid_buckets) for p in plans
    ]
    assert lens <= set(BUCKETS) | {LENGTHS[0]}, lens  # only the first call's exact length and the buckets


def test_indexer_with_an_additive_mask_pads_and_matches_eager():
    plans, lens, _ = _sweep(Indexed(k=16, variant="additive"))
    assert plans and all(p.active and not p.invalid_buckets for p in plans), [
        (p.refused, p.invalid_buckets) for p in plans
    ]
    assert lens <= set(BUCKETS) | {LENGTHS[0]}, lens
    plans, _, _ = _sweep(Indexed(k=4, variant="additive"))
    assert plans and not plans[0].active and plans[0].refused[0].startswith("Tensor.topk at node"), plans[0].refused


def test_indexer_pads_only_to_the_buckets_k_covers():
    plans, lens, warned = _sweep(Indexed(k=10))  # k = min(10, s): 8 at bucket 8, 10 < 16 at bucket 16
    assert plans and plans[0].active and set(plans[0].invalid_buckets) == {16}, [
        (p.refused, p.invalid_buckets) for p in plans
    ]
    assert "topk" in plans[0].invalid_buckets[16]
    assert any("bucket 16 is not proven" in w and "topk" in w for w in warned), warned
    assert 8 in lens and 16 not in lens, lens


def test_indexer_with_k_below_every_bucket_is_refused_naming_the_topk():
    plans, _, warned = _sweep(Indexed(k=4))  # rows with more than 4 unmasked keys: ties break with the padding
    assert plans and not plans[0].active
    reason = plans[0].refused[0]
    assert reason.startswith("Tensor.topk at node") and "test_topk_mask.py" in reason and "k = Min(4" in reason, reason
    assert any("not padding this graph" in w for w in warned), warned


@pytest.mark.parametrize(
    "variant,op",
    [
        ("anti_causal", "Tensor.topk"),
        ("other_mask", "Tensor.topk"),
        ("gather", "Tensor.topk"),
        ("additive_anti_causal", "Tensor.topk"),
    ],
)
def test_near_variants_stay_refused(variant, op):
    plans, _, _ = _sweep(Indexed(k=16, variant=variant))
    assert plans and not plans[0].active
    assert any(r.startswith(op) and "topk along the padded dim mixes rows" in r for r in plans[0].refused), plans[
        0
    ].refused


_conformance = bench_conformance


@pytest.mark.parametrize(
    "family,index_topk,active", [("deepseek_v32", 16, True), ("deepseek_v32", 4, False), ("hy_v4", 16, True)]
)
def test_tiny_sparse_attention_lms(family, index_topk, active):
    """DeepSeek-V3.2 (SDPA: the boolean mask) and HY-V4 (eager attention: the additive mask, and "shared" layers that
    reuse the previous layer's top-k)."""
    pytest.importorskip("transformers")
    conformance = _conformance()
    model = conformance.build_model(family)
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = index_topk

    def call(m, ids):
        return m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits

    plans, lens, _ = _sweep(model, lengths=[5, 7, 12, 14, 6], vocab=model.config.vocab_size, call=call)
    assert plans and plans[0].active is active, [p.refused for p in plans]
    if active:
        assert lens <= {5, 8, 16}, lens
    else:
        assert plans[0].refused[0].startswith(f"Tensor.topk at node topk (modeling_{family}.py"), plans[0].refused
