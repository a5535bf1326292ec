"""Offload: weights live in host memory or on disk and stream to the device one trap ahead of use.

Modules: ``config`` (:class:`OffloadConfig`), ``planning`` (which tensors stream, budget units),
``install`` (:func:`offload`: what it does to the model), ``runtime`` (the per-model transfer
engine and :class:`MemoryStats`), ``ops`` (the ``graphpass::load_start`` / ``load_wait`` /
``evict`` custom ops), ``safetensors_io`` (reading and writing the files). The graph pass that
schedules the ops is :mod:`graphpass.passes.insert_offload_schedule`.
"""

from .config import OffloadConfig
from .install import OffloadState, memory_stats, offload, offload_state
from .planning import OffloadPlan, OffloadUnit
from .runtime import MemoryStats

__all__ = [
    "OffloadConfig",
    "OffloadPlan",
    "OffloadUnit",
    "OffloadState",
    "MemoryStats",
    "offload",
    "offload_state",
    "memory_stats",
]
