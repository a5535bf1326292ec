"""The offload schedule's data and its one prefetch-window rule.

:class:`PrefetchWindow` is the only place the window is worked out: the forward schedule
(``insert_offload_schedule``), its backward mirror (``pin_backward_loads``), the budget planner
(``planning``), the runtime's fixed CUDA-graph slots and FSDP2's streamed blocks (``fsdp2``) all
ask it. :class:`OffloadSchedule` / :class:`LoadGroup` are what the offload pass decided for one
graph, recorded on ``GraphAnalysis.offload`` for reports and goldens. No torch import: this is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefetchWindow:
    """With ``distance`` d, trap k's load is issued where trap k - d begins (the first d + 1 loads
    together, where the graph starts computing), and trap k's wait issues trap k + d's load. At most
    d + 1 traps' tensors are then on the device at once."""

    distance: int

    @property
    def traps(self) -> int:
        """How many traps' tensors the window holds on the device at once."""
        return self.distance + 1

    def issuer(self, k: int) -> int:
        """The position (trap index) where load ``k`` is issued."""
        return max(k - self.distance, 0)

    def issued_at(self, j: int, count: int) -> list[int]:
        """The loads issued at position ``j`` out of ``count`` (in order)."""
        if j == 0:
            return list(range(0, min(self.distance, count - 1) + 1))
        return [j + self.distance] if j + self.distance < count else []

    def ahead(self, k: int, count: int) -> int | None:
        """The load issued by trap ``k``'s wait (``k + d``), None when there is none."""
        return k + self.distance if self.distance and k + self.distance < count else None

    def next_block(self, k: int, count: int, backward: bool = False) -> int | None:
        """FSDP2 (``fsdp2.BlockStream``): the block whose load block ``k``'s ``unshard()`` starts once
        its all-gather has copied its own shards in, out of ``count`` blocks in model order; the
        backward runs them in reverse. A block's shards are evicted right after its all-gather and
        each block keeps at most one load started ahead, so the window reaches the adjacent block
        only: the trap window with its distance capped at 1, ``k + 1`` (``k - 1`` in the backward).
        None at distance 0 (each block loads on demand) or past either end."""
        near = PrefetchWindow(min(self.distance, 1))
        if not backward:
            return near.ahead(k, count)
        mirrored = near.ahead(count - 1 - k, count)  # position in backward order
        return None if mirrored is None else count - 1 - mirrored

    def device_bytes(self, largest: int) -> int:
        """Device bytes the window needs when its largest streamed unit holds ``largest`` bytes."""
        return self.traps * largest


@dataclass
class LoadGroup:
    """The offloaded tensors one trap (or one stretch between traps) reads."""

    label: str  # trap label, or "between:<n>" for the stretch after the n-th trap exit
    placeholders: list = field(default_factory=list)  # placeholder node names, first use first
    fqns: list = field(default_factory=list)
    nbytes: int = 0
    start_before: str = ""  # node the load starts before
    wait_before: str = ""
    evict_after: str = ""


@dataclass
class OffloadSchedule:
    groups: list[LoadGroup]
    prefetch_distance: int
    peak_streamed_bytes: int  # the most streamed bytes the schedule keeps on the device at once
    resident_bytes: int
    max_device_bytes: int | None
