"""Conformance of graphpass on every causal-LM architecture transformers knows, against eager.

Every ``model_type`` in ``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``
is built from a tiny config with random weights (``AutoConfig.for_model`` shrunk: 2 layers, hidden
size 64, 4 experts top-2, ...; no downloads), each in its own subprocess with a timeout, and
checked against eager (fp32, ``model.eval()``, ``torch.no_grad()``, ``use_cache=False``):

| column | what is checked |
|---|---|
| eager | the model builds and runs eagerly (otherwise the row is n/a) |
| traps | ``graphpass.backend(then=DELEGATE)``: logits equal eager's; the trap table (``ExplainReport.trap_rows()``) has a trap for every repeated block (the largest ``ModuleList`` of >= 2 blocks) and each of them ran (``graphpass.trace_traps()``) |
| offload_cpu | ``graphpass.offload(model, OffloadConfig(device="cpu", storage="cpu"))``, compiled: logits equal eager's on two inputs, ``memory_stats`` counted loads |
| offload_disk | the same with ``storage="disk"`` (files under a temporary ``disk_path``) |
| capture | ``ModelCapture(compiled, modules=[block 0, block 1])``, one step: the step folder holds both modules' safetensors files and their tensors equal the eager blocks' outputs (forward hooks) |
| static | ``static_shapes={"dims": {"input_ids": 1}, "buckets": [8, 16]}`` over lengths 5, 7, 12, 14, 6, called as ``model(input_ids=ids, attention_mask=ones, use_cache=False)``: logits equal eager's (padded BLAS may round differently: rtol 1e-5), and, where graphpass bucketed, the delegate compiled at most (buckets + 1) x the graphs of the first call (a refused plan runs with Dynamo's dynamic shapes: its recompilations are Dynamo's). Where graphpass padded to buckets the cell says ``pass (bucketed)``. graphpass refusing to pad (padding not proven safe) with a reason is a pass: the cell says ``pass (refused)`` and the JSON holds the reason; so is graphpass warning that Dynamo skipped the frame taking ``input_ids`` (a graph break in the layer loop: nothing to bucket); ``pass (specialized)``: graphpass warned that Dynamo specialized the length (the model's code makes it a Python int, the source line is in the JSON), as plain torch.compile does |
| generate | (popular subset only) greedy ``generate(max_new_tokens=8)`` with ``model.forward`` compiled: tokens equal eager's |

A row is ``n/a`` only when eager or plain ``torch.compile(backend="aot_eager")`` itself fails on that
config (the reason is printed); plain aot_eager is run for every row with a failing column (a passing row
cannot become n/a) and reported in the JSON.

    python bench/conformance.py --jobs 2                       # every architecture, aot_eager
    python bench/conformance.py --only llama,gpt2 --jobs 1      # a subset
    python bench/conformance.py --after minimax --columns static  # the model types after minimax
    python bench/conformance.py --delegate inductor --only llama,mixtral,...
    python bench/conformance.py --one llama --json-out /tmp/llama.json   # one architecture, in process

Writes ``bench/out/conformance.json`` (``conformance_<delegate>.json`` for another delegate) and a
log per architecture under ``bench/out/conformance_logs/``. ``make conformance`` runs the full set.
The per-architecture check is :func:`check_arch` (``tests/integration/test_conformance.py`` runs it in process).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"

COLUMNS = ("eager", "traps", "offload_cpu", "offload_disk", "capture", "static", "generate")
# rows whose compiles alone take longer than most (the timeout catches hangs, not slow models): zamba's
# four ~1,400-node layer graphs are recompiled by Dynamo for every length of the static column (its plan is
# refused), 270 s for the row on 2 idle cores, twice that on loaded ones
SLOW = {"zamba": 3}
GENERATE_SUBSET = ("llama", "gpt2", "mistral", "qwen2", "qwen3", "gemma", "phi3", "mixtral")
SEQ = 8
BUCKETS = [8, 16]
STATIC_LENGTHS = (5, 7, 12, 14, 6)
# numerics: |compiled - eager| <= ATOL + RTOL * max|eager| (aot_eager in fp32 is normally exact)
TOL = {"aot_eager": (1e-5, 1e-6), "eager": (1e-5, 1e-6), "inductor": (1e-4, 1e-5)}

# ----------------------------------------------------------------------------- tiny configs

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTER = 64
VOCAB = 256
LAYERS = 2
MAX_POS = 128
EXPERTS = 4
TOP_K = 2

# attribute -> value, set whenever the config has the attribute (ints only where it is an int)
EXACT = {
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "n_embd": HIDDEN,
    "n_embed": HIDDEN,
    "embed_dim": HIDDEN,
    "dim": HIDDEN,
    "model_dim": HIDDEN,
    "word_embed_proj_dim": HIDDEN,
    "embedding_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "n_layers": LAYERS,
    "num_layers": LAYERS,
    "decoder_layers": LAYERS,
    "encoder_layers": LAYERS,
    "num_decoder_layers": LAYERS,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "n_heads": HEADS,
    "num_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "encoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "num_kv_heads": KV_HEADS,
    "n_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS,
    "head_dim": HEAD_DIM,
    "attention_head_dim": HEAD_DIM,
    "kv_channels": HEAD_DIM,
    "intermediate_size": INTER,
    "ffn_dim": INTER,
    "n_inner": INTER,
    "decoder_ffn_dim": INTER,
    "encoder_ffn_dim": INTER,
    "ffn_hidden_size": INTER,
    "d_ff": INTER,
    "inner_hidden_size": INTER,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "moe_ffn_hidden_size": 32,
    "shared_intermediate_size": 32,
    "dense_intermediate_size": INTER,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_POS,
    "n_positions": MAX_POS,
    "n_ctx": MAX_POS,
    "max_seq_len": MAX_POS,
    "seq_length": MAX_POS,
    "max_sequence_length": MAX_POS,
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "moe_topk": TOP_K,
    "top_k": TOP_K,
    "moe_k": TOP_K,
    "num_selected_experts": TOP_K,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    "first_k_dense": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 4,
    "attention_window_size": 4,
    "window_size": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "mamba_d_state": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 32,
    "mamba_head_dim": 32,
    "mamba_expand": 2,
    "mamba_d_conv": 4,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 16,
    "state_size": 16,
    "ssm_state_size": 16,
    "chunk_size": 16,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "d_head": HEAD_DIM,
    "n_shared_experts": 1,
    "num_experts_per_token": TOP_K,
    "index_n_heads": HEADS,
    "index_head_dim": HEAD_DIM,
    "index_topk": 4,
    "layer_group_size": LAYERS,
    "num_buckets": 32,
    "rotary_dim": 8,
    "rotary_emb_base": 10000,
}
# per-layer lists (patterns) are cut to LAYERS entries (the first layer and the first of another kind)
PRIMARY_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern", "attn_layers")
# lists of layer indices, remapped to the kept layers
INDEX_LISTS = (
    "hybrid_layer_ids",
    "attn_layer_indices",
    "full_attn_idxs",
    "mlp_only_layers",
    "ple_layer_ids",
    "no_rope_layers_idx",
)
# int attributes left None by the defaults that the model needs (set when present)
SET_IF_NONE = (
    "n_shared_experts",
    "head_dim",
    "num_key_value_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
)
# per-family overrides applied after the generic shrink (top-level config dict)
FAMILY = {
    "reformer": {
        "attn_layers": ["local", "lsh"],
        "axial_pos_shape": [8, 16],
        "axial_pos_embds_dim": [32, 32],
        "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4,
        "num_hashes": 1,
        "is_decoder": True,
        "max_position_embeddings": 128,
    },
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "zamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "num_hidden_layers": 4,
        "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": 2 * HIDDEN // HEADS,
        "n_mamba_heads": 2,
    },
    "zamba2": {
        "attention_hidden_size": 2 * HIDDEN,
        "attention_head_dim": 2 * HIDDEN // HEADS,
        "mamba_headdim": 16,
        "n_mamba_heads": 8,
        "kv_channels": HEAD_DIM,
        "num_query_groups": HEADS,
        "num_key_value_heads": HEADS,
        "adapter_rank": 8,
    },
    # to_dict() lists an "mlp" block after each attention block and doubles the counts (from_dict halves them):
    # plain layer types (no "mlp") are taken as they are
    "dory": {
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "zaya": {"num_experts_per_tok": 1},
    "dots3_note": {"num_key_value_heads": HEADS},
    "dots3_note_text": {"num_key_value_heads": HEADS},
    "bamba": {"attn_layer_indices": [1]},
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1], "block_multiple_of": 16},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "falcon_h1": {"mamba_d_ssm": 128},
    "gemma3n_text": {
        "num_kv_shared_layers": 0,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 16,
        "laurel_rank": 8,
        "altup_num_inputs": 2,
    },
    "kimi_linear": {"linear_head_dim": 16, "linear_num_heads": HEADS, "num_experts_per_token": TOP_K},
    "longcat_flash": {"expert_ffn_hidden_size": 32, "zero_expert_num": 2},
    "xlstm": {
        "num_blocks": LAYERS
    },  # its layer count (num_hidden_layers is only mirrored from it): 32 blocks by default
    "blt": {"local_attention_window_len": 16, "encoder_hash_byte_group_vocab": 512, "patch_size": 2},
}


def _keep_indices(d, n):
    """The layers kept of ``n``: the first, and the first of another kind in a per-layer pattern."""
    for key in PRIMARY_LAYER_LISTS:
        values = d.get(key)
        if isinstance(values, (list, tuple, str)) and len(values) == n:
            other = next((i for i in range(1, n) if values[i] != values[0]), None)
            if other is not None:
                return [0, other]
    if isinstance(d.get("hybrid_layer_ids"), list) and d["hybrid_layer_ids"]:
        return sorted({0, d["hybrid_layer_ids"][0]}) if d["hybrid_layer_ids"][0] else [0, 1]
    return list(range(min(n, LAYERS)))


def _small(key, value):
    """The tiny value for one int (or per-layer list of ints) attribute, or ``value`` unchanged."""
    if isinstance(value, bool):
        return value
    if key in EXACT and isinstance(value, int):
        return EXACT[key]
    if key in EXACT and value is None and key in SET_IF_NONE:
        return EXACT[key]
    if (
        isinstance(value, int)
        and value > 512
        and not key.endswith(("_id", "_ids", "_index"))
        and any(w in key for w in ("size", "dim", "hidden", "width", "channels", "rank", "vocab"))
    ):
        return VOCAB if "vocab" in key else INTER
    return value


def _small_layer_override(o, top):
    """One layer's ``per_layer_config`` entry shrunk; ``top`` is the (not yet shrunk) config it overrides.
    A per-layer head_dim stays larger than the shrunk global one (2 x HEAD_DIM); equalities the
    default holds are kept: kv heads == heads (MLA), head_dim == qk_nope_head_dim + qk_rope_head_dim."""
    out = {k: (2 * HEAD_DIM if k == "head_dim" else _small(k, v)) for k, v in o.items()}
    full = {**top, **o}  # the layer's own values before shrinking
    if "num_key_value_heads" in o and full.get("num_key_value_heads") == full.get("num_attention_heads"):
        out["num_key_value_heads"] = out.get(
            "num_attention_heads", _small("num_attention_heads", top.get("num_attention_heads"))
        )
    parts = ("qk_nope_head_dim", "qk_rope_head_dim")
    if (
        any(k in o for k in parts)
        and all(isinstance(full.get(k), int) for k in parts + ("head_dim",))
        and full["head_dim"] == full["qk_nope_head_dim"] + full["qk_rope_head_dim"]
    ):
        out["head_dim"] = sum(out.get(k, _small(k, top[k])) for k in parts)
    return out


def shrink_dict(d, model_type=None):
    """A config dict (``PretrainedConfig.to_dict()``) shrunk to a tiny model; sub-configs too."""
    d = dict(d)
    for key, value in list(d.items()):
        if isinstance(value, dict) and (
            "model_type" in value or key.endswith("_config") or key in ("decoder", "encoder")
        ):
            d[key] = shrink_dict(value, value.get("model_type"))
    n = next(
        (
            d[k]
            for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
            if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)
        ),
        None,
    )
    keep = _keep_indices(d, n) if n and n > LAYERS else None
    src = dict(d)  # the values before shrinking (a per-layer override is read against them)
    for key, value in list(d.items()):
        if keep and isinstance(value, (list, tuple)) and len(value) == n:
            value = [value[i] for i in keep]
        elif keep and isinstance(value, str) and len(value) == n and key in PRIMARY_LAYER_LISTS:
            value = "".join(value[i] for i in keep)
        elif keep and key in INDEX_LISTS and isinstance(value, list):
            value = [keep.index(i) for i in value if i in keep]
        elif keep and key == "per_layer_config" and isinstance(value, dict):
            value = {
                f"{keep.index(int(i)):02d}": _small_layer_override(o, src) for i, o in value.items() if int(i) in keep
            }
        if isinstance(value, list) and key in EXACT and value and all(isinstance(v, int) for v in value):
            value = [EXACT[key]] * len(value)
        d[key] = _small(key, value)
    if keep:
        for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
            if isinstance(d.get(key), int):
                d[key] = len(keep)
        if d.get("num_kv_shared_layers") == n:  # every layer reuses another's KV (an assistant): still every layer
            d["num_kv_shared_layers"] = len(keep)
    # consistency: multi-head latent attention, mamba2 heads
    if isinstance(d.get("qk_rope_head_dim"), int) and isinstance(d.get("kv_lora_rank"), int):
        if "head_dim" in d:
            d["head_dim"] = d["qk_rope_head_dim"]
        if isinstance(d.get("num_key_value_heads"), int) and isinstance(d.get("num_attention_heads"), int):
            d["num_key_value_heads"] = d["num_attention_heads"]
        if "qk_head_dim" in d:
            d["qk_head_dim"] = d["qk_rope_head_dim"] + d.get("qk_nope_head_dim", 0)
    if model_type == "mamba2" or (
        isinstance(d.get("num_heads"), int)
        and isinstance(d.get("expand"), int)
        and isinstance(d.get("head_dim"), int)
        and "state_size" in d
    ):
        d["num_heads"] = d.get("expand", 2) * d.get("hidden_size", HIDDEN) // d["head_dim"]
    if isinstance(d.get("mamba_n_heads"), int) and isinstance(d.get("mamba_d_head"), int):
        d["mamba_d_head"] = d.get("mamba_expand", 2) * d.get("hidden_size", HIDDEN) // d["mamba_n_heads"]
    if isinstance(d.get("mamba_num_heads"), int) and isinstance(d.get("mamba_head_dim"), int):
        d["mamba_head_dim"] = d.get("expand", 2) * d.get("hidden_size", HIDDEN) // d["mamba_num_heads"]
    # special token ids inside the (shrunk) vocabulary, distinct from each other
    vocab = d.get("vocab_size")
    if isinstance(vocab, int):
        token_keys = sorted(k for k in d if k.endswith(("token_id", "token_index", "token_ids")))
        for i, key in enumerate(token_keys):
            v = d[key]
            if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
                d[key] = vocab - 1 - i
            elif isinstance(v, list):
                d[key] = [x if not isinstance(x, int) or x < vocab else vocab - 1 - i for x in v]
    for key, value in FAMILY.get(model_type or d.get("model_type", ""), {}).items():
        d[key] = value
    d["use_cache"] = False if "use_cache" in d else d.get("use_cache")
    return {k: v for k, v in d.items() if not (k == "use_cache" and v is None)}


def tiny_config(model_type: str):
    """``AutoConfig.for_model(model_type)`` shrunk (2 layers, hidden 64, 4 experts top-2, vocab 256)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    d = shrink_dict(cfg.to_dict(), model_type)
    if "hash_seed" in d:  # reformer's LSH attention draws random rotations per call unless seeded:
        d["hash_seed"] = 0  # eager and any compiled run would differ for lengths past one chunk
    return type(cfg).from_dict(d)


