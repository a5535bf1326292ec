"""FSDP2 (``fully_shard``) models under :func:`graphpass.offload`: each rank streams its own shards.

What torch does (2.15). FSDP2's forward and backward hooks (``FSDPState._pre_forward``,
``_post_forward``, ``_pre_backward``) are wrapped in ``torch._dynamo.disable``: Dynamo breaks the
graph around every ``fully_shard``ed module and runs the hooks eagerly. The pre-forward hook calls
``FSDPParamGroup.unshard()``, which reads each parameter's at-rest shard
(``FSDPParam._sharded_param_data``, the local tensor of the sharded DTensor the module holds at
rest), copies it into the all-gather buffer and all-gathers; the copy-out registers the gathered
(unsharded) parameters on the module, and those are the inputs of the block's compiled graph. After
the forward (``reshard_after_forward=True``) the gathered storage is freed again; in the backward
the pre-backward hook unshards the block once more. So no compiled graph ever reads the at-rest
shard, and no graph holds the all-gather: the only point where a rank's shard is read is the
eager ``unshard()``.

The design. The at-rest shard is what graphpass keeps off the device (a host copy, or a file per
rank with ``storage="disk"``), exactly like a tensor-parallel local shard; the module keeps a
DTensor parameter with FSDP2's spec over it, and FSDP2 adopts it as it adopts parameters replaced
by ``load_state_dict(assign=True)`` (``FSDPParam.reset_sharded_param``). Each block's
``unshard()`` is wrapped: when it is about to all-gather, the block's shards are loaded
(``graphpass::load_start`` / ``load_wait``, the same ops and runtime as the graph's loads), handed
to FSDP2 as the all-gather input, and evicted (``graphpass::evict``) as soon as the all-gather has
copied them in; the next block's load is then started (``prefetch_distance >= 1``; the previous
block's in the backward; ``PrefetchWindow.next_block`` in ``schedule.py``), so it runs on the worker
while this block computes. Loads, waits and evictions are therefore ordered with FSDP2's
collectives by construction (load, wait, copy-in and all-gather, evict), the same on every rank,
and at most one block's shards (plus the one in flight ahead) exist outside their home at once.
The compiled graphs themselves are unchanged: their inputs are the gathered parameters FSDP2 owns
and frees. A load started ahead is used only for the
pass it was started for and while the host copies it read keep the versions they had
(``Tensor._version``): a block skipped in the pass that started its load (an early exit), whose weights
are then updated in place (an optimizer step, ``load_state_dict``), is loaded again. (A write through
``.data`` bypasses the version counter and is not seen.)

Refused (``OffloadError``, before the model is touched): FSDP2's own CPU offload
(``offload_policy=CPUOffloadPolicy()``: both would own the shard's host copy), a device other than
the host (the gradients FSDP2 reduce-scatters would land next to a host copy; not implemented),
a shard FSDP2 pads (uneven dim-0 sharding), a one-rank shard group and all-gather extensions
(``fsdp_pre_all_gather``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import OffloadError
from ..tensor_utils import fsdp_param_groups
from .schedule import PrefetchWindow


@dataclass(eq=False)
class Managed:
    """An FSDP2 parameter: its ``FSDPParam``, its param group, the ``fully_shard`` module's FQN and its own."""

    param: Any
    group: Any
    label: str
    fqn: str


def managed_parameters(model: nn.Module) -> dict[int, Managed]:
    """id(sharded parameter the model holds at rest) -> its FSDP2 records, for every ``fully_shard`` module."""
    out: dict[int, Managed] = {}
    seen: set[int] = set()
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for name, module in model.named_modules():
        for group in fsdp_param_groups(module):
            if id(group) in seen:
                continue
            seen.add(id(group))
            for fp in group.fsdp_params:
                holder = names.get(id(fp._module_info.module), "")
                fqn = f"{holder}.{fp._module_info.param_name}" if holder else fp._module_info.param_name
                out[id(fp.sharded_param)] = Managed(fp, group, name or type(model).__name__, fqn)
    return out


def _both_offloads(name: str, label: str) -> str:
    return (
        f"tensor {name!r} is sharded by FSDP2 (fully_shard of {label!r}) with its own CPU offload "
        f"(offload_policy=CPUOffloadPolicy()), and graphpass.offload() would move the same shard: the two "
        f"cannot both own it. Use one of them: fully_shard without offload_policy, then graphpass.offload() "
        f"(streams each rank's shards from host memory or disk per block), or CPUOffloadPolicy without graphpass.offload()"
    )


