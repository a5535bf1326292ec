"""``graphpass.offload(model, OffloadConfig(...))``: move the matched weights off the device.

What it does to the model, before anything is compiled:

* every parameter, buffer and inner tensor field (``weight.scale``) held by a module matching
  ``include_patterns`` (and no module matching ``exclude_patterns``) is *streamed*: it is replaced
  by a host tensor (``storage="cpu"``, or page-locked with ``"pinned"``) or, with ``"disk"``, by a
  private mapping of its region of a safetensors file (an untouched stand-in where it cannot map),
  the bytes the loads read per trap;
* with ``max_device_bytes``, the units (repeated blocks) that save the most transfer per byte
  are kept on the device instead, as long as the budget still holds the streaming window
  (``prefetch_distance + 1`` of the largest streamed unit);
* everything else sits on ``device``.

The loads and evictions themselves are scheduled by the graph pass
:mod:`graphpass.passes.insert_offload_schedule` when the model is compiled with
``backend="graphpass"``. Each offloaded module gets a forward pre-hook that calls
``graphpass::offload_guard``: the pass removes that node from graphs it schedules, so the hook
only fires (with a clear error) when the model runs eagerly or under another backend.

With ``checkpoint=`` the model may be built on the ``meta`` device: tensors are read from the
safetensors files (as transformers and accelerate write them), checked against the model first
(names, shapes, dtypes, file sizes), and a streamed tensor with ``storage="disk"`` is read straight
from the checkpoint per trap, so a model larger than RAM is never materialized.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import progress
from ..dynamo_records import code_span, has_compiled_code
from ..errors import ConfigError, OffloadError
from ..tensor_utils import (
    flatten_wrappers,
    is_dtensor,
    is_wrapper_subclass,
    local_tensor,
    unflatten_wrappers,
    with_spec_of,
)
from ..torch_compat import dynamo_compiles_own_frame
from . import files, fsdp2
from .config import OffloadConfig
from .ops import let_wrappers_through
from .planning import OffloadPlan, _Tensor, plan_budget, plan_units
from .facts import GuardedCode, OffloadFacts
from .registry import REGISTRY, OffloadedTensor
from .runtime import MemoryStats, OffloadRuntime
from .safetensors_io import TensorLocation, index_checkpoint, read_header, read_into, write_file

_STORAGES = ("pinned", "cpu", "disk")

# Device stand-ins on a host device: the accelerator path (the model holds one-element expanded
# stand-ins, the loads fill them from the host copies) exercised where no accelerator is. A
# ContextVar, not a module flag: it is per thread / asyncio task and reset on leaving the block, so
# it never leaks into another model offloaded elsewhere by accident.
_DEVICE_STAND_INS: contextvars.ContextVar[bool] = contextvars.ContextVar("graphpass_device_stand_ins", default=False)


@contextlib.contextmanager
def device_stand_ins_on_host() -> Iterator[None]:
    """Within the block, :func:`offload` gives a model on a host device the accelerator path's stand-ins."""
    token = _DEVICE_STAND_INS.set(True)
    try:
        yield
    finally:
        _DEVICE_STAND_INS.reset(token)


# --------------------------------------------------------------------------------------------
# The state attached to an offloaded model
# --------------------------------------------------------------------------------------------


class OffloadState:
    """What :func:`offload` did to one model; ``model._graphpass_offload``."""

    def __init__(self, config: OffloadConfig, plan: OffloadPlan, device: torch.device | None = None) -> None:
        self.config = config
        self.plan = plan
        self.device = device if device is not None else config._device
        self.records: list[OffloadedTensor] = []
        self.facts = OffloadFacts(config, resident_bytes=plan.resident_bytes, device=self.device)  # what the pass reads
        self.runtime = OffloadRuntime(self.facts)  # the transfer engine
        self.files: list[str] = []  # safetensors files graphpass wrote (removed with the state)
        self.hooks: list = []
        self._finalizer = None

    def parameters(self, model: nn.Module | None = None):
        """The parameters to train: the host copies of streamed weights (where their gradients
        accumulate when the model holds device stand-ins) and, given ``model``, its other
        parameters. Build optimizers from this after :func:`offload`."""
        seen: set[int] = set()
        for rec in self.records:
            if rec.location is not None:
                continue  # streamed from a file: nothing to train (a graph that would is refused)
            if isinstance(rec.host, nn.Parameter) and id(rec.host) not in seen:
                seen.add(id(rec.host))
                yield rec.host
        if model is not None:
            handles = {id(r.handle) for r in self.records if r.handle is not None}
            for p in model.parameters():
                if id(p) not in handles and id(p) not in seen:
                    seen.add(id(p))
                    yield p

    @property
    def streamed_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def memory_stats(self) -> MemoryStats:
        return self.runtime.stats()

    def __deepcopy__(self, memo):
        raise _deepcopy_error()

    def __reduce_ex__(self, protocol):
        raise _pickle_error()

    def __repr__(self) -> str:
        return (
            f"OffloadState(storage={self.config.storage!r}, device={str(self.device)!r}, streamed={len(self.records)} tensors "
            f"/ {self.streamed_bytes:,} bytes, resident={self.plan.resident_bytes:,} bytes)"
        )