def build_model(model_type: str, seed: int = 0):
    """The tiny model, random weights (seeded), fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.float().eval()
    if hasattr(model, "set_default_language") and getattr(cfg, "languages", None):  # xmod
        model.set_default_language(cfg.languages[0])
    return model


# ----------------------------------------------------------------------------- checks


def _tol(delegate):
    return TOL.get(delegate if isinstance(delegate, str) else "", TOL["inductor"])


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


def _close(got, ref, delegate):
    """(ok, max abs diff) with |got - ref| <= ATOL + RTOL * max|ref|."""
    import torch

    if got.shape != ref.shape:
        return False, float("inf")
    diff = (got.float() - ref.float()).abs().max().item() if got.numel() else 0.0
    rtol, atol = _tol(delegate)
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    return bool(diff <= atol + rtol * scale or torch.equal(got, ref)), diff


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    if line.endswith(":") and len(text) > 1:  # a wrapper (a config validator's error): its cause is on the next line
        line = f"{line} {text[1].strip()}"
    return f"{type(err).__name__}: {line}"[:300]


def _default_config_error(model_type):
    """``(stage, error)``: where eager fails with transformers' default config for ``model_type``
    (``AutoConfig.for_model`` unmodified: full size, so built and run on the meta device) -- stage
    "config", "build" or "forward", the error's first line -- or ``(None, None)`` when it runs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    stage = "config"
    try:
        cfg = AutoConfig.for_model(model_type)
        stage = "build"
        with torch.device("meta"), torch.no_grad():
            model = AutoModelForCausalLM.from_config(cfg).eval()
            stage = "forward"
            model(torch.zeros(1, SEQ, dtype=torch.long), use_cache=False)
    except Exception as err:
        return stage, _first_line(err)
    return None, None


