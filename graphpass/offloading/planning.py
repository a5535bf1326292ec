"""Offload planning (no data moves): which tensors stream, grouped into budget units, and which
units the ``max_device_bytes`` budget keeps resident."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError, OffloadError
from ..fx_utils import inner_tensor_fields, repeated_blocks
from ..tensor_utils import is_wrapper_subclass, local_tensor, wrapper_fields
from ..patterns import check_all_match
from .config import OffloadConfig
from .schedule import PrefetchWindow


@dataclass
class _Tensor:
    """One distinct tensor object of the model and every place it is held."""

    tensor: torch.Tensor
    # (holder, attr name, kind); kind: parameter | buffer | inner:<parent attr>, whose holder is
    # the parent tensor rather than a module
    places: list[tuple[nn.Module | torch.Tensor, str, str]]
    fqns: list[str]
    holders: list[str]  # module FQNs holding it
    streamed: bool = False
    unit: str | None = None
    resident: bool = False

    @property
    def nbytes(self) -> int:
        t = local_tensor(self.tensor)  # a DTensor streams its local shard: this rank's bytes
        if is_wrapper_subclass(t):
            return 0  # its bytes are its inner tensors', each planned as a tensor of its own
        return t.numel() * t.element_size()


@dataclass
class OffloadUnit:
    """A budget unit: one repeated block (or outermost matched module) and its streamed bytes."""

    name: str
    nbytes: int
    transfer: int  # bytes moved per forward if streamed (a tied tensor counts once per unit using it)
    resident: bool = False

    @property
    def saving_per_byte(self) -> float:
        return self.transfer / self.nbytes if self.nbytes else 0.0


@dataclass
class OffloadPlan:
    """The budget decision: which units stay resident, which stream, and the window it keeps free."""

    units: list[OffloadUnit]
    prefetch_distance: int
    max_device_bytes: int | None

    @property
    def resident_bytes(self) -> int:
        return sum(u.nbytes for u in self.units if u.resident)

    @property
    def streamed(self) -> list[OffloadUnit]:
        return [u for u in self.units if not u.resident]

    @property
    def window_bytes(self) -> int:
        streamed = self.streamed
        return PrefetchWindow(self.prefetch_distance).device_bytes(max((u.nbytes for u in streamed), default=0))

    def table(self) -> str:
        from tabulate import tabulate

        rows = [
            (u.name, "resident" if u.resident else "streamed", f"{u.nbytes:,}", f"{u.saving_per_byte:.2f}")
            for u in self.units
        ]
        head = (
            f"budget {self.max_device_bytes:,} bytes"
            if self.max_device_bytes
            else "no budget: everything matched streams"
        )
        foot = (
            f"resident {self.resident_bytes:,} + streaming window {self.window_bytes:,} "
            f"({PrefetchWindow(self.prefetch_distance).traps} traps x largest streamed unit)"
        )
        return (
            f"offload plan ({head})\n"
            + tabulate(rows, headers=("unit", "decision", "bytes", "transfer saved / byte"))
            + "\n"
            + foot
        )


def _repeated_children(model: nn.Module, tensors: list[_Tensor]) -> list[str]:
    """The repeated blocks of ``model`` (:func:`graphpass.fx_utils.repeated_blocks`, the rule the
    default traps use), weighted by the bytes of the tensors each block holds."""
    names = [n for n, _ in model.named_modules() if n]
    _, children = repeated_blocks(names, ((rec.nbytes, rec.holders) for rec in tensors))
    return children


def _collect(model: nn.Module) -> list[_Tensor]:
    seen: dict[int, _Tensor] = {}
    order: list[_Tensor] = []
    for mname, mod in model.named_modules(remove_duplicate=False):
        prefix = mname + "." if mname else ""
        for kind, table in (("parameter", mod._parameters), ("buffer", mod._buffers)):
            for attr, t in table.items():
                if t is None:
                    continue
                rec = seen.get(id(t))
                if rec is None:
                    rec = seen[id(t)] = _Tensor(t, [], [], [])
                    order.append(rec)
                rec.places.append((mod, attr, kind))
                rec.fqns.append(prefix + attr)
                rec.holders.append(mname)
                for field_name, inner in _inner_fields(t):
                    irec = seen.get(id(inner))
                    if irec is None:
                        irec = seen[id(inner)] = _Tensor(inner, [], [], [])
                        order.append(irec)
                    irec.places.append((t, field_name, f"inner:{attr}"))
                    irec.fqns.append(f"{prefix}{attr}.{field_name}")
                    irec.holders.append(mname)
    return order


def _inner_fields(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors a parameter or buffer carries: a wrapper subclass's inner tensors (by its
    ``__tensor_flatten__`` names, private ones included), then plain tensor attributes."""
    fields = wrapper_fields(t) if is_wrapper_subclass(t) else []
    names = {n for n, _ in fields}
    return fields + [(n, v) for n, v in inner_tensor_fields(t) if n not in names]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _units_of(rec: _Tensor, config: OffloadConfig, children: set[str]) -> list[str]:
    """The units (streamed modules) that hold ``rec``, first the one it streams with; ``[]`` when no
    holder is in one, or one is excluded (a tied tensor one excluded module holds stays on the device)."""
    unit_names: list[str] = []
    for holder in rec.holders:
        chain = _ancestors(holder)
        if any(any(p.matches(a) for p in config._exclude) for a in chain):
            return []
        if config._include is None:
            matched = [a for a in chain if a in children]
        else:
            matched = [a for a in chain if any(p.matches(a) for p in config._include)]
        if matched:
            unit_names.append(next((a for a in chain if a in children), matched[0]))
    return list(dict.fromkeys(unit_names))