def _deepcopy_error(module: str = "") -> OffloadError:
    where = f"module {module!r} holds streamed weights and offload hooks; " if module else ""
    return OffloadError(
        "copy.deepcopy of a model offloaded with graphpass.offload() is not supported (the copy would share or "
        f"lose the offload runtime, its files and its streamed weights: {where}model._graphpass_offload): deepcopy the "
        "model before offload() and offload the copy, or build a second instance and offload it"
    )


def _pickle_error(module: str = "") -> OffloadError:
    where = f"module {module!r} holds streamed weights and offload hooks; " if module else ""
    return OffloadError(
        "a model offloaded with graphpass.offload() cannot be pickled or torch.save()d ("
        + where
        + "model._graphpass_offload holds the offload runtime): save model.state_dict() (it returns the real weights) "
        "or save before offload()"
    )


def _refuse_copies(model: nn.Module, streamed: list[_Tensor]) -> None:
    """Pickling (``torch.save``) or deep-copying the model, or a module holding a streamed tensor,
    raises :class:`OffloadError` before anything is copied. Without this, pickle reaches the offload
    hooks (local functions) first and fails with ``AttributeError``. ``Module.__getstate__`` and
    ``__deepcopy__`` are looked up on the instance first, so only these modules change."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    holders = {id(h): h for rec in streamed for h, _, _ in rec.places if isinstance(h, nn.Module)}
    for module in [model, *holders.values()]:
        label = names.get(id(module)) or ""

        def getstate(label=label):
            raise _pickle_error(label)

        def deepcopy(memo, label=label):
            raise _deepcopy_error(label)

        object.__setattr__(module, "__getstate__", getstate)
        object.__setattr__(module, "__deepcopy__", deepcopy)


def _release(runtime: OffloadRuntime, records: list, paths: list) -> None:
    runtime.close()
    for rec in records:
        REGISTRY.remove(rec)
    for f in paths:
        files.untrack(f)
        if not files.written_here(f):  # a child made by fork(): the file is its parent's
            continue
        try:
            os.unlink(f)
        except OSError:
            pass


def _has_compiled_code(model) -> bool:
    return has_compiled_code(model, unknown=False)  # cannot tell: do not block offload


def _copy_plain_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Plain (non-tensor) attributes of a parameter, such as loaders' flags, travel along; inner
    tensor fields are tensors of their own and are placed separately."""
    for k, v in vars(src).items() if hasattr(src, "__dict__") else ():
        if not isinstance(v, torch.Tensor):
            try:
                setattr(dst, k, v)
            except (AttributeError, TypeError):
                pass


def _guard_hook(name: str):
    def hook(module, args):
        # Traced by Dynamo, the op names no module: reading ``name`` would make it a guard (a
        # constant in the graph), and every instance of a class (an MoE's experts) would compile a
        # frame of its own, past recompile_limit. The offload pass reads the module from the node's
        # nn_module_stack. Run eagerly, the op raises and names the module.
        torch.ops.graphpass.offload_guard("" if torch.compiler.is_compiling() else name)

    return hook


@dataclass
class _Placement:
    """Where every changed tensor goes; filled step by step while the model is swapped over.

    ``locations``: the safetensors location of a tensor (by ``id`` of its :class:`_Tensor`), from
    the checkpoint or the file graphpass writes; ``new_values``: the new data of each changed
    tensor; ``disk_tensors``: what graphpass writes to its own file (by first FQN); ``replaced``
    and ``held`` (by ``id`` of the old tensor): the new tensor object (for a streamed one, its
    host copy) and what the model holds (the same, or a device stand-in).
    """

    locations: dict[int, TensorLocation]
    new_values: dict[int, torch.Tensor] = field(default_factory=dict)
    disk_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    replaced: dict[int, torch.Tensor] = field(default_factory=dict)
    held: dict[int, torch.Tensor] = field(default_factory=dict)