def eager_na_reason(model_type, err):
    """Why a row is n/a when eager fails on the tiny config: the same failure with transformers'
    default config is the model's own (a genuine n/a); otherwise the tiny config is suspect."""
    tiny = _first_line(err)
    stage, default = _default_config_error(model_type)
    if default == tiny:
        return f"eager fails with transformers' default config too: {tiny}"
    if stage is None:
        return f"eager fails on the tiny config only (transformers' default config runs, on the meta device): {tiny}"
    if stage == "forward":  # the meta device cannot run everything (.item()): undecided
        return f"eager fails on the tiny config: {tiny} (transformers' default config builds; its meta-device forward: {default})"
    return f"eager fails: {tiny} (transformers' default config fails too, differently: {default})"


def _tensors(obj):
    """Every tensor in a (nested) module output, in order."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict) or hasattr(obj, "to_tuple"):
        obj = obj.to_tuple() if hasattr(obj, "to_tuple") else list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def repeated_blocks(model, ran=None):
    """FQNs of the repeated blocks: the ``ModuleList`` of >= 2 children holding the most parameters
    (among those whose children all ran, when ``ran`` names the modules an eager forward called:
    a multimodal model's vision tower does not run on token ids)."""
    import torch.nn as nn

    best, best_n = [], -1
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            names = [f"{name}.{i}" if name else str(i) for i in range(len(mod))]
            if ran is not None and not all(n in ran for n in names):
                continue
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = names, n
    return best


def _ran_modules(model, fn):
    """Names of the ModuleList children that ran during ``fn()``."""
    import torch.nn as nn

    ran, hooks = set(), []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList):
            for i, child in enumerate(mod):
                fqn = f"{name}.{i}" if name else str(i)
                hooks.append(child.register_forward_pre_hook(lambda m, a, fqn=fqn: ran.add(fqn)))
    try:
        out = fn()
    finally:
        for h in hooks:
            h.remove()
    return ran, out


