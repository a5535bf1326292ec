"""The model behind docs/trace.md's pictures: ``graphpass trace graphpass.models.trace_example:compute_bound``.

A stack of MLP blocks (``corpus.MLPStack``, 1024 wide: 16 MiB of float32 weights per block) fed 64
rows: a block's matmuls take longer than copying its weights, so with ``prefetch_distance=1`` the
loads hide under the compute, and with ``prefetch_distance=0`` the compute waits for each of them.
"""

from __future__ import annotations

import torch
from torch import nn

from .corpus import MLPStack

DIM, DEPTH, ROWS = 1024, 6, 64


def compute_bound(seed: int = 0) -> tuple[nn.Module, tuple]:
    """``(model, (x,))``: six blocks, more compute per block than loading its weights takes."""
    torch.manual_seed(seed)
    model = MLPStack(dim=DIM, depth=DEPTH).eval()
    return model, (torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed + 1)),)
