"""Causal masks read from a module buffer's values (GPT-Neo's ``tril`` / band ``bias``), and the legacy additive key
mask ``(1 - attention_mask[:, None, None, :]) * finfo.min`` (GPT-1): bucketed only when proven, equal to eager."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.static_shapes.buffer_masks import CausalTable, is_causal_table

from helpers import bench_conformance

BUCKETS = [8, 16]
LENGTHS = [5, 7, 3, 9, 12, 16, 11]  # the first call traces exact, the second dynamic; every bucket is used
MIN = torch.finfo(torch.float32).min


def _tril(n: int, window: int | None = None) -> torch.Tensor:
    bias = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
    return bias ^ torch.tril(bias, -window) if window else bias


class NeoLike(nn.Module):
    """GPT-Neo's eager attention: a boolean buffer sliced ``[k - q : k, :k]``, ``where(mask, scores, min)``, then
    (``additive``) transformers' additive causal + padding mask built from positions, softmax, product with values."""

    def __init__(self, bias: torch.Tensor, additive: bool = False, vocab: int = 13, hidden: int = 8, heads: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.additive = heads, additive
        self.emb = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, vocab)
        self.bias = nn.Buffer(bias, persistent=False)

    def forward(self, input_ids, attention_mask=None):
        b, n = input_ids.shape
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        w = torch.matmul(q, k.transpose(-1, -2))
        ql, kl = q.size(-2), k.size(-2)
        causal = self.bias[:, :, kl - ql : kl, :kl]
        w = torch.where(causal, w, torch.tensor(MIN, dtype=w.dtype))
        if self.additive:
            pos = torch.arange(n)
            allowed = (pos[None, None, None, :] <= pos[None, None, :, None]) & attention_mask[:, None, None, :].bool()
            w = w + torch.where(allowed, torch.zeros((), dtype=w.dtype), MIN)
        w = nn.functional.softmax(w, dim=-1)
        return self.out(torch.matmul(w, v).transpose(1, 2).reshape(b, n, -1))


class GptLike(nn.Module):
    """GPT-1's eager attention: a float ``tril`` buffer multiplied in (``w * b + -1e4 * (1 - b)``) and the legacy
    additive key mask ``(1 - m[:, None, None, :]) * fill`` of the zero-padded ``attention_mask``."""

    def __init__(self, fill: float = MIN, vocab: int = 13, hidden: int = 8, heads: int = 2, max_pos: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.fill = heads, fill
        self.emb = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, vocab)
        self.bias = nn.Buffer(torch.tril(torch.ones(max_pos, max_pos)).view(1, 1, max_pos, max_pos), persistent=False)

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        w = torch.matmul(q, k.transpose(-1, -2))
        c = self.bias[:, :, : w.size(-2), : w.size(-1)]
        w = w * c + -1e4 * (1 - c)
        w = w + (1.0 - attention_mask[:, None, None, :].to(w.dtype)) * self.fill
        w = nn.functional.softmax(w, dim=-1)
        return self.out(torch.matmul(w, v).transpose(1, 2).reshape(b, n, -1))


def _run(model, lengths=LENGTHS, mask=False, static=None, after=None):
    """Compile with buckets, sweep ``lengths`` (batch 2) checking the logits against eager; returns the plans, the
    number of bucketed graphs and the static_shapes warnings. ``after``: called on the model after the second call."""
    torch._dynamo.reset()
    gp = graphpass.backend(then="eager", static_shapes=static or {"dims": {"input_ids": 1}, "buckets": BUCKETS})
    compiled = torch.compile(model, backend=gp)
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for i, n in enumerate(lengths):
            ids = torch.randint(0, 13, (2, n), generator=g)
            kw = {"attention_mask": torch.ones_like(ids)} if mask else {}
            got, ref = compiled(ids, **kw), model(ids, **kw)
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"length {n}: {m}")
            if after is not None and i == 1:
                after(model)
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    padded = [g for g in gp.graphs if getattr(g, "runner", None) is not None]
    return plans, len(padded), [str(w.message) for w in caught if "static_shapes" in str(w.message)]


# ---------------------------------------------------------------------------------------------- the table check