def _ids(vocab, n, seed):
    import torch

    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


class _Ctx:
    """What every column needs: the eager model, its vocab, the eager reference logits, the delegate."""

    def __init__(self, model_type, delegate):
        self.model_type, self.delegate = model_type, delegate
        self.model = build_model(model_type)
        self.vocab = self.model.config.get_text_config().vocab_size
        self.ids = _ids(self.vocab, SEQ, 1)
        ran, self.ref = _ran_modules(self.model, lambda: self.forward(self.model, self.ids))
        self.blocks = repeated_blocks(self.model, ran)
        # offload exactly the blocks that run (graphpass's default picks the largest repeated
        # container, which in a multimodal model may be a tower that token ids never reach)
        self.block_container = self.blocks[0].rsplit(".", 1)[0] if self.blocks else None

    def forward(self, model, ids, keyword=False, mask=False):
        import torch

        with torch.no_grad():
            if mask:  # as a tokenizer's output is passed: with the attention mask (its own length symbol)
                return _logits(model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False))
            if keyword:  # static_shapes names the input: transformers' decorated forward hides positional names
                return _logits(model(input_ids=ids, use_cache=False))
            return _logits(model(ids, use_cache=False))

    def fresh(self):
        import torch

        torch._dynamo.reset()
        return copy.deepcopy(self.model)

    def backend(self, **kw):
        import graphpass

        return graphpass.backend(then=self.delegate, **kw)

    def expect_close(self, got, ref, what, info):
        ok, diff = _close(got, ref, self.delegate)
        info.setdefault("max_diff", {})[what] = diff
        if not ok:
            raise AssertionError(f"{what}: max |diff| {diff:.3g} vs eager")