def _check_arguments(
    model: nn.Module, config: OffloadConfig | None, kwargs: dict[str, Any]
) -> tuple[OffloadConfig, torch.device]:
    """Check the arguments of :func:`offload`; return the config and the device it resolves to."""
    if config is None:
        config = OffloadConfig(**kwargs)
    elif kwargs:
        raise ConfigError(next(iter(kwargs)), kwargs[next(iter(kwargs))], "pass options in the OffloadConfig, not both")
    if not isinstance(config, OffloadConfig):
        raise ConfigError("config", config, "expected a graphpass.OffloadConfig")
    if not isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__, "graphpass.offload takes an nn.Module")
    if getattr(model, "_graphpass_offload", None) is not None:
        raise OffloadError("this model is already offloaded (graphpass.offload was called on it before)")
    fsdp2.refuse_own_offload(model)  # FSDP2's CPUOffloadPolicy and graphpass.offload() cannot share a shard
    if _has_compiled_code(model):
        raise OffloadError(
            f"{type(model).__name__}.forward was already compiled by torch.compile, and Dynamo would keep running "
            f"that code (which has no loads) after offload(): call torch._dynamo.reset() before graphpass.offload(), "
            f"or offload the model before compiling it"
        )
    device = config._device
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", config.device, "CUDA is not available on this machine")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda" and "cuda:0" are one device
    return config, device


def _plan(model: nn.Module, config: OffloadConfig) -> tuple[list[_Tensor], OffloadPlan, list[_Tensor]]:
    """Plan which tensors stream and which units stay resident; return tensors, plan and the streamed ones."""
    tensors, units = plan_units(model, config)
    plan = plan_budget(units, config)
    resident_units = {u.name for u in units if u.resident}
    for rec in tensors:
        if rec.streamed and rec.unit in resident_units:
            rec.resident = True
    streamed = [r for r in tensors if r.streamed and not r.resident]
    return tensors, plan, streamed


def _check_checkpoint(tensors: list[_Tensor], checkpoint: Any, idents: dict[str, tuple]) -> dict[int, TensorLocation]:
    """Resolve every tensor in ``checkpoint`` and check it against the model; return their locations.
    ``idents`` receives each file's identity (:func:`files.identity`) as it was resolved."""
    locations: dict[int, TensorLocation] = {}
    if checkpoint is not None:
        sharded = next((r.fqns[0] for r in tensors if is_dtensor(r.tensor)), None)
        if sharded is not None:
            raise OffloadError(
                f"tensor {sharded!r} is a DTensor (tensor parallel): checkpoint= holds whole tensors, and reading each "
                f"rank's shard out of them is not supported. Load the checkpoint, parallelize the model, then offload "
                f"it without checkpoint= (storage='disk' writes each rank's own shards to disk_path)"
            )
        index = index_checkpoint(checkpoint)
        for path in dict.fromkeys(loc.path for loc in index.values()):
            try:
                idents[path] = files.identity(os.stat(path))
            except OSError as exc:
                raise OffloadError(f"checkpoint file {path}: {exc}") from None
        missing = []
        for rec in tensors:
            name = next((f for f in rec.fqns if f in index), None)
            if name is None:
                if rec.tensor.device.type == "meta":
                    raise OffloadError(f"tensor {rec.fqns[0]!r} is on the meta device and not in the checkpoint")
                if _needs_checkpoint(rec):
                    missing.append(rec.fqns[0])
                continue
            loc = index[name]
            if tuple(rec.tensor.shape) != loc.shape or rec.tensor.dtype != loc.dtype:
                raise OffloadError(
                    f"tensor {name!r}: the checkpoint has {list(loc.shape)} {loc.dtype}, the model "
                    f"{list(rec.tensor.shape)} {rec.tensor.dtype} ({loc.path})"
                )
            locations[id(rec)] = loc
        if missing:
            _refuse_missing(missing, tensors, checkpoint)
    else:
        meta = [r.fqns[0] for r in tensors if r.tensor.device.type == "meta"]
        if meta:
            raise OffloadError(
                f"tensor {meta[0]!r} is on the meta device: pass checkpoint= (safetensors files) to load it"
            )
    return locations


