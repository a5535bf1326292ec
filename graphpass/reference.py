"""``graphpass reference``: a reference run of a transformers checkpoint, eager, fp32, greedy, for
comparing an engine's captures (vLLM, docs/vllm.md) against.

Each prompt (a list of token ids) is one request, run alone: one prefill step, then one decode step
per generated token, each captured in the layout of docs/capture.md
(``OUT/dp0/prefill_s{N}_{k}``, ``OUT/dp0/decode_b1_{k}``), with ``req_ids`` (the prompt's index, as
vLLM's ``LLM.generate`` numbers its requests), ``positions``, ``token_request``, ``input_ids`` (the
token fed at each row) and ``model`` (model type and head sizes) in each meta, as the vLLM plugin
writes them. ``OUT/tokens.json``: the greedy tokens per prompt, in prompt order.

The model is compiled with graphpass and the ``eager`` delegate (capture nodes need a graphpass
graph; the delegate runs the traced aten ops as eager would).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from .capture_format import REFERENCE_ENGINE, EngineStepMeta
from .errors import ConfigError

log = logging.getLogger("graphpass.reference")


def read_prompts(path: str | os.PathLike) -> list[list[int]]:
    """A JSON list of prompts, each a non-empty list of token ids (ints >= 0)."""
    try:
        prompts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError("--prompts", str(path), f"cannot be read as JSON ({err})") from None
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(
            isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
            for p in prompts
        )
    ):
        raise ConfigError("--prompts", str(path), "must hold a non-empty JSON list of non-empty lists of token ids")
    return prompts


def reference_run(
    model_dir: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    modules: Sequence[str],
    out: str | os.PathLike,
) -> list[list[int]]:
    """Run ``prompts`` greedily through the transformers model in ``model_dir``, capturing ``modules``
    into ``out``; writes and returns the tokens (see the module docstring)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", max_new_tokens, "must be an int >= 1")
    import transformers

    from .dynamo_backend import backend
    from .capturing import ModelCapture

    # use_kernels=False: the reference is plain PyTorch (hub kernels would change its numerics), and from
    # transformers 5.25 on, kernels default to on and from_pretrained fails without the optional `kernels` package
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_kernels=False).eval()
    model.forward = torch.compile(model.forward, backend=backend(then="eager"))
    capture = ModelCapture(model, modules=list(modules), capture_dir=out)
    capture.enable()
    vocab = model.config.vocab_size
    from .model_shape import ModelShape

    shape = ModelShape.from_config(model.config).to_meta()
    tokens = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            bad = [t for t in prompt if t >= vocab]
            if bad:
                raise ConfigError(
                    "--prompts", bad[:3], f"token ids of prompt {i} are not below the vocabulary size {vocab}"
                )
            tokens.append(_greedy(model, capture, str(i), list(prompt), max_new_tokens, shape))
    Path(out, "tokens.json").write_text(json.dumps(tokens))
    log.info("reference run: %d prompt(s), %d new tokens each, captures in %s", len(prompts), max_new_tokens, out)
    return tokens


def _greedy(model: Any, capture: Any, req_id: str, prompt: list[int], max_new_tokens: int, shape: dict) -> list[int]:
    """One request: a prefill step, then a decode step per token but the last, each one capture step."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([prompt])
    out: list[int] = []
    for step in range(max_new_tokens):
        start = len(prompt) + len(out) - ids.shape[1]
        positions = torch.arange(start, start + ids.shape[1])
        meta = EngineStepMeta(REFERENCE_ENGINE, [0] * ids.shape[1], model=shape, input_ids=ids[0].tolist()).to_dict()
        with capture.step(positions=positions, is_prefill=step == 0, req_ids=[req_id], extra_meta=meta):
            logits = model(
                input_ids=ids,
                past_key_values=cache,
                use_cache=True,
                cache_position=positions,
                position_ids=positions[None],
            ).logits
        out.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out