def col_plain(ctx, info):
    """Plain torch.compile(backend='aot_eager'): decides whether a row is n/a."""
    import torch

    model = ctx.fresh()
    got = ctx.forward(torch.compile(model, backend="aot_eager"), ctx.ids)
    ok, diff = _close(got, ctx.ref, "aot_eager")
    info["max_diff"] = diff
    if not ok:
        raise AssertionError(f"aot_eager differs from eager by {diff:.3g}")


def col_traps(ctx, info):
    import torch
    import graphpass

    model = ctx.fresh()
    gp = ctx.backend()
    compiled = torch.compile(model, backend=gp)
    with graphpass.trace_traps() as events:
        got = ctx.forward(compiled, ctx.ids)
    ctx.expect_close(got, ctx.ref, "logits", info)
    rows = graphpass.ExplainReport(graphs=gp.graphs, config=gp.config).trap_rows()
    labels = sorted({r.label for r in rows})
    ran = {label for kind, label in events if kind == "enter"}
    info.update(traps=len(rows), labels=labels[:8], graphs=len(gp.graphs), blocks=ctx.blocks)
    if not ctx.blocks:
        raise AssertionError("no repeated blocks (ModuleList) found in the model")
    # a graph Dynamo shares between blocks (traced from one block's own frame) has its boundaries
    # named at run time after the block that runs: those traps are in ``ran``, not in ``labels``
    missing = [b for b in ctx.blocks if b not in labels and b not in ran]
    if missing:
        raise AssertionError(f"no trap for block(s) {missing[:3]} (traps: {labels[:4]})")
    not_run = [b for b in ctx.blocks if b not in ran]
    if not_run:
        raise AssertionError(f"trap(s) {not_run[:3]} never entered at run time")


def _col_offload(ctx, info, storage):
    import torch
    import graphpass

    model = ctx.fresh()
    with tempfile.TemporaryDirectory(prefix="gp-conf-") as tmp:
        include = [re.escape(ctx.block_container) + r"\.\d+"] if ctx.block_container else None
        info["include_patterns"] = include
        cfg = graphpass.OffloadConfig(
            include_patterns=include, device="cpu", storage=storage, disk_path=tmp if storage == "disk" else None
        )
        state = graphpass.offload(model, cfg)
        info["streamed"] = len(state.records)
        compiled = torch.compile(model, backend=ctx.backend())
        ctx.expect_close(ctx.forward(compiled, ctx.ids), ctx.ref, "logits", info)
        ids2 = _ids(ctx.vocab, SEQ, 2)
        ctx.expect_close(ctx.forward(compiled, ids2), ctx.forward(ctx.model, ids2), "logits2", info)
        stats = graphpass.memory_stats(compiled)
        info.update(bytes_loaded=stats.bytes_loaded, loads_issued=stats.loads_issued, groups_loaded=stats.groups_loaded)
        if not (stats.loads_issued > 0 and stats.bytes_loaded > 0):
            raise AssertionError(f"no loads measured ({stats.loads_issued} loads, {stats.bytes_loaded} bytes)")
        del compiled, model, state
        torch._dynamo.reset()


def col_offload_cpu(ctx, info):
    _col_offload(ctx, info, "cpu")


def col_offload_disk(ctx, info):
    _col_offload(ctx, info, "disk")


