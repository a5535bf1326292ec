"""Fixed device memory for the loads recorded into a CUDA graph (:class:`GraphSlots`), reserved at
compile time by the offload pass (through :meth:`OffloadFacts.reserve_graph_slots`) and taken by the
transfer engine (:class:`OffloadRuntime`) while a capture records; and :data:`use_count`, torch's
reference count of a storage (None where torch lacks it: no slot is then ever reused)."""

from __future__ import annotations

import torch


class GraphSlots:
    """Fixed device memory for the loads recorded into a CUDA graph.

    A replay copies into the addresses the capture used, so a load under capture takes one of
    ``count`` slots (``PrefetchWindow.traps``, the traps on the device at once) reserved before any capture, outside every graph's
    memory pool. Slots go round: load j takes the slot load j - count held, which the schedule
    evicted before load j starts (its ``after`` token), and the side stream waits for the compute
    stream before copying, so the copy lands after every reader of the previous occupant. A slot
    some tensor still references (saved for backward, kept by the delegate) is passed over."""

    def __init__(self, device: torch.device, nbytes: int, count: int) -> None:
        self.nbytes = nbytes
        self.storages = [
            torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device).untyped_storage() for _ in range(count)
        ]
        self._next = 0

    @staticmethod
    def layout(recs: list) -> tuple[list[int], int]:
        """Offsets of ``recs`` in one slot (64-byte aligned, so every dtype can view its part) and the total."""
        offsets, total = [], 0
        for rec in recs:
            offsets.append(total)
            total += -(-rec.nbytes // 64) * 64
        return offsets, total

    def take(self, recs: list) -> list | None:
        """Views of a free slot shaped as ``recs``, or None (too small, or every slot referenced)."""
        offsets, total = self.layout(recs)
        if total > self.nbytes or use_count is None:
            return None
        for k in range(len(self.storages)):
            i = (self._next + k) % len(self.storages)
            storage = self.storages[i]
            if use_count(storage) == 1:
                self._next = i + 1
                return [_view(storage, pos, rec) for pos, rec in zip(offsets, recs)]
        return None


def _view(storage, pos: int, rec) -> torch.Tensor:
    stride = torch.empty(rec.shape, dtype=rec.dtype, device="meta").stride()
    out = torch.empty(0, dtype=rec.dtype, device=storage.device)
    return out.set_(storage, pos // rec.dtype.itemsize, rec.shape, stride)


def _storageuse_count():
    fn = getattr(torch._C, "_storage_Use_Count", None)
    return None if fn is None else (lambda storage: fn(storage._cdata))


use_count = _storageuse_count()
