"""One capture step per vLLM engine step: its name and meta, from the model runner's batch.

vLLM runs every request of a step as one flattened batch of tokens (prompt chunks and decode tokens
together). So a step is:

- ``prefill_s{N}_{k}`` when any of its requests is still in its prompt (``N``: the step's tokens,
  all requests together), else ``decode_b{B}_{k}`` (``B``: the requests, one token each);
- its meta: ``req_ids`` (vLLM's request ids, in batch order), ``positions`` (each token's position
  in its request) and ``token_request`` (each token's index into ``req_ids``), so a tensor row can
  be matched to a request and position whatever the batching (docs/vllm.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EngineStep:
    """What the runner is about to compute: requests, per-token request index and position, phase."""

    req_ids: list[str]
    token_request: list[int]
    positions: torch.Tensor
    is_prefill: bool


def engine_step(runner: Any, positions: torch.Tensor | None) -> EngineStep:
    """The step of ``runner`` (vLLM's GPU/CPU model runner) inside ``_model_forward``, where
    ``input_batch`` and ``query_start_loc`` describe the scheduled tokens. Tokens past the scheduled
    ones (padding) get request index -1."""
    batch = runner.input_batch
    num_reqs = int(batch.num_reqs)
    req_ids = [str(r) for r in batch.req_ids[:num_reqs]]
    starts = runner.query_start_loc.cpu[: num_reqs + 1].to(torch.long)
    counts = starts[1:] - starts[:-1]
    token_request = torch.repeat_interleave(torch.arange(num_reqs), counts).tolist()
    if positions is None:
        positions = torch.empty(0, dtype=torch.long)
    positions = positions.detach().to("cpu")
    token_request += [-1] * (int(positions.shape[-1]) - len(token_request))
    computed = torch.as_tensor(batch.num_computed_tokens_cpu[:num_reqs])
    prompt = torch.as_tensor(batch.num_prompt_tokens[:num_reqs])
    return EngineStep(req_ids, token_request, positions, bool((computed < prompt).any()))