def col_capture(ctx, info):
    import torch
    import graphpass
    from safetensors.torch import load_file

    if len(ctx.blocks) < 2:
        raise AssertionError("fewer than two repeated blocks")
    mods = ctx.blocks[:2]
    from torch.utils._pytree import tree_flatten_with_path
    from graphpass.capturing.ops import output_key_path

    eager_out = {}

    def hook(m):
        def fn(mod, args, out):  # each output tensor under its key path (``[0]``, ``.last_hidden_state``)
            named = [
                (output_key_path(out, p), t.detach().clone())
                for p, t in tree_flatten_with_path(out)[0]
                if isinstance(t, torch.Tensor)
            ]
            eager_out.setdefault(m, named)  # returns None: output unchanged

        return fn

    hooks = [dict(ctx.model.named_modules())[m].register_forward_hook(hook(m)) for m in mods]
    try:
        ctx.forward(ctx.model, ctx.ids)
    finally:
        for h in hooks:
            h.remove()
    model = ctx.fresh()
    compiled = torch.compile(model, backend=ctx.backend())
    with tempfile.TemporaryDirectory(prefix="gp-capture-") as tmp:
        cap = graphpass.ModelCapture(compiled, modules=mods, capture_dir=tmp)
        cap.enable()
        with cap.step(is_prefill=True, positions=torch.arange(SEQ), req_ids=["r0"]):
            got = ctx.forward(compiled, ctx.ids)
        ctx.expect_close(got, ctx.ref, "logits", info)
        metas = sorted(Path(tmp).rglob("*_meta.json"))
        if len(metas) != 1:
            raise AssertionError(f"{len(metas)} step folders written")
        step = metas[0].parent
        meta = json.loads(metas[0].read_text())
        info["modules"] = meta.get("modules")
        for m in mods:
            f = step / m / "rank0.safetensors"
            if not f.exists():
                raise AssertionError(f"no capture file for {m} (modules written: {meta.get('modules')})")
            tensors = load_file(str(f))
            want = eager_out.get(m, [])
            info.setdefault("captured", {})[m] = [sorted(tensors), [k for k, _ in want]]
            if not tensors or not want:
                raise AssertionError(f"{m}: {len(tensors)} tensors captured, {len(want)} eager outputs")
            for key, w in want:  # every eager output tensor, under its own name, with its value
                if key not in tensors:
                    raise AssertionError(
                        f"{m}: output {key} {tuple(w.shape)} not captured (file keys {sorted(tensors)[:6]})"
                    )
                ok, d = _close(tensors[key], w, ctx.delegate)
                info.setdefault("max_diff", {})[f"{m}{key}"] = d
                if not ok:
                    raise AssertionError(f"{m}: captured {key} differs from eager's (max |diff| {d:.3g})")


