"""Helpers of the vLLM leg's tests (tests/in_vllm): a tiny random Llama checkpoint, and serving it with vLLM.

The engine runs in a subprocess (``serve_tiny.py``: vLLM starts its engine core and worker processes
with ``spawn``), once per test module.
"""

import json
import os
import subprocess
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent

# the tiny Llama: head_dim 64 (vLLM's CPU attention supports it), 2 layers, fp32
TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
MAX_NEW_TOKENS = 4
# tensor_parallel_size=2 on vLLM's CPU engine: its automatic thread binding puts each rank on a NUMA node of
# its own and refuses one node for two ranks ("Not enough allowed NUMA nodes to bind threads of 2 local
# CPUWorkers"); bound by hand, one core each
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# vLLM's CPU engine refuses to start unless this fraction of the machine's memory is free at start-up (default
# 0.92: any other load on the machine stops it); the tiny model's KV cache is VLLM_CPU_KVCACHE_SPACE=1 (GiB)
LLM_DEFAULTS = dict(
    skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4, gpu_memory_utilization=0.5
)


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, torch_dtype="float32"))
    model.save_pretrained(path)
    return path


def reference_run(model: Path, out: Path, prompts: list, max_new_tokens: int, modules: list[str]) -> Path:
    """``graphpass reference`` of ``model`` (transformers, no vLLM) for ``prompts`` into ``out / "ref"``: the
    reference a compare across engines reads."""
    from graphpass.cli import main

    (out / "prompts.json").write_text(json.dumps(prompts))
    assert (
        main(
            [
                "reference",
                str(model),
                "--prompts",
                str(out / "prompts.json"),
                "--max-new-tokens",
                str(max_new_tokens),
                "--modules",
                *modules,
                "--out",
                str(out / "ref"),
            ]
        )
        == 0
    )
    return out / "ref"


def serve(
    model: Path,
    out: Path,
    settings: dict,
    prompts=PROMPTS,
    max_new_tokens=MAX_NEW_TOKENS,
    timeout: int = 1200,
    profile_dir: Path | None = None,
    llm_kwargs: dict | None = None,
    env: dict | None = None,
    rounds: list | None = None,
) -> dict:
    """Run ``serve_tiny.py`` (vLLM's ``LLM`` with ``additional_config={"graphpass": settings}`` and
    ``llm_kwargs``; ``env``: more environment variables; ``rounds``: see serve_tiny.py); returns its result (tokens, request ids, worker
    stats)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "settings": settings,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "result": str(out / "result.json"),
        "profile_dir": str(profile_dir) if profile_dir else None,
        "llm_kwargs": llm_kwargs or {},
        "rounds": rounds,
    }
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    env.setdefault("VLLM_CACHE_ROOT", str(out / "vllm-cache"))
    proc = subprocess.run(
        [sys.executable, str(HERE / "serve_tiny.py"), json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    (out / "serve.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"serve_tiny.py failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads((out / "result.json").read_text())
