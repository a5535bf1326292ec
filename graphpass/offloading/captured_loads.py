"""Loads recorded into a CUDA graph: page-locked host copies -> the fixed slots reserved for them
(``graph_slots.py``), on the side stream, forked from and joined into the capture by events."""

from __future__ import annotations

import logging

import torch

from .facts import OffloadFacts, refuse_unpinned_cuda_graph_loads

_log = logging.getLogger("graphpass.offloading.runtime")


def captured_load(recs: list, group: str, facts: OffloadFacts, stream) -> tuple[list, torch.cuda.Event]:
    """Start a load recorded into a CUDA graph on ``stream``: its device tensors and the event that ends it
    (the replay copies again at every step, so a host copy updated between replays is what the next
    replay computes with)."""
    refuse_unpinned_cuda_graph_loads(recs, facts.storage, f"trap {group!r}: a CUDA graph is being recorded")
    device = facts.device
    stream.wait_stream(torch.cuda.current_stream(device))  # after every reader of the slot's last trap
    slots = facts.graph_slots
    dsts = slots[-1].take(recs) if slots else None
    if dsts is None:  # not reserved (a capture graphpass was not told of) or every slot in use
        _log.warning(
            "trap %r: no free fixed slot for a load recorded into a CUDA graph; it uses the graph's own "
            "memory pool (correct, but its memory stays reserved by the graph)",
            group,
        )
        with torch.cuda.stream(stream):
            dsts = [torch.empty(r.shape, dtype=r.dtype, device=device) for r in recs]
    event = torch.cuda.Event()
    with torch.cuda.stream(stream):
        for rec, dst in zip(recs, dsts):
            dst.copy_(rec.host, non_blocking=True)
        event.record(stream)
    return dsts, event
