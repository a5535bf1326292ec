"""``generate()`` through a static-only compiler: prefill buckets plus decode-context buckets
(issue 20, item 2).

A tiny random-weight causal LM (2 layers, hidden 32; no downloads) is offloaded
(``OffloadConfig(device="cpu")``), its ``forward`` compiled with ``graphpass.backend(then=<the strict
stand-in behind NeuronDelegate>, static_shapes=...)``, one decoder layer captured, and greedy
``generate()`` run with a :class:`graphpass.static_shapes.BucketedCache` for 64 prompt lengths (2 .. 65)
x 32 new tokens (Llama; Qwen3, the second family, every fourth length and 65, to keep the test's time). The stand-in, like AWS Neuron, refuses any symbolic size. Checked:

* the tokens equal eager ``generate()``'s (transformers' dynamic cache, no graphpass) for every length;
* the static graphs the stand-in compiled are at most ``len(PREFILL) + len(CONTEXT) + 1``: one per
  prefill bucket, one per decode-context bucket, plus Dynamo's first trace at the first prompt's
  exact size (graphpass buckets from the second length on);
* the stand-in saw prompt lengths only from the prefill buckets (and the first prompt's), and key
  lengths only from the context buckets; every bucketing plan is active (padding proven safe).
"""

import copy

import pytest
import torch

import graphpass
from graphpass.backends import NeuronDelegate

transformers = pytest.importorskip("transformers")
from graphpass.static_shapes import BucketedCache  # noqa: E402

PREFILL = [16, 32, 64, 80]  # static_shapes buckets: the prompt is padded to these
CONTEXT = [32, 64, 96, 128]  # the cache's slots: prompt (+ its padding) + new tokens fit in these
LENGTHS = {
    "llama": list(range(2, 66)),  # 64 prompt lengths
    "qwen3": list(range(2, 66, 4)) + [65],
}  # the second family: 17 of them, over every bucket (test time)
NEW_TOKENS = 32
LAYERS = 2


def _model(family: str):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    common = dict(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
    )  # no early stop: every prompt gets all its new tokens
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common)).eval()


def _compiled(eager, tmp_path):
    model = copy.deepcopy(eager)
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu"))
    delegate = NeuronDelegate(registered_name="strict_aten_standin", module=None)
    gp = graphpass.backend(then=delegate, static_shapes={"dims": {"input_ids": 1}, "buckets": PREFILL})
    model.forward = torch.compile(model.forward, backend=gp)
    capture = graphpass.ModelCapture(model, modules=["model.layers.1"], capture_dir=tmp_path)
    capture.enable()
    return model, gp, capture


def _ops(gm, prefix: str):
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.overloadpacket.__name__.startswith(prefix)
    ]


def _compiled_lengths(strict) -> list[int]:
    """The token count of each static graph of the model the stand-in compiled (graphpass splits each
    at its trap boundaries into pieces; the piece with the embedding stands for the graph)."""
    return [e.meta["val"].shape[1] for gm in strict.graphs for e in _ops(gm, "embedding")]


def _slot_counts(strict) -> set[int]:
    """The slot counts of the key/value buffers the compiled graphs write (``[batch, heads, slots, dim]``)."""
    return {n.args[0].meta["val"].shape[2] for gm in strict.graphs for n in _ops(gm, "index_copy")}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_through_a_static_only_compiler_is_exact_with_bounded_graphs(strict_backend, family, tmp_path):
    # one Dynamo frame holds the prefill graphs (one per cache capacity) and the decode graphs (one
    # per context bucket): more than Dynamo's default of 8 entries per frame
    with torch._dynamo.config.patch(recompile_limit=64):
        _sweep(strict_backend, family, tmp_path)


