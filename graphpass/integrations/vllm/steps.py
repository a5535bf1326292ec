"""One capture step per vLLM engine step, and per forward of its draft model: its name and meta, from
the model runner's batch.

vLLM runs every request of a step as one flattened batch of tokens (prompt chunks and decode tokens
together). So a step is:

- ``prefill_s{N}_{k}`` when any of its requests is still in its prompt (``N``: the step's tokens,
  all requests together), else ``decode_b{B}_{k}`` (``B``: the requests, one token each);
- its meta: ``req_ids`` (vLLM's request ids, in batch order), ``positions`` (each token's position
  in its request) and ``token_request`` (each token's index into ``req_ids``), so a tensor row can
  be matched to a request and position whatever the batching (docs/vllm.md);
- per request (in ``req_ids`` order): ``prefix_cached``, how many of its first positions vLLM served
  from its prefix cache when it scheduled the request in this step (it computes only the rest, so
  those positions are in no step of the request; :func:`prefix_cached`), and ``parents``, the request
  a parallel-sampling child (``SamplingParams(n=2)``) was forked from (:func:`parent_of`), else None.
"""

from __future__ import annotations

import re
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


def draft_step(
    runner: Any,
    positions: torch.Tensor | None,
    query_starts: torch.Tensor | None,
    target: EngineStep | None,
    draft_pass: int,
) -> EngineStep:
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


def prefix_cached(scheduler_output: Any) -> dict[str, int]:
    """Request id -> how many of its first positions vLLM's scheduler took from the prefix cache (or another KV
    source) instead of computing them, for the requests it schedules in ``scheduler_output`` for the first time
    (``scheduled_new_reqs``) or again after a preemption (``resumed_req_ids``): their ``num_computed_tokens``."""
    out: dict[str, int] = {}
    for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        count = int(getattr(new, "num_computed_tokens", 0) or 0)
        if count:
            out[str(new.req_id)] = count
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    resumed = set(getattr(cached, "resumed_req_ids", None) or ())
    for rid, count in zip(getattr(cached, "req_ids", None) or (), getattr(cached, "num_computed_tokens", None) or ()):
        if rid in resumed and count:
            out[str(rid)] = int(count)
    return out


# vLLM's parallel sampling (``n`` > 1) forks a request into children ``{index}_{request id}``
# (vllm/v1/engine/parallel_sampling.py, ParentRequest.get_child_info), then adds its ``-{8 random}`` suffix
_CHILD = re.compile(r"(\d+)_(.+)")


def parent_of(req_id: str) -> str | None:
    """The caller's request id a parallel-sampling child ``req_id`` (vLLM's internal id) was forked from, without
    vLLM's suffix, as ``compare`` names requests (``"0_14-1a2b3c4d"`` -> ``"14"``); None for any other id."""
    base = req_id.rsplit("-", 1)[0] if "-" in req_id else req_id
    match = _CHILD.fullmatch(base)
    return match.group(2) if match else None
