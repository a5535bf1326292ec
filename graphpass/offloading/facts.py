"""What :func:`graphpass.offload` and the offload pass decided for one model, read at compile time:
:class:`OffloadFacts`. The transfer engine (:class:`~graphpass.offloading.runtime.OffloadRuntime`:
worker, streams, files, pools, tickets, counters) reads these facts and never holds a decision of
its own; the offload pass reads and records facts here and never touches the engine.

Held by the model's ``OffloadState`` (``state.facts``) and by each offloaded tensor's record
(``OffloadedTensor.facts``), so the pass finds them from the graph's inputs or its roots.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from ..errors import OffloadError
from .graph_slots import GraphSlots
from .schedule import PrefetchWindow


class GuardedCode(NamedTuple):
    """Where a module holding streamed tensors runs when Dynamo skips a frame: ``span`` (file, first,
    last line) of ``what``, its forward or, where Dynamo compiles no frame of its own for that
    forward (``own_frame`` False: an inbuilt module on torch 2.9), the forward that calls it."""

    cls: str
    span: tuple | None
    what: str
    own_frame: bool


class OffloadFacts:
    """The compile-time facts of one offloaded model.

    config: its ``OffloadConfig``; device: where it computes; resident_bytes: what the budget keeps
    on the device. Set by ``offload()``: ``guarded_code`` (guarded module name -> its
    :class:`GuardedCode`) and whether the model holds the weights' real bytes (``eager_reads_real``;
    ``stand_ins_are`` says what it holds otherwise): what a frame Dynamo skips, run eagerly, would
    read. Recorded by the offload pass: ``eager_warned`` (modules already warned about) and
    ``graph_slots`` (the fixed device slots of loads recorded into CUDA graphs, newest last; older
    sets serve the graphs recorded with them).
    """

    def __init__(self, config: Any, resident_bytes: int = 0, device: torch.device | None = None) -> None:
        self.config = config  # graphpass.OffloadConfig (frozen; no reference back to the model)
        self.device = device if device is not None else config._device
        self.resident_bytes = resident_bytes
        self.guarded_code: dict[str, GuardedCode] = {}
        self.eager_reads_real = True
        self.stand_ins_are = "the device stand-ins the model holds"  # what it reads when not (the refusal says)
        self.eager_warned: set[str] = set()
        self.graph_slots: list[GraphSlots] = []
        self._lock = threading.Lock()

    @property
    def storage(self) -> str:
        return self.config.storage

    @property
    def window(self) -> PrefetchWindow:
        return PrefetchWindow(self.config.prefetch_distance)

    def reserve_graph_slots(self, groups: list) -> None:
        """Reserve the fixed device slots that loads recorded into a CUDA graph copy into, sized for
        the largest of ``groups`` (lists of records, one per trap load). Called when a graph whose
        delegate records CUDA graphs is compiled, never while a capture runs; a larger need adds a
        new set (graphs captured earlier keep theirs)."""
        need = max((GraphSlots.layout(recs)[1] for recs in groups), default=0)
        with self._lock:
            if self.graph_slots and self.graph_slots[-1].nbytes >= need:
                return
            self.graph_slots.append(GraphSlots(self.device, need, self.window.traps))


def facts_of(obj: Any) -> OffloadFacts | None:
    """The offload facts of a model (or of ``torch.compile`` of it) that ``offload()`` set, or None."""
    state = getattr(getattr(obj, "_orig_mod", obj), "_graphpass_offload", None)
    return getattr(state, "facts", None)


def refuse_unpinned_cuda_graph_loads(recs: list, storage: str, where: str) -> None:
    """The one refusal of loads a CUDA graph would record from memory that is not page-locked: at
    compile time for every load of a graph whose delegate records CUDA graphs, and again for each
    load while a capture records (a capture graphpass was not told of). ``where`` starts the message."""
    unpinned = [r.name for r in recs if storage != "pinned" or r.location is not None or not r.host.is_pinned()]
    if unpinned:
        raise OffloadError(
            f"{where}, and it loads tensors offloaded with storage={storage!r} (first: {unpinned[0]!r}); a recorded "
            f"load copies from page-locked host memory at a fixed address at every replay: offload with "
            f"storage='pinned', or compile without CUDA graphs"
        )