def _needs_checkpoint(rec: _Tensor) -> bool:
    """A real tensor the checkpoint must hold: a parameter (a wrapper's are its inner tensors) or a
    streamed tensor. A real buffer that is not streamed (a rotary ``inv_freq`` computed at
    construction) may be absent: it is kept."""
    if rec.streamed and not rec.resident:
        return True
    return any(kind == "parameter" for _, _, kind in rec.places) and not is_wrapper_subclass(local_tensor(rec.tensor))


def _refuse_missing(missing: list[str], tensors: list[_Tensor], checkpoint: Any) -> None:
    where = os.fspath(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else [os.fspath(c) for c in checkpoint]
    shown = ", ".join(repr(m) for m in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise OffloadError(
        f"checkpoint {where!r} holds no tensor named {shown} ({len(missing)} of the model's "
        f"{sum(_needs_checkpoint(r) for r in tensors)} parameters and streamed tensors are missing): the model would keep "
        f"its own values for them, silently. Pass the checkpoint of this model (its names as model.state_dict() "
        f"prints them), or offload without checkpoint= to stream the model's own weights"
    )


def _prepare_disk_path(
    config: OffloadConfig, streamed: list[_Tensor], locations: dict[int, TensorLocation]
) -> Path | None:
    """The writable folder for streamed tensors no checkpoint holds (``storage="disk"``), or None."""
    disk_path = None
    if config.storage == "disk":
        need_files = [r for r in streamed if id(r) not in locations]
        if need_files:
            if config.disk_path is None:
                raise ConfigError(
                    "disk_path", None, "storage='disk' needs a folder for the weights (or checkpoint= files)"
                )
            disk_path = Path(config.disk_path)
            try:
                disk_path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError("disk_path", str(disk_path), f"cannot create the folder: {exc}") from None
            if not os.access(disk_path, os.W_OK):
                raise ConfigError("disk_path", str(disk_path), "the folder is not writable")
            files.remove_stale(disk_path)  # files of writers killed before they could remove them
    return disk_path


def _load_value(
    rec: _Tensor, loc: TensorLocation | None, target: torch.device, pin: bool = False, idents: dict | None = None
) -> torch.Tensor:
    """A fresh copy of ``rec``'s data on ``target``, read from ``loc`` when the checkpoint holds it
    (a DTensor's: its local shard)."""
    src = local_tensor(rec.tensor)
    if loc is not None:
        host = torch.empty(loc.shape, dtype=loc.dtype, pin_memory=pin)
        with open(loc.path, "rb") as f:
            if idents and not files.same_file(idents.get(loc.path), files.identity(os.fstat(f.fileno()))):
                raise OffloadError(
                    f"tensor {rec.fqns[0]!r}: checkpoint file {loc.path} changed while offload() read it"
                )
            read_into(f.fileno(), loc, host)
        return host if target.type == "cpu" else host.to(target)
    if target.type == "cpu":
        out = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
        out.copy_(src.detach())
        return out
    return src.detach().to(target, copy=True).contiguous()


def _reading_checkpoint(
    tensors: list[_Tensor], config: OffloadConfig, locations: dict[int, TensorLocation]
) -> Iterator[_Tensor]:
    """``tensors`` one by one, with a bar of the checkpoint bytes :func:`_materialize` reads (on a
    terminal only: :mod:`graphpass.progress`), advanced as each tensor is done. Every tensor the
    checkpoint holds is read, except the streamed ones of ``storage="disk"`` (read per trap)."""
    reads = {
        id(r): locations[id(r)].nbytes
        for r in tensors
        if id(r) in locations and not (config.storage == "disk" and r.streamed and not r.resident)
    }
    if not reads:
        yield from tensors
        return
    with progress.bar(sum(reads.values()), "graphpass offload: reading checkpoint", unit="B", unit_scale=True) as shown:
        for rec in tensors:
            yield rec
            shown.update(reads.get(id(rec), 0))


def _materialize(
    tensors: list[_Tensor],
    config: OffloadConfig,
    device: torch.device,
    locations: dict[int, TensorLocation],
    idents: dict,
) -> _Placement:
    """Build the new value of every tensor that moves, and collect what graphpass writes to disk."""
    placement = _Placement(locations)
    for rec in _reading_checkpoint(tensors, config, locations):
        if rec.streamed and not rec.resident:
            if config.storage == "disk":
                local = local_tensor(rec.tensor)  # a DTensor: this rank's shard goes to this rank's file
                if id(rec) not in locations:
                    placement.disk_tensors[rec.fqns[0]] = local.detach()
                # an untouched stand-in: right shape, dtype and a storage of its own, pages never written
                placement.new_values[id(rec)] = torch.empty(local.shape, dtype=local.dtype)
            else:
                placement.new_values[id(rec)] = _load_value(
                    rec, locations.get(id(rec)), torch.device("cpu"), pin=config.storage == "pinned", idents=idents
                )
        elif rec.tensor.device != device or id(rec) in locations:
            placement.new_values[id(rec)] = _load_value(rec, locations.get(id(rec)), device, idents=idents)
    return placement


def _write_disk_file(
    state: OffloadState, model: nn.Module, disk_path: Path, tensors: list[_Tensor], placement: _Placement
) -> None:
    """Write ``placement.disk_tensors`` to a safetensors file of the state and record their locations."""
    fname = str(disk_path / files.file_name(type(model).__name__))
    files.track(fname)  # before the write: a SIGTERM from here on removes it
    state.files.append(fname)
    write_file(
        fname,
        placement.disk_tensors,
        metadata={"format": "pt", "writer": "graphpass.offload"},
        progress_desc=f"graphpass offload: writing {os.path.basename(fname)}",
    )
    state.runtime.track_file(fname)  # opened now: identity recorded, and a later rename over it is harmless
    written = read_header(fname)
    for rec in tensors:
        if rec.fqns[0] in placement.disk_tensors:
            placement.locations[id(rec)] = written[rec.fqns[0]]


def _map_disk_stand_ins(state: OffloadState, streamed: list[_Tensor], placement: _Placement) -> None:
    """``storage="disk"`` on a host device: the model holds each streamed tensor as a private mapping
    of its file region instead of uninitialized memory. The graphs read the loads, but code Dynamo
    runs eagerly (a frame it skipped: a graph break inside a loop, as in an MoE's expert loop) reads
    the tensor the model holds, and must see its bytes; untouched, a mapping holds no memory either."""
    for rec in streamed:
        loc, value = placement.locations.get(id(rec)), placement.new_values.get(id(rec))
        if loc is not None and value is not None:
            mapped = state.runtime.map_stand_in(loc, value)
            if mapped is not None:  # else (misaligned region, no mmap, no read lease) the empty stand-in stays
                placement.new_values[id(rec)] = mapped
            else:
                state.facts.eager_reads_real = False
                state.facts.stand_ins_are = (
                    f"the empty stand-in the model holds for {rec.fqns[0]!r} (storage='disk': its file region could not "
                    f"be mapped under a read lease of {loc.path}, see docs/reliability.md)"
                )


def _swap_into_model(
    tensors: list[_Tensor], config: OffloadConfig, device: torch.device, placement: _Placement, use_stand_ins: bool
) -> None:
    """Make the new tensor objects, then put them in every place of the model that held an old one."""
    # New objects first, then every place that held an old one. ``replaced``: the new tensor of
    # each changed tensor (for a streamed one, its host copy); ``held``: what the model holds.
    # Dynamo traces the model with tensors on their devices, so on an accelerator a host copy next
    # to device activations would be a device mismatch before graphpass ever sees the graph: there
    # the model holds a stand-in on the device instead, one element expanded to the shape (no
    # memory), which the loads replace; the bytes stay in the host copy (or the file). A stand-in
    # requires grad when the weight does, so autograd reaches the load, whose backward sends the
    # gradient to the host copy (``state.parameters()`` yields those).
    replaced, held = placement.replaced, placement.held
    for rec in tensors:
        new = placement.new_values.get(id(rec))
        if new is None:
            continue
        old = rec.tensor
        streamed_here = rec.streamed and not rec.resident
        local = new  # a DTensor's new value is its local shard, wrapped again with the same spec
        new = with_spec_of(local, old) if is_dtensor(old) else local
        if isinstance(old, nn.Parameter):
            # requires_grad is kept as the model had it (from_pretrained leaves it True), disk included:
            # inference works; a graph that needs the gradient of a disk-streamed weight is refused
            # when it is compiled (graphpass.passes.insert_offload_schedule), naming the tensor.
            new_obj = nn.Parameter(new, requires_grad=old.requires_grad)
        else:
            new_obj = new
        _copy_plain_attributes(old, new_obj)
        replaced[id(old)] = held[id(old)] = new_obj
        if streamed_here and use_stand_ins:
            stand_in = torch.empty(1, dtype=new.dtype, device=device).expand(local.shape)
            stand_in = with_spec_of(stand_in, old) if is_dtensor(old) else stand_in
            if isinstance(new_obj, nn.Parameter):
                stand_in = nn.Parameter(stand_in, requires_grad=new_obj.requires_grad)
                _copy_plain_attributes(old, stand_in)
            held[id(old)] = stand_in
    for rec in tensors:
        value = held.get(id(rec.tensor), rec.tensor)
        for holder, attr, kind in rec.places:
            if kind == "parameter":
                holder._parameters[attr] = value
            elif kind == "buffer":
                holder._buffers[attr] = value
            else:  # an inner field: set it on the parent the module holds now
                setattr(held.get(id(holder), holder), attr, value)


def _register(state: OffloadState, streamed: list[_Tensor], placement: _Placement, use_stand_ins: bool) -> None:
    """Record every streamed tensor in the state (in ``streamed``'s order) and in the global registry the loads look up."""
    for rec in streamed:
        host = local_tensor(placement.replaced[id(rec.tensor)])  # what the loads read: a DTensor's local shard
        r = OffloadedTensor(
            name=rec.fqns[0],
            fqns=tuple(rec.fqns),
            unit=rec.unit or "",
            shape=tuple(host.shape),
            dtype=host.dtype,
            nbytes=rec.nbytes,
            host=host,
            location=placement.locations.get(id(rec)) if state.config.storage == "disk" else None,
            handle=local_tensor(placement.held[id(rec.tensor)]) if use_stand_ins else None,
        )
        r.runtime, r.facts = state.runtime, state.facts
        state.records.append(r)
        REGISTRY.add(r)


def _install_guards(model: nn.Module, state: OffloadState, streamed: list[_Tensor]) -> None:
    """Hook every module holding a streamed tensor: an eager call (or another backend) fails loudly
    instead of reading stand-ins."""
    guarded = dict.fromkeys(h for rec in streamed for h in rec.holders)
    modules = dict(model.named_modules(remove_duplicate=False))
    for name in guarded:
        state.hooks.append(modules[name].register_forward_pre_hook(_guard_hook(name or type(model).__name__)))
        # where the code that runs it eagerly when Dynamo skips a frame of it is (the offload pass checks)
        state.facts.guarded_code[name] = _guarded_code(name, modules)


def _guarded_code(name: str, modules: dict[str, nn.Module]) -> GuardedCode:
    """The module's own forward, or, where Dynamo compiles no frame of its own for that (an inbuilt
    ``torch.nn`` module on torch 2.9), the forward of the nearest enclosing module whose frame it does
    compile, which calls it: a skip there runs it eagerly."""
    cls = type(modules[name])
    if dynamo_compiles_own_frame(cls):
        return GuardedCode(cls.__name__, code_span(cls.forward), "its forward", True)
    parent = name
    while parent:
        parent = parent.rpartition(".")[0]
        if dynamo_compiles_own_frame(type(modules[parent])):
            return GuardedCode(
                cls.__name__,
                code_span(type(modules[parent]).forward),
                f"the forward of {parent or 'the model'!r}, which calls it",
                False,
            )
    return GuardedCode(cls.__name__, None, "its forward", False)


@dataclass(eq=False)
class _WrappedState:
    """A wrapper subclass the model holds (torchao's ``Int8Tensor``) whose inner tensors stream:
    ``inner`` maps its ``__tensor_flatten__`` names to their records (what the state-dict hooks need)."""

    key: torch.Tensor  # the wrapper object the module holds
    inner: dict[str, OffloadedTensor]

    @property
    def location(self) -> TensorLocation | None:
        return next((r.location for r in self.inner.values() if r.location is not None), None)

    @property
    def handle(self) -> torch.Tensor | None:
        return next((r.handle for r in self.inner.values() if r.handle is not None), None)

    def real_value(self) -> torch.Tensor:
        """The wrapper rebuilt around the real inner tensors (read from the file, or behind stand-ins)."""
        flat, metas = flatten_wrappers([self.key])
        names = metas[0][1]
        real = [_real_value(self.inner[n]) if n in self.inner else v for n, v in zip(names, flat)]
        return unflatten_wrappers([r if r is not None else v for r, v in zip(real, flat)], metas)[0]


def _real_value(rec: OffloadedTensor | _WrappedState) -> torch.Tensor | None:
    """What ``state_dict()`` returns for a streamed tensor the model still holds: the host copy behind
    a stand-in, or the bytes read from its file; None when the model holds the real tensor itself."""
    if isinstance(rec, _WrappedState):
        return rec.real_value() if _real_value_is_elsewhere(rec) else None
    if rec.location is not None:
        value = rec.runtime.read_copy(rec)
        return nn.Parameter(value, requires_grad=False) if isinstance(rec.host, nn.Parameter) else value
    return rec.host if rec.handle is not None else None


def _held(module: nn.Module, attr: str, kind: str) -> Any:
    return (module._parameters if kind == "parameter" else module._buffers).get(attr)


def _state_dict_hook(entries: list):
    """Post-hook of ``state_dict()`` on a module holding streamed tensors: put the real weights where
    the module holds a stand-in (a tensor replaced since offload() is the model's own, kept)."""

    def hook(module, state_dict, prefix, local_metadata):
        for attr, kind, rec in entries:
            key = prefix + attr
            held = _held(module, attr, kind)
            if key in state_dict and local_tensor(held) is rec.key:
                value = _real_value(rec)
                if value is not None:
                    value = with_spec_of(local_tensor(value), held) if is_dtensor(held) else value
                    keep_vars = isinstance(state_dict[key], nn.Parameter)
                    if keep_vars and not isinstance(value, nn.Parameter):
                        value = nn.Parameter(value, requires_grad=False)
                    state_dict[key] = value if keep_vars else value.detach()

    return hook


def _load_hook(entries: list):
    """Pre-hook of ``load_state_dict()``: refuse to load into a streamed tensor the module holds as a
    stand-in (disk, or device stand-ins): the copy would land in the stand-in, never in what the
    loads read. With host copies the model holds (storage='cpu'/'pinned' on a host device) the
    in-place copy is what the loads read, and it is let through."""

    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for suffix, holder, attr, kind, rec in entries:
            key = prefix + suffix
            if (
                key in state_dict
                and local_tensor(_held(holder, attr, kind)) is rec.key
                and _real_value_is_elsewhere(rec)
            ):
                where = (
                    f"its bytes live in {rec.location.path}"
                    if rec.location is not None
                    else "the model holds a device stand-in; its bytes live in a host copy"
                )
                raise OffloadError(
                    f"load_state_dict: {key!r} was offloaded by graphpass.offload() ({where}), so the loaded value "
                    f"would never reach the loads. Load the state dict before offload(), or offload a fresh model "
                    f"(checkpoint= reads safetensors files directly)"
                )

    return hook


def _real_value_is_elsewhere(rec: OffloadedTensor | _WrappedState) -> bool:
    return rec.location is not None or rec.handle is not None


def _wrapped_states(tensors: list[_Tensor], streamed: list[_Tensor], records: list[OffloadedTensor]) -> list:
    """``(wrapper's _Tensor, _WrappedState)`` for every wrapper subclass whose inner tensors stream."""
    inner: dict[int, dict[str, OffloadedTensor]] = {}
    for trec, rec in zip(streamed, records):
        for holder, attr, kind in trec.places:
            if kind.startswith("inner:") and is_wrapper_subclass(holder):
                inner.setdefault(id(holder), {})[attr] = rec
    return [(t, _WrappedState(t.tensor, inner[id(t.tensor)])) for t in tensors if id(t.tensor) in inner]


def _install_state_dict_hooks(
    model: nn.Module, state: OffloadState, tensors: list[_Tensor], streamed: list[_Tensor]
) -> None:
    """``state_dict()`` returns the real weights and ``load_state_dict()`` is refused where it would
    be lost: hooks on every module holding a streamed tensor (or a wrapper subclass around streamed
    inner tensors) as a parameter or buffer."""
    by_module: dict[int, tuple[nn.Module, list]] = {}
    names: dict[int, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), []).append(name)
    everything = []  # the root's hook checks the whole state dict first, so a refusal changes nothing
    for trec, rec in [*zip(streamed, state.records), *_wrapped_states(tensors, streamed, state.records)]:
        for holder, attr, kind in trec.places:
            if kind in ("parameter", "buffer") and isinstance(holder, nn.Module):
                by_module.setdefault(id(holder), (holder, []))[1].append((attr, kind, rec))
                everything += [
                    (f"{n}.{attr}" if n else attr, holder, attr, kind, rec) for n in names.get(id(holder), [])
                ]
    for module, entries in by_module.values():
        state.hooks.append(module.register_state_dict_post_hook(_state_dict_hook(entries)))
        state.hooks.append(
            module.register_load_state_dict_pre_hook(_load_hook([(a, module, a, k, r) for a, k, r in entries]))
        )
    state.hooks.append(model.register_load_state_dict_pre_hook(_load_hook(everything)))


def _attach(model: nn.Module, state: OffloadState) -> None:
    """Tie the state's cleanup to its lifetime and attach it to the model."""
    state._finalizer = weakref.finalize(state, _release, state.runtime, list(state.records), list(state.files))
    object.__setattr__(model, "_graphpass_offload", state)


def offload(
    model: nn.Module, config: OffloadConfig | None = None, checkpoint: Any = None, **kwargs: Any
) -> OffloadState:
    """Move ``model``'s matched weights off the device as ``config`` says; returns the state.

    ``checkpoint``: a safetensors file, a list of them, or a folder (with an ``*.index.json`` or
    ``*.safetensors`` files); required when the model is on the ``meta`` device. Everything is
    checked before any tensor of the model is replaced: on error the model is unchanged.
    """
    config, device = _check_arguments(model, config, kwargs)
    tensors, plan, streamed = _plan(model, config)
    # wrapper subclasses (torchao) whose inner tensors stream: the load ops take their inner tensors
    let_wrappers_through(
        {type(h) for r in streamed for h, _, kind in r.places if kind.startswith("inner:") and is_wrapper_subclass(h)}
    )
    use_stand_ins = device.type != "cpu" or _DEVICE_STAND_INS.get()
    sharded = fsdp2.check(model, streamed, device, use_stand_ins)  # FSDP2 shards: refusals before any change
    idents: dict[str, tuple] = {}
    locations = _check_checkpoint(tensors, checkpoint, idents)  # before touching the model
    disk_path = _prepare_disk_path(config, streamed, locations)

    state = OffloadState(config, plan, device)
    try:
        if config.storage == "disk":  # open the streamed files now, checked unchanged since resolved
            for rec in streamed:
                if id(rec) in locations:
                    state.runtime.track_file(locations[id(rec)].path, idents[locations[id(rec)].path], rec.fqns[0])
        # ---- materialize (the model is changed from here on)
        placement = _materialize(tensors, config, device, locations, idents)
        if placement.disk_tensors:
            _write_disk_file(state, model, disk_path, tensors, placement)
        if config.storage == "disk" and not use_stand_ins:
            _map_disk_stand_ins(state, streamed, placement)
        _swap_into_model(tensors, config, device, placement, use_stand_ins)
        _register(state, streamed, placement, use_stand_ins)
        if use_stand_ins:
            state.facts.eager_reads_real = False  # the model holds stand-ins, not the weights
        # FSDP2 shards are loaded where FSDP2 all-gathers them (eagerly, in its unshard), not in a graph
        state.hooks += fsdp2.install(
            sharded, streamed, state.records, device, state.facts.window, config.storage == "disk"
        )
        _install_guards(model, state, [r for r in streamed if id(r) not in sharded])
        _install_state_dict_hooks(model, state, tensors, streamed)
        _refuse_copies(model, streamed)
        _attach(model, state)
    except BaseException:
        _release(state.runtime, state.records, state.files)  # open files closed, a written file removed
        raise
    return state


def offload_state(obj: Any) -> OffloadState | None:
    """The offload state of a model, of ``torch.compile(model)``, or None."""
    model = getattr(obj, "_orig_mod", obj)
    return getattr(model, "_graphpass_offload", None)


def memory_stats(obj: Any, reset: bool = False) -> MemoryStats:
    """Measured offload figures of an offloaded model (or of ``torch.compile`` of it).

    ``reset=True`` returns the figures and starts counting afresh (the peak restarts from what
    is resident now).
    """
    state = offload_state(obj)
    if state is None:
        raise OffloadError(f"{type(obj).__name__} is not offloaded: call graphpass.offload(model, ...) first")
    stats = state.runtime.stats()
    if reset:
        state.runtime.reset_stats()
    return stats
