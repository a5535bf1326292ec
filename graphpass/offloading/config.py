"""``OffloadConfig``: what :func:`graphpass.offload` streams, from where and how far ahead (validated on creation)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import ConfigError
from ..patterns import ModulePattern, compile_patterns

_STORAGES = ("pinned", "cpu", "disk")


@dataclass(frozen=True)
class OffloadConfig:
    """What :func:`offload` streams, from where, and how far ahead.

    include_patterns: module patterns (shared syntax: ``layers.0-31``, regex); ``None`` streams
        the repeated blocks (the children of the module list holding most parameters).
    exclude_patterns: modules whose tensors stay on ``device`` even under an included module.
    device: where the model computes (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
    storage: ``"pinned"`` (page-locked host memory; needs CUDA), ``"cpu"`` (pageable host memory)
        or ``"disk"`` (safetensors files under ``disk_path``, or the ``checkpoint`` files).
    disk_path: folder for ``storage="disk"`` when the weights are not already in a checkpoint.
    prefetch_distance: how many traps ahead a trap's load starts (0: just before the trap).
    max_device_bytes: device bytes the offloaded tensors may hold at once (resident units plus
        streamed ones in flight); ``None``: stream everything matched.
    """

    include_patterns: Sequence[str] | None = None
    exclude_patterns: Sequence[str] = ()
    device: Any = "cuda"
    storage: str = "pinned"
    disk_path: str | os.PathLike | None = None
    prefetch_distance: int = 1
    max_device_bytes: int | None = None
    _include: tuple[ModulePattern, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _exclude: tuple[ModulePattern, ...] = field(default=(), init=False, repr=False, compare=False)
    _device: torch.device = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        include = None if self.include_patterns is None else compile_patterns(self.include_patterns, "include_patterns")
        if include is not None and not include:
            raise ConfigError(
                "include_patterns",
                self.include_patterns,
                "an empty list offloads nothing; use None for the repeated blocks",
            )
        exclude = compile_patterns(self.exclude_patterns, "exclude_patterns")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError("device", self.device, "not a torch device (e.g. 'cuda', 'cuda:0', 'cpu')") from None
        if device.type == "meta":
            raise ConfigError(
                "device", self.device, "the meta device cannot compute; name the device the model runs on"
            )
        if self.storage not in _STORAGES:
            raise ConfigError("storage", self.storage, f"expected one of {', '.join(map(repr, _STORAGES))}")
        if self.storage == "pinned" and device.type != "cuda":
            raise ConfigError(
                "storage",
                self.storage,
                f"page-locked host memory only helps an accelerator; device is {device}: use storage='cpu'",
            )
        if self.disk_path is not None and not isinstance(self.disk_path, (str, os.PathLike)):
            raise ConfigError("disk_path", self.disk_path, "expected a folder path")
        if self.disk_path is not None and self.storage != "disk":
            raise ConfigError(
                "disk_path", self.disk_path, f"only used with storage='disk' (storage is {self.storage!r})"
            )
        if (
            not isinstance(self.prefetch_distance, int)
            or isinstance(self.prefetch_distance, bool)
            or self.prefetch_distance < 0
        ):
            raise ConfigError("prefetch_distance", self.prefetch_distance, "expected an integer >= 0 (traps ahead)")
        mdb = self.max_device_bytes
        if mdb is not None and (not isinstance(mdb, int) or isinstance(mdb, bool) or mdb <= 0):
            raise ConfigError("max_device_bytes", mdb, "expected a positive number of bytes, or None")
        object.__setattr__(self, "_include", include)
        object.__setattr__(self, "_exclude", exclude)
        object.__setattr__(self, "_device", device)
