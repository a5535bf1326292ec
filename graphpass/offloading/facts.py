"""What :func:`graphpass.offload` and the offload pass decided for one model, read at compile time:
:class:`OffloadFacts`. The transfer engine (:class:`~graphpass.offloading.runtime.OffloadRuntime`:
worker, streams, files, pools, tickets, counters) reads these facts and never holds a decision of
its own; the offload pass reads and records facts here and never touches the engine.

Held by the model's ``OffloadState`` (``state.facts``) and by each offloaded tensor's record
(``OffloadedTensor.facts``), so the pass finds them from the graph's inputs or its roots.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, NamedTuple

import torch

from .. import dynamo_records
from ..errors import OffloadError
from ..fx_utils import relocated
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
    read. Recorded by the offload pass: ``eager_warned`` (modules already warned about),
    ``group_owners`` (a load group's label -> the name of its first tensor when the pass labelled it:
    :meth:`runtime_group`) and ``graph_slots`` (the fixed device slots of loads recorded into CUDA graphs, newest last; older
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
        self.group_owners: dict[str, str] = {}
        self.skips_seen = -1  # dynamo_records.version() when check_skipped_frames last looked
        self._relabelled: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def runtime_group(self, group: str, name: str) -> str:
        """The label of load group ``group`` for the call now running, whose first tensor is ``name``.

        Dynamo runs one compiled frame for every instance of a class (a layer's frame after a graph
        break in it, an MoE's experts), so a graph labelled for ``layers.0`` also loads ``layers.2``:
        the label moves with the tensor, as trap labels do (:func:`graphpass.fx_utils.relocated`)."""
        owner = self.group_owners.get(group)
        if owner is None or owner == name:
            return group
        key = (group, name)
        hit = self._relabelled.get(key)
        if hit is None:
            found = relocated(group, owner, [name])
            hit = self._relabelled[key] = found[0] if len(found) == 1 and found[0] else group
        return hit

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


def check_skipped_frames(facts: OffloadFacts) -> None:
    """A module holding streamed tensors whose forward Dynamo skipped (a graph break inside a loop)
    runs eagerly, outside every graph graphpass schedules: no load serves it, and its pre-hook guard
    ran inside a compiled caller. It reads what the model holds (:func:`runs_eagerly`). Checked when
    a later graph of the model compiles, and by the first load after Dynamo records something new (the
    skip is recorded as the skipped frame first runs, and one compiled frame may serve every instance
    of a class, so no later compile need come): cheap when nothing changed."""
    seen = dynamo_records.version()
    if facts.skips_seen == seen:
        return
    facts.skips_seen = seen
    sites = dynamo_records.skipped_frame_sites()
    if not sites:
        return
    for name, code in facts.guarded_code.items():
        span = code.span
        hit = next((s for s in sites if span and s.file == span[0] and span[1] <= s.line <= span[2]), None)
        if hit is None or name in facts.eager_warned:
            continue
        first = next((line.strip() for line in hit.record.strip().splitlines() if line.strip()), "")
        runs_eagerly(
            facts,
            name,
            f"Dynamo skipped {code.what} ({hit.name} at {hit.file} line {hit.line})",
            f"remove the graph break (Dynamo's record starts: {first!r}; TORCH_LOGS=graph_breaks shows it) "
            f"or move it out of the loop",
        )


def runs_eagerly(facts: OffloadFacts, name: str, why: str, fix: str) -> None:
    """Module ``name`` runs eagerly, outside every graph: with device stand-ins (or a disk region that
    could not be mapped) it reads no weights, so the result would be wrong: refused, naming the module
    and why; with the real bytes (host copies, mapped files) the result is right but nothing streams:
    a warning, once per module."""
    cls = facts.guarded_code[name].cls
    where = (
        f"module {name!r} ({cls}) holds tensors graphpass.offload() streams, and {why}: it runs eagerly, "
        f"outside every graph graphpass schedules"
    )
    todo = f"{fix}, or keep the module on the device with exclude_patterns=[{name!r}]"
    if not facts.eager_reads_real:
        raise OffloadError(
            f"{where}, and reads {facts.stand_ins_are} instead of its weights, so its "
            f"results would be wrong. What to do: {todo}"
        )
    facts.eager_warned.add(name)
    warnings.warn(
        f"graphpass offload: {where}; it reads its weights from host memory directly, so they are not "
        f"streamed (results are right; memory_stats does not count them). To stream them: {todo}",
        UserWarning,
        stacklevel=3,
    )