def col_static(ctx, info):
    import torch
    from torch._dynamo.backends.registry import lookup_backend

    calls = []
    inner = lookup_backend(ctx.delegate) if isinstance(ctx.delegate, str) else ctx.delegate

    def counting(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        return inner(gm, example_inputs)

    counting.__name__ = f"counting_{ctx.delegate}"
    model = ctx.fresh()
    import graphpass

    gp = graphpass.backend(then=counting, static_shapes={"dims": {"input_ids": 1}, "buckets": list(BUCKETS)})
    compiled = torch.compile(model, backend=gp)
    first = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in STATIC_LENGTHS:
            ids = _ids(ctx.vocab, n, 10 + n)
            got = ctx.forward(compiled, ids, mask=True)
            if first is None:
                first = len(calls)
            ctx.expect_close(got, ctx.forward(ctx.model, ids, mask=True), f"len{n}", info)
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    active = [g for g in gp.graphs if getattr(g, "runner", None) is not None]
    refused = [r for p in plans for r in (p.refused or [])]
    info.update(
        compiles=len(calls),
        first_call_graphs=first,
        graphs=len(gp.graphs),
        padded=len(active),
        refused=[str(r)[:300] for r in refused[:2]],
        warnings=[str(w.message)[:400] for w in caught if "static_shapes" in str(w.message)][:2],
    )
    limit = max(first or 1, 1) * (len(BUCKETS) + 1)
    if len(calls) > limit and active:  # the bound is a promise of bucketing: a refused plan runs dynamic
        raise AssertionError(f"{len(calls)} delegate compilations > {limit} ((buckets + 1) x {first} graphs)")
    skipped = [
        str(w.message) for w in caught if "static_shapes" in str(w.message) and "skipped a frame" in str(w.message)
    ]
    specialized = [
        str(w.message) for w in caught if "static_shapes" in str(w.message) and "Dynamo specialized" in str(w.message)
    ]
    if active:
        info["state"] = "bucketed"
    elif specialized:  # the model's code makes the length a Python int: Dynamo itself recompiles per length
        info["state"] = "specialized"
        info["refused"] = [specialized[0][:400]]
    elif refused:
        info["state"] = "refused"
    elif skipped:  # Dynamo ran the frame taking input_ids eagerly (a break in the layer loop); graphpass said so
        info["state"] = "refused"
        info["refused"] = [skipped[0][:300]]
    else:
        info["state"] = "no plan"
        raise AssertionError("no bucket plan: the sequence dim was never bucketed (and no refusal)")


def col_generate(ctx, info):
    import torch

    if ctx.model_type not in GENERATE_SUBSET:
        return "skip"
    ids = _ids(ctx.vocab, SEQ, 3)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ctx.model.generate(ids, **kw)
    model = ctx.fresh()
    model.forward = torch.compile(model.forward, backend=ctx.backend())
    with torch.no_grad():
        got = model.generate(ids, **kw)
    info["tokens"] = got[0, SEQ:].tolist()
    if not torch.equal(got, want):
        raise AssertionError(f"tokens differ: {got[0, SEQ:].tolist()} vs eager {want[0, SEQ:].tolist()}")


CHECKS = {
    "traps": col_traps,
    "offload_cpu": col_offload_cpu,
    "offload_disk": col_offload_disk,
    "capture": col_capture,
    "static": col_static,
    "generate": col_generate,
}


def check_arch(model_type: str, delegate: str = "aot_eager", columns=None, progress=None) -> dict:
    """Run every column for one architecture in this process.

    Returns ``{"arch", "delegate", "cells": {column: "pass" | "pass (refused)" | "FAIL: ..." | "n/a: ..." |
    "skip"}, "info": {column: details}, "seconds": {column: s}, "na": reason or None}``. ``progress``
    is called with the partial result after each column (the subprocess writes it out, so a timeout
    still reports how far it got).
    """
    import torch

    torch.set_num_threads(int(os.environ.get("GP_CONF_THREADS", "1")))
    warnings.filterwarnings("ignore")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except Exception:
        pass
    columns = list(columns or CHECKS)
    res = {"arch": model_type, "delegate": delegate, "cells": {}, "info": {}, "seconds": {}, "na": None}
    report = progress or (lambda r: None)
    t0 = time.perf_counter()
    try:
        ctx = _Ctx(model_type, delegate)
        res["cells"]["eager"] = "pass"
        res["info"]["eager"] = {
            "class": type(ctx.model).__name__,
            "params": sum(p.numel() for p in ctx.model.parameters()),
            "blocks": ctx.blocks,
        }
    except Exception as err:
        res["info"]["eager"] = {"traceback": traceback.format_exc()[-2000:]}
        res["na"] = eager_na_reason(model_type, err)
        res["cells"]["eager"] = f"n/a: {res['na']}"
        for col in columns:
            res["cells"][col] = f"n/a: {res['na']}"
        res["seconds"]["eager"] = res["seconds"]["total"] = round(time.perf_counter() - t0, 2)
        report(res)
        return res
    res["seconds"]["eager"] = round(time.perf_counter() - t0, 2)
    report(res)

    def run_col(col):
        fn = col_plain if col == "plain_aot_eager" else CHECKS[col]
        info = {}
        t = time.perf_counter()
        try:
            out = fn(ctx, info)
            cell = "skip" if out == "skip" else "pass"
            if col == "static" and info.get("state") in ("bucketed", "refused", "specialized"):
                cell = f"pass ({info['state']})"
        except Exception as err:
            cell = f"FAIL: {_first_line(err)}"
            info["traceback"] = traceback.format_exc()[-3000:]
            if col == "plain_aot_eager" and not isinstance(err, AssertionError):
                res["na"] = f"plain aot_eager fails: {_first_line(err)}"
        res["cells"][col] = cell
        res["info"][col] = info
        res["seconds"][col] = round(time.perf_counter() - t, 2)
        report(res)

    for col in columns:
        run_col(col)
    # plain aot_eager decides n/a: run only when a column failed (it cannot turn a passing row n/a)
    if any(res["cells"][c].startswith("FAIL") for c in columns):
        run_col("plain_aot_eager")
    else:
        res["cells"]["plain_aot_eager"] = "not run (no failure)"
    if res["na"]:
        for col in columns:
            res["cells"][col] = f"n/a: {res['na']}" if not res["cells"][col].startswith("pass") else res["cells"][col]
    torch._dynamo.reset()
    res["seconds"]["total"] = round(time.perf_counter() - t0, 2)
    report(res)
    return res


# ----------------------------------------------------------------------------- driver


def _table_cell(cell: str, width: int = 70) -> str:
    return cell if len(cell) <= width else cell[: width - 3] + "..."


def _run_one_subprocess(model_type, args, log_dir):
    out = log_dir / f"{model_type}.json"
    log = log_dir / f"{model_type}.log"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        model_type,
        "--json-out",
        str(out),
        "--delegate",
        args.delegate,
        "--columns",
        ",".join(args.columns),
    ]
    env = dict(
        os.environ, GP_CONF_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads), GRAPHPASS_PROGRESS="0"
    )  # its output is a log file: no bars in it
    timeout = int(args.timeout * SLOW.get(model_type, 1))
    t0 = time.perf_counter()
    timed_out = False
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, 9)
            rc = proc.wait()
    res = (
        json.loads(out.read_text())
        if out.exists()
        else {"arch": model_type, "cells": {}, "info": {}, "seconds": {}, "na": None}
    )
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    columns = ["eager"] + args.columns
    if timed_out or rc != 0 or "total" not in res.get("seconds", {}):
        why = f"timeout after {timeout}s" if timed_out else f"process exited {rc}"
        first = True
        for col in columns:
            if col in res["cells"]:
                continue
            if col == "generate" and model_type not in GENERATE_SUBSET:
                res["cells"][col] = "skip"
            else:
                res["cells"][col] = (
                    f"FAIL: {why} (log: {os.path.relpath(log, ROOT)})" if first else f"FAIL: not run ({why})"
                )
                first = False
    return res


def _echo(line: str) -> None:
    """Print ``line`` on stdout; with a live bar (graphpass.progress), above it (tqdm.write redraws the bar)."""
    from graphpass import progress

    if progress.enabled():
        from tqdm.auto import tqdm

        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(line, flush=True)


def run_all(archs, run_one, columns, jobs=1):
    """``run_one(arch)`` for every architecture on ``jobs`` threads; returns ``{arch: result}``. Prints a
    line per architecture as it finishes and, on a terminal (or ``GRAPHPASS_PROGRESS=1``), a bar over
    the architectures on stderr (:func:`graphpass.progress.bar`)."""
    from graphpass import progress

    results = {}
    lock = threading.Lock()
    with progress.bar(len(archs), "graphpass conformance", unit="arch") as shown:

        def job(a):
            r = run_one(a)
            bad = [f"{c}: {r['cells'].get(c)}" for c in columns if r["cells"].get(c, "").startswith(("FAIL", "n/a"))]
            with lock:
                results[a] = r
                _echo(
                    f"[{len(results):3d}/{len(archs)}] {a:28s} {r['wall_s']:6.1f}s  {'ok' if not bad else bad[0][:110]}"
                )
                shown.update(1)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(job, archs))
    return results