def test_is_causal_table_reads_the_values():
    assert is_causal_table(_tril(6))
    assert is_causal_table(_tril(6, window=2))  # GPT-Neo's local layers: a band, still lower-triangular
    assert is_causal_table(torch.tril(torch.ones(4, 6, dtype=torch.bool)))  # wide: the diagonal is true
    assert not is_causal_table(torch.ones(1, 1, 6, 6, dtype=torch.bool))  # bidirectional
    assert not is_causal_table(torch.tril(torch.ones(6, 6, dtype=torch.bool), -1))  # row 0 sees nothing
    assert not is_causal_table(torch.triu(torch.ones(6, 6, dtype=torch.bool)))  # anti-causal
    assert not is_causal_table(torch.tril(torch.ones(6, 6)))  # float: not a boolean mask
    odd = _tril(6).clone()
    odd[0, 0, 2, 4] = True  # one key after its query
    assert not is_causal_table(odd)
    assert not is_causal_table(torch.empty(6, 6, dtype=torch.bool, device="meta"))


def test_causal_table_notices_writes_and_replacements():
    t = _tril(6).clone()
    table = CausalTable("bias", t)
    assert table.holds(t)
    t[0, 0, 0, 5] = True  # in place: the version counter moves, the values are read again
    assert not table.holds(t)
    t[0, 0, 0, 5] = False
    assert table.holds(t)
    assert not table.holds(torch.ones(1, 1, 6, 6, dtype=torch.bool))  # another tensor: read, not causal
    assert table.holds(_tril(6, window=3))


# ---------------------------------------------------------------------------------------------- GPT-Neo's buffer


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("additive", [False, True])
def test_a_causal_buffer_slice_is_bucketed_and_exact(window, additive):
    plans, padded, warned = _run(NeoLike(_tril(32, window), additive=additive), mask=additive)
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    assert padded == 1 and not warned, warned
    assert [t.name for p in plans for t in p.causal_tables.values()] == ["l_self_buffers_bias_"]


@pytest.mark.parametrize(
    "bias,why",
    [
        (torch.ones(1, 1, 32, 32, dtype=torch.bool), "bidirectional"),
        (torch.tril(torch.ones(1, 1, 32, 32, dtype=torch.bool), -1), "strictly lower: row 0 has no key"),
        (torch.tril(torch.ones(1, 1, 32, 32, dtype=torch.bool), 1), "one key after each query"),
    ],
)
def test_a_buffer_that_is_not_causal_is_refused(bias, why):
    plans, padded, warned = _run(NeoLike(bias))
    assert plans and padded == 0, why
    assert "softmax" in plans[0].refused[0] and "test_buffer_masks.py" in plans[0].refused[0], plans[0].refused
    assert any("not padding this graph" in w for w in warned)


class Shifted(NeoLike):
    """Rows 1 .. L of the table: query ``i`` reads row ``i + 1``, which allows key ``i + 1`` (the first padding key
    for the last real query)."""

    def forward(self, input_ids, attention_mask=None):
        b, n = input_ids.shape
        x = self.emb(input_ids)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        w = torch.matmul(q, k.transpose(-1, -2))
        w = torch.where(self.bias[:, :, 1 : n + 1, :n], w, torch.tensor(MIN, dtype=w.dtype))
        return self.out(torch.matmul(nn.functional.softmax(w, dim=-1), v).transpose(1, 2).reshape(b, n, -1))


def test_a_buffer_slice_that_does_not_start_at_row_0_is_refused():
    plans, padded, _ = _run(Shifted(_tril(32)))
    assert padded == 0 and "softmax" in plans[0].refused[0], [p.refused for p in plans]


def test_a_buffer_written_after_compiling_runs_unpadded():
    def open_up(model):  # every key visible from now on: the proof no longer holds
        model.bias.fill_(True)

    plans, padded, warned = _run(NeoLike(_tril(32)), after=open_up)
    assert plans and plans[0].active and padded == 1
    assert any("no longer the causal" in w and "l_self_buffers_bias_" in w for w in warned), warned


# ---------------------------------------------------------------------------------------------- GPT-1's key mask


def test_the_legacy_additive_key_mask_is_bucketed_and_exact():
    plans, padded, warned = _run(GptLike(), mask=True)
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    assert padded == 1 and not warned, warned
    assert list(plans[0].ones_inputs.values()) == ["l_attention_mask_"]  # checked to be all ones per call


