"""``TensorRegistry``: the tensors one forward captured, in registration order (what ``graphpass::capture`` fills)."""

from __future__ import annotations

from typing import Sequence

import torch

from ..patterns import ModulePattern


class Switch:
    """An on/off flag several registries share (a ``ModelCapture``'s per-context registries)."""

    __slots__ = ("on",)

    def __init__(self, on: bool = True) -> None:
        self.on = bool(on)


class TensorRegistry:
    """Holds the tensors captured during one forward, in registration order.

    ``switch``: share the enabled flag with other registries (``configure`` on one turns all on or
    off); by default each registry has its own.
    """

    def __init__(self, enabled: bool = True, patterns: Sequence[ModulePattern] = (), *,
                 switch: Switch | None = None) -> None:
        self._switch = switch if switch is not None else Switch(enabled)
        self.patterns = tuple(patterns)  # module captures this registry accepts (empty: all)
        self.bucket: int | None = None  # static-shape bucket the captured tensors were padded to
        self._entries: list[tuple[str, torch.Tensor, bool]] = []

    def accepts(self, name: str) -> bool:
        return not self.patterns or any(p.matches(name) for p in self.patterns)

    @property
    def enabled(self) -> bool:
        return self._switch.on

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._switch.on = bool(value)

    def configure(self, enabled: bool = True) -> None:
        self.enabled = bool(enabled)

    def register_module_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if self.enabled:
            self._entries.append((name, tensor, False))

    def register_manual_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if self.enabled:
            self._entries.append((name, tensor, True))

    def get_all_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``[(name, tensor), ...]`` in the order they were registered."""
        return [(n, t) for n, t, _ in self._entries]

    def clear(self) -> None:
        self._entries = []
        self.bucket = None

    def __len__(self) -> int:
        return len(self._entries)
