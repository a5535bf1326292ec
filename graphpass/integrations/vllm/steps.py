"""One capture step per vLLM engine step, and per forward of its draft model: its name and meta, from
the model runner's batch.

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


def forward_query_starts() -> torch.Tensor | None:
    """``query_start_loc`` of the attention metadata in vLLM's current forward context (the tokens of each
    request in the batch being run), or None."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # one per micro-batch: vLLM's CPU engine makes one
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):
        metadata = next(iter(metadata.values()), None)
    starts = getattr(metadata, "query_start_loc", None)
    return starts if isinstance(starts, torch.Tensor) else None


def draft_step(runner: Any, positions: torch.Tensor | None, query_starts: torch.Tensor | None,
               target: EngineStep | None, draft_pass: int) -> EngineStep:
    """The step of one forward of the draft model (speculative decoding): its tokens per request from
    ``query_starts`` (:func:`forward_query_starts`; the draft's first pass runs each request's tokens of
    the target step plus its next token, each later pass one token per request), the requests from the
    runner's batch (the drafter keeps its order). It is a prefill when it is the first pass after a
    target prefill step (``target``), else a decode. Tokens past the described ones get request -1."""
    positions = torch.empty(0, dtype=torch.long) if positions is None else positions.detach().to("cpu")
    token_request: list[int] = []
    num_reqs = 0
    if query_starts is not None and query_starts.numel() > 1:
        starts = query_starts.detach().to("cpu", torch.long)
        num_reqs = int(starts.numel()) - 1
        token_request = torch.repeat_interleave(torch.arange(num_reqs), starts[1:] - starts[:-1]).tolist()
    req_ids = [str(r) for r in runner.input_batch.req_ids[:num_reqs]]
    rows = int(positions.shape[-1])
    token_request = token_request[:rows] + [-1] * (rows - len(token_request))
    is_prefill = draft_pass == 0 and target is not None and target.is_prefill
    return EngineStep(req_ids, token_request, positions, is_prefill)