def test_a_legacy_key_mask_with_a_small_fill_is_refused():
    plans, padded, _ = _run(GptLike(fill=-1e4), mask=True)  # -1e4 vanishes from a softmax only next to large scores
    assert padded == 0 and "softmax" in plans[0].refused[0], [p.refused for p in plans]


def test_a_legacy_key_mask_padded_with_ones_is_refused():
    static = {"dims": {"input_ids": 1, "attention_mask": 1}, "buckets": BUCKETS, "pad_value": {"attention_mask": 1}}
    plans, padded, _ = _run(GptLike(), mask=True, static=static)  # 1 - 1 = 0: the padding keys would be kept
    assert padded == 0 and "softmax" in plans[0].refused[0], [p.refused for p in plans]


# ---------------------------------------------------------------------------------------------- GIT's block mask


class GitLike(nn.Module):
    """GIT's text-only mask: ``token_type_ids = zeros_like(embeddings)[..., 0]`` (``image``: ones, every token an
    image token), block ids ``where(token_type_ids == 1, 0, -1)``, and transformers' ``or_masks(causal, block)`` with
    ``block = (group[q] == group[kv]) & (group[q] >= 0)``, ANDed with the attention mask (``padding``)."""

    def __init__(self, image: bool = False, padding: bool = True, vocab: int = 13, hidden: int = 8, heads: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.image, self.padding = heads, image, padding
        self.emb = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        x = self.emb(input_ids)
        types = (torch.ones_like if self.image else torch.zeros_like)(x, dtype=torch.int)[..., 0]
        group = torch.where(types == 1, 0, -1)
        pos, batch = torch.arange(n), torch.arange(b)[:, None, None, None]
        q, kv = pos[None, None, :, None], pos[None, None, None, :]
        allowed = q.new_zeros((), dtype=torch.bool) | (kv <= q)
        allowed = allowed | ((group[batch, q] == group[batch, kv]) & (group[batch, q] >= 0))
        if self.padding:
            allowed = allowed & attention_mask.bool()[batch, kv]
        mask = torch.where(allowed, torch.zeros((), dtype=x.dtype), MIN)
        qq, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        w = nn.functional.softmax(torch.matmul(qq, k.transpose(-1, -2)) + mask, dim=-1)
        return self.out(torch.matmul(w, v).transpose(1, 2).reshape(b, n, -1))


def test_an_or_mask_with_an_all_false_block_term_is_bucketed_and_exact():
    plans, padded, warned = _run(GitLike(), mask=True)
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    assert padded == 1 and not warned, warned


def test_an_or_mask_whose_block_term_is_all_true_and_unmasked_is_refused():
    plans, padded, _ = _run(GitLike(image=True, padding=False), mask=True)  # every query sees every key: padding too
    assert padded == 0 and "softmax" in plans[0].refused[0], [p.refused for p in plans]


# ---------------------------------------------------------------------------------------------- the real models

pytest.importorskip("transformers")
conformance = bench_conformance()


@pytest.mark.parametrize("family", ["gpt_neo", "openai-gpt", "git"])
def test_real_models_are_bucketed_and_exact(family):
    model = conformance.build_model(family)

    class Call(nn.Module):  # as a tokenizer's output is passed, logits only
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    plans, padded, warned = _run(Call(), mask=True)
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    assert padded == 1 and not warned, warned


def test_scores_plus_a_pure_additive_mask_are_not_pure():
    """``where(causal, 0, min)`` is exactly 0 on its diagonal (pure), so ``.bool()`` of it is the masked-above
    entries; scores plus it are not 0 on the diagonal, so ``.bool()`` of those proves nothing."""
    from graphpass.static_shapes import padding_proof as ps
    from graphpass.static_shapes.padding_proof.nodes import _op_name

    def fn(x):
        pos = torch.arange(x.shape[1])
        mask = torch.where(pos[None, :] <= pos[:, None], torch.zeros(()), torch.finfo(x.dtype).min)
        return mask.bool(), (x @ x.transpose(-1, -2) + mask).bool()

    graphs = []
    torch._dynamo.reset()
    torch.compile(fn, backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True)(torch.randn(2, 7, 3))
    facts = ps.index_provenance(graphs[0])
    pure, summed = [n for n in graphs[0].graph.nodes if _op_name(n) == "bool"]
    assert isinstance(facts.get(pure), ps.MaskedAbove)
    assert facts.get(summed) is None
