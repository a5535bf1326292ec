"""Real architectures from transformers (tiny random configs, nothing downloaded) under offload.

Regression: offload of transformers' mixture-of-experts models failed to compile with
"Argument 'out_1' of Node 'evict_default' was used before it has been defined". Their experts are
stacked 3-D parameters; the expert loop takes ``w[e]`` (a view) and multiplies it a few lines
later, after the last op that reads the weight directly. The eviction was placed after that direct
reader while depending on the reader through the view, a node further down the graph.
"""

from __future__ import annotations

import pytest
import torch

import graphpass

transformers = pytest.importorskip("transformers")

MOE = ["mixtral", "qwen3_moe", "olmoe"]


def tiny_moe(model_type: str, seed: int = 0):
    cfg = transformers.CONFIG_MAPPING[model_type](
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return model, torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(seed + 1))


@pytest.mark.parametrize("model_type", MOE)
@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_moe_offload_matches_eager(model_type, storage, tmp_path):
    model, ids = tiny_moe(model_type)
    assert all(p.requires_grad for p in model.parameters())  # as from_pretrained leaves them, disk included
    with torch.no_grad():
        ref = model(ids).logits
    cfg = graphpass.OffloadConfig(device="cpu", storage=storage, disk_path=tmp_path if storage == "disk" else None)
    state = graphpass.offload(model, cfg)
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    with torch.no_grad():
        out = compiled(ids).logits
    assert torch.equal(out, ref)  # fp32, the pass only moves data: exact
    stats = graphpass.memory_stats(model)
    assert stats.groups_loaded == stats.evictions == len(state.plan.units) == model.config.num_hidden_layers
    assert stats.streamed_bytes_now == 0