def _refusal(entry: Managed, name: str, device: torch.device, stand_ins: bool) -> str | None:
    """Why this FSDP2 parameter cannot be streamed, or None."""
    fp, label = entry.param, entry.label
    if getattr(fp, "offload_to_cpu", False):
        return _both_offloads(name, label)
    if device.type != "cpu" or stand_ins:
        return (
            f"tensor {name!r} is sharded by FSDP2 (fully_shard of {label!r}): graphpass.offload() streams FSDP2 "
            f"shards on a host device (device='cpu') only; on {device.type!r} FSDP2 would reduce-scatter the "
            f"gradients next to a host copy. Use fully_shard(..., offload_policy=CPUOffloadPolicy()) there"
        )
    world = getattr(fp.mesh_info, "shard_mesh_size", 1)  # DDP-style replication (no shard dim): 1
    if world < 2:
        return (
            f"tensor {name!r}: FSDP2 (fully_shard of {label!r}) shards it over {world} rank(s), so it is not "
            f"sharded; graphpass.offload() streams FSDP2 shards over two or more ranks"
        )
    if tuple(fp.sharded_size) != tuple(fp.padded_sharded_param_size):
        return (
            f"tensor {name!r}: FSDP2 (fully_shard of {label!r}) pads this rank's shard "
            f"({list(fp.sharded_size)} padded to {list(fp.padded_sharded_param_size)}: dim 0 does not divide "
            f"over {world} ranks); graphpass.offload() streams evenly sharded FSDP2 parameters only"
        )
    if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
        return (
            f"tensor {name!r}: its FSDP2 shard is a tensor subclass with fsdp_pre_all_gather (an all-gather "
            f"extension, e.g. float8), which graphpass.offload() does not stream"
        )
    return None


def check(model: nn.Module, streamed: list, device: torch.device, stand_ins: bool) -> dict[int, Managed]:
    """The FSDP2 records of every streamed tensor FSDP2 manages (by id of the planning record);
    refuses, before anything changes, what cannot be streamed."""
    managed = managed_parameters(model)
    found: dict[int, Managed] = {}
    if not managed:
        return found
    for rec in streamed:
        entry = managed.get(id(rec.tensor))
        if entry is None:
            continue
        why = _refusal(entry, rec.fqns[0], device, stand_ins)
        if why is not None:
            raise OffloadError(why)
        found[id(rec)] = entry
    return found


def refuse_own_offload(model: nn.Module) -> None:
    """Refuse a model FSDP2 offloads itself (CPUOffloadPolicy), whatever the patterns select."""
    for entry in managed_parameters(model).values():
        if getattr(entry.param, "offload_to_cpu", False):
            raise OffloadError(_both_offloads(entry.fqn, entry.label))


# --------------------------------------------------------------------------------------------
# Streaming: the shards are loaded where FSDP2 all-gathers them
# --------------------------------------------------------------------------------------------