def plan_units(model: nn.Module, config: OffloadConfig) -> tuple[list[_Tensor], list[OffloadUnit]]:
    """Mark which tensors stream and group them into budget units (no data moves)."""
    names = [n for n, _ in model.named_modules() if n]
    include = config._include
    tensors = _collect(model)
    auto_children: list[str] = []
    if include is None:
        auto_children = _repeated_children(model, tensors)
        if not auto_children:
            raise ConfigError(
                "include_patterns",
                None,
                "the model has no repeated blocks (numbered children) to stream; name the modules",
            )
    else:
        check_all_match(include, names, "include_patterns")
    if config._exclude:
        check_all_match(config._exclude, names, "exclude_patterns")
    children = set(auto_children or _repeated_children(model, tensors))
    units: dict[str, OffloadUnit] = {}
    for rec in tensors:
        unit_names = _units_of(rec, config, children)
        if not unit_names:
            continue
        rec.unit = unit_names[0]
        if rec.nbytes == 0:
            continue  # nothing to move (a wrapper: its inner tensors stream in its place, _check_wrappers)
        rec.streamed = True
        # a tensor several units hold (tied) is streamed once per unit reading it: keeping it
        # resident saves all those loads, so its unit is credited with each of them
        entry = units.setdefault(rec.unit, OffloadUnit(rec.unit, 0, 0))
        entry.nbytes += rec.nbytes
        entry.transfer += rec.nbytes * len(unit_names)
    if not units:
        raise ConfigError("include_patterns", config.include_patterns, "the matched modules hold no tensors to offload")
    _check_wrappers(tensors)
    return tensors, list(units.values())


def _check_wrappers(tensors: list[_Tensor]) -> None:
    """A tensor subclass wrapping plain tensors (torchao's ``Int8Tensor``: ``qdata``, ``scale``,
    ...) streams as its inner tensors, all of them or none (the loads rebuild the wrapper around
    them). Refused by name before the model changes: a wrapper streamed in part (an empty inner
    tensor, or one also held where it stays), or one nesting another wrapper."""
    by_id = {id(r.tensor): r for r in tensors}
    for rec in tensors:
        t = rec.tensor
        if not is_wrapper_subclass(t) or any(p[2].startswith("inner:") for p in rec.places):
            continue  # one nested in another wrapper is checked as part of that one (its fields have no records)
        inner = [(n, by_id[id(v)]) for n, v in wrapper_fields(t)]
        nested = [n for n, r in inner if is_wrapper_subclass(r.tensor)]
        streamed = [n for n, r in inner if r.streamed]
        if not streamed and not (nested and rec.unit is not None):  # nothing of it streams, nor would
            continue
        kept = [n for n, r in inner if not r.streamed and n not in nested]
        if nested or kept:
            why = (
                f"inner tensor {nested[0]!r} is itself a tensor subclass"
                if nested
                else f"inner tensor{'s' if len(kept) > 1 else ''} {', '.join(kept)} would stay where "
                f"{', '.join(streamed)} stream{'s' if len(streamed) == 1 else ''} (empty, or held elsewhere too)"
            )
            raise OffloadError(
                f"{rec.fqns[0]!r} is a tensor subclass, {type(t).__name__}, that offload streams as its inner tensors, all "
                f"of them: {why}; keep it on the device with exclude_patterns=[{rec.holders[0]!r}]"
            )


def plan_budget(units: list[OffloadUnit], config: OffloadConfig) -> OffloadPlan:
    """Keep resident the units that save the most transfer per byte while the streaming window fits."""
    plan = OffloadPlan(units, config.prefetch_distance, config.max_device_bytes)
    budget = config.max_device_bytes
    if budget is None:
        return plan
    largest = max(u.nbytes for u in units)
    need = PrefetchWindow(config.prefetch_distance).device_bytes(largest)
    if budget < need:
        raise ConfigError(
            "max_device_bytes",
            budget,
            f"smaller than the largest trap plus its prefetch: unit {max(units, key=lambda u: u.nbytes).name!r} holds "
            f"{largest:,} bytes and prefetch_distance={config.prefetch_distance} needs {need:,} bytes on the device",
        )
    # Ties keep earlier units: the first trap's load can never be hidden behind compute.
    for u in sorted(units, key=lambda u: -u.saving_per_byte):
        u.resident = True
        if plan.resident_bytes + plan.window_bytes > budget:
            u.resident = False
    return plan