def totals(results, columns):
    tot = {}
    for col in columns:
        c = {"pass": 0, "FAIL": 0, "n/a": 0, "skip": 0}
        for r in results:
            cell = r["cells"].get(col, "")
            key = (
                "pass"
                if cell.startswith("pass")
                else "FAIL"
                if cell.startswith("FAIL")
                else "n/a"
                if cell.startswith("n/a")
                else "skip"
            )
            c[key] += 1
        tot[col] = c
    return tot


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", help="run one architecture in this process")
    p.add_argument("--json-out", help="where to write the JSON")
    p.add_argument("--only", help="comma-separated model types (default: the whole causal-LM mapping)")
    p.add_argument(
        "--after",
        help="only the model types after this one in the mapping's (alphabetical) order: "
        "resume a run that stopped there",
    )
    p.add_argument(
        "--delegate", default="aot_eager", help="graphpass then= for every column (aot_eager, inductor, ...)"
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument(
        "--timeout",
        type=int,
        default=None,
        help="seconds per architecture (default 150; 400 for inductor; x SLOW[arch] for the rows listed there)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per subprocess")
    p.add_argument("--columns", default=",".join(CHECKS), help="columns to run")
    p.add_argument("--log-dir", help="per-architecture logs and JSON (default bench/out/conformance_logs[_<delegate>])")
    args = p.parse_args(argv)
    args.columns = [c for c in args.columns.split(",") if c]
    if args.timeout is None:
        args.timeout = 400 if args.delegate == "inductor" else 150
    if args.one:
        out = Path(args.json_out) if args.json_out else None

        def progress(res):
            if out is not None:
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps(res, indent=1, default=str))
                os.replace(tmp, out)

        res = check_arch(args.one, args.delegate, args.columns, progress)
        print(json.dumps({"arch": res["arch"], "cells": res["cells"], "seconds": res["seconds"]}, indent=1))
        return 0

    import torch
    import transformers
    from tabulate import tabulate
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.only:
        archs = [a.strip() for a in args.only.split(",") if a.strip()]
    if args.after:
        if args.after not in archs:
            p.error(f"--after {args.after!r}: not a model type of the causal-LM mapping")
        archs = archs[archs.index(args.after) + 1 :]
    suffix = "" if args.delegate == "aot_eager" else f"_{args.delegate}"
    log_dir = Path(args.log_dir) if args.log_dir else OUT / f"conformance_logs{suffix}"
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = run_all(archs, lambda a: _run_one_subprocess(a, args, log_dir), ["eager"] + args.columns, args.jobs)
    ordered = [results[a] for a in archs]
    columns = ["eager"] + args.columns
    headers = ["arch"] + columns
    rows = [[r["arch"]] + [_table_cell(r["cells"].get(c, "")) for c in columns] for r in ordered]
    table = tabulate(rows, headers=headers, tablefmt="github")
    tot = totals(ordered, columns)
    tot_rows = [[k] + [tot[c][k] for c in columns] for k in ("pass", "FAIL", "n/a", "skip")]
    na_rows = [r for r in ordered if r.get("na")]
    wall = time.perf_counter() - t0
    print()
    print(table)
    print()
    print(tabulate(tot_rows, headers=["total"] + columns, tablefmt="github"))
    print()
    print(f"n/a rows: {len(na_rows)} of {len(ordered)} ({100 * len(na_rows) / max(1, len(ordered)):.1f}%)")
    for r in na_rows:
        print(f"  {r['arch']}: {r['na']}")
    if "static" in columns:
        runnable = [r for r in ordered if not r.get("na")]
        states = {}
        for r in runnable:
            cell = r["cells"].get("static", "")
            states[cell if not cell.startswith("FAIL") else "FAIL"] = states.get(cell, 0) + 1
        bucketed = states.get("pass (bucketed)", 0)
        print(
            f"static column over {len(runnable)} runnable architectures: "
            + ", ".join(f"{k}: {v}" for k, v in sorted(states.items(), key=lambda kv: -kv[1]))
            + f"; bucketed {100 * bucketed / max(1, len(runnable)):.1f} %"
        )
    failing = [r for r in ordered if not r.get("na") and any(r["cells"].get(c, "").startswith("FAIL") for c in columns)]
    print(f"rows with a failing column (not n/a): {len(failing)}")
    print(
        f"delegate {args.delegate}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{len(ordered)} architectures in {wall:.0f}s with --jobs {args.jobs}"
    )
    out = Path(args.json_out) if args.json_out else OUT / f"conformance{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python "
                + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
                "delegate": args.delegate,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "wall_s": round(wall, 1),
                "columns": columns,
                "totals": tot,
                "na": {r["arch"]: r["na"] for r in na_rows},
                "table": table,
                "results": ordered,
            },
            indent=1,
            default=str,
        )
    )
    print(f"wrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