def _sweep(strict_backend, family, tmp_path):
    eager = _model(family)
    model, gp, capture = _compiled(eager, tmp_path)
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    g = torch.Generator().manual_seed(7)
    lengths = LENGTHS[family]
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(1, 256, (1, n), generator=g)
            want = eager.generate(ids, **kw)
            cache = BucketedCache(model.config, buckets=CONTEXT, prefill_buckets=PREFILL)
            with cache.attach(model), capture.auto_steps():
                got = model.generate(ids, cache=cache, **kw)
            assert torch.equal(got, want), (n, got[0, n:].tolist(), want[0, n:].tolist())
            assert got.shape[1] == n + NEW_TOKENS
            assert cache.length == n + NEW_TOKENS - 1  # the last token is generated, never fed back
    compiled = _compiled_lengths(strict_backend)  # one per static graph of the model
    print(
        f"{family}: {len(lengths)} prompt lengths x {NEW_TOKENS} new tokens, {len(compiled)} static graphs "
        f"(token counts {sorted(compiled)}), bound {len(PREFILL) + len(CONTEXT) + 1}"
    )
    assert len(compiled) <= len(PREFILL) + len(CONTEXT) + 1, compiled
    assert set(compiled) <= set(PREFILL) | {1, lengths[0]}, compiled
    slots = _slot_counts(strict_backend)
    assert slots and slots <= set(CONTEXT), slots
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    assert graphpass.memory_stats(model).loads_issued > 0
    assert len(list((tmp_path / "dp0").iterdir())) == len(lengths) * NEW_TOKENS  # every forward a captured step


def test_bucketed_cache_in_eager_generate_equals_the_dynamic_cache():
    """Without a compiler the cache returns only the filled slots (transformers drops the mask of a
    one-token query outside a compiled region): the same tokens as the dynamic cache."""
    eager = _model("llama")
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    for n in (3, 30):
        ids = torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(n))
        cache = BucketedCache(eager.config, buckets=CONTEXT, prefill_buckets=PREFILL)
        with torch.no_grad(), cache.attach(eager):
            got = eager.generate(ids, cache=cache, **kw)
        assert torch.equal(got, eager.generate(ids, **kw))
        assert cache.layers[0].max_cache_len == {3: 32, 30: 64}[n]  # 3 -> 16 -> 32 slots; 30 -> 32 + 11 -> 64


def test_bucketed_cache_refuses_bad_buckets_and_a_context_beyond_them():
    eager = _model("llama")
    with pytest.raises(graphpass.ConfigError, match="'buckets'.*strictly increasing"):
        BucketedCache(eager.config, buckets=[64, 32])
    with pytest.raises(graphpass.ConfigError, match="'prefill_buckets'"):
        BucketedCache(eager.config, buckets=[64], prefill_buckets=[0])
    cache = BucketedCache(eager.config, buckets=[32], prefill_buckets=[16, 32])
    ids = torch.randint(1, 256, (1, 20))
    with (
        pytest.raises(graphpass.ConfigError, match=r"must hold 33 slots.*add a bucket >= 33"),
        torch.no_grad(),
        cache.attach(eager),
    ):
        eager.generate(ids, cache=cache, max_new_tokens=21, do_sample=False, pad_token_id=0)


def test_bucketed_cache_hooks_stay_eager_under_a_compiled_module():
    """A compiled module (not its forward) would trace the module's hooks: they refuse to run inside a
    trace, so Dynamo runs them eagerly (a graph break) and the cache still holds the true length."""
    eager = _model("llama")
    compiled = torch.compile(eager, backend="eager")
    ids = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    cache = BucketedCache(eager.config, buckets=CONTEXT)
    with torch.no_grad(), cache.attach(eager):
        first = compiled(input_ids=ids, cache=cache).logits
        step = compiled(input_ids=ids[:, :1], cache=cache).logits
    with torch.no_grad():
        want = eager(input_ids=torch.cat([ids, ids[:, :1]], 1)).logits
    assert cache.length == 7
    torch.testing.assert_close(torch.cat([first, step], 1), want, rtol=1e-5, atol=1e-5)