class _Removable:
    """Takes a wrapped ``unshard`` off its param group again (kept with the state's hooks)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def remove(self) -> None:
        self.group.__dict__.pop("unshard", None)


class BlockStream:
    """One FSDP2 param group's streamed shards: loads them for its all-gather, evicts them after.

    ``srcs`` are the host tensors the loads read (the records' keys), ``params`` their FSDPParams
    in the same order. ``order`` is the list of every streamed group's stream in model order;
    ``window`` says which of them has its load started ahead (``PrefetchWindow.next_block``).
    Holds no reference to the offload state: the ops find the runtime from ``srcs``.
    """

    def __init__(
        self,
        group: Any,
        label: str,
        params: list,
        srcs: list,
        device: torch.device,
        order: list,
        window: PrefetchWindow,
        disk: bool,
    ) -> None:
        self.group, self.label, self.params, self.srcs = group, label, params, srcs
        self.device, self.order, self.window, self.disk = device, order, window, disk
        self.orig = group.unshard  # the bound method of the group's class
        # (for the backward?, ticket, versions of srcs when it started) of a load started early
        self.ahead: tuple[bool, torch.Tensor, tuple[int, ...]] | None = None

    def _backward(self) -> bool:
        """Whether FSDP2 runs this group's backward now (its pre-backward unshard)."""
        return getattr(getattr(self.group, "_training_state", None), "name", "") == "PRE_BACKWARD"

    def _gathers(self) -> bool:
        """Whether this ``unshard()`` all-gathers (FSDP2 returns early when it would not)."""
        g = self.group
        if getattr(g, "_all_gather_result", None) is not None or g.is_unsharded:
            return False
        if not getattr(g, "unshard_in_backward", True) and self._backward():
            return False
        return all(getattr(fp.sharded_state, "name", "") == "SHARDED" for fp in self.params)

    def _start(self) -> torch.Tensor:
        return torch.ops.graphpass.load_start(self.srcs, self.label, self.device, [])

    def _versions(self) -> tuple[int, ...]:
        """The version counters of the host copies the loads read and of the sharded parameters over
        them: an in-place write bumps one of them (one through the DTensor, an optimizer step or
        ``load_state_dict``, bumps the DTensor's own counter, not its local tensor's)."""
        return tuple(s._version for s in self.srcs) + tuple(fp.sharded_param._version for fp in self.params)

    def _loaded(self) -> list[torch.Tensor]:
        ahead, self.ahead = self.ahead, None
        usable = ahead is not None and ahead[0] == self._backward() and ahead[2] == self._versions()
        ticket = ahead[1] if usable else None
        # dropped with its ticket: a load started for the other pass (forward vs backward), or one
        # whose host copies were written since it started (the block was skipped in the pass that
        # started it, and an optimizer step or load_state_dict changed it before this one)
        del ahead
        if ticket is None:
            ticket = self._start()
        return torch.ops.graphpass.load_wait(ticket, self.srcs, self.label, self.device, [])

    def _start_neighbour(self) -> None:
        j = self.window.next_block(self.order.index(self), len(self.order), backward=self._backward())
        if j is not None:
            other = self.order[j]
            if other.ahead is None and not other.group.is_unsharded:
                other.ahead = (self._backward(), other._start(), other._versions())

    def unshard(self, async_op: bool = False) -> Any:
        if not self._gathers():
            return self.orig(async_op)
        if self.disk and self._backward():
            raise OffloadError(
                f"FSDP2 block {self.label!r} streams its shards from disk (storage='disk'), which serves inference "
                f"only: its backward would compute gradients for weights whose bytes live in a file. Run it under "
                f"torch.no_grad(), or offload with storage='cpu' to train"
            )
        with torch.no_grad():
            loaded = self._loaded()
            # the all-gather inputs FSDP2 copies in (a helper: no loop variable outlives the eviction)
            saved = _hand_over(self.params, [t.view(-1) for t in loaded])
            try:
                result = self.orig(async_op)
            finally:
                _hand_over(self.params, saved)
                torch.ops.graphpass.evict(loaded, self.srcs, self.label, [])
                del loaded  # the last reference: the memory goes back before the next load starts
            self._start_neighbour()
        return result


def _hand_over(params: list, data: list) -> list:
    """Set each FSDPParam's at-rest data (what its all-gather reads); returns what they held."""
    saved = [fp._sharded_param_data for fp in params]
    for fp, d in zip(params, data):
        fp._sharded_param_data = d
    return saved


def install(
    managed: dict[int, Managed], streamed: list, records: list, device: torch.device, window: PrefetchWindow, disk: bool
) -> list[_Removable]:
    """Hand FSDP2 the new at-rest parameters and wrap the ``unshard()`` of every group that holds
    streamed shards. ``streamed`` and ``records`` are parallel (planning record, OffloadedTensor);
    ``window`` is the model's prefetch window (``OffloadFacts.window``)."""
    per_group: dict[int, tuple[Any, str, list, list]] = {}
    for trec, rec in zip(streamed, records):
        entry = managed.get(id(trec))
        if entry is None:
            continue
        fp = entry.param
        fp.reset_sharded_param()  # FSDP2 adopts the parameter the module holds now (as after assign=True)
        if fp._sharded_param_data.untyped_storage().data_ptr() != rec.key.untyped_storage().data_ptr():
            raise OffloadError(
                f"tensor {rec.name!r}: FSDP2 did not adopt the offloaded shard (FSDP2 internals of "
                f"another torch release?)"
            )
        per_group.setdefault(id(entry.group), (entry.group, entry.label, [], []))
        per_group[id(entry.group)][2].append(fp)
        per_group[id(entry.group)][3].append(rec.key)
    order: list[BlockStream] = []
    for group, label, params, srcs in per_group.values():
        order.append(BlockStream(group, label, params, srcs, device, order, window, disk))
    handles = []
    for stream in order:
        stream.group.unshard = stream.unshard  # an instance attribute: FSDP2 calls self.unshard()
        handles.append(_Removable(stream.group))
    return handles
