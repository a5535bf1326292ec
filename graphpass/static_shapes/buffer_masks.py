"""Causal masks read from a tensor the graph takes as an input (a module buffer), proven on its values.

GPT-Neo (and GPT-2-era code in general) keeps its causal mask as a boolean buffer registered on the attention
module, ``tril(ones(P, P))`` viewed ``[1, 1, P, P]`` (local layers: the band ``tril(ones) ^ tril(ones, -window)``),
and slices it per call: ``self.bias[:, :, k - q : k, :k]``, which with no cache is ``[:, :, 0:L, :L]``. Its shape
says nothing about causality; its values do. Under ``torch.compile`` a module's buffers reach the backend as
graph inputs, so the tensor itself is at hand when the padding-safety analysis runs.

:func:`is_causal_table` checks, on the actual values, that a boolean tensor is false above the diagonal of its last
two dims and true on it, over its whole extent. Then every slice of it that starts at row 0 and column 0 (a prefix
slice keeps each index where it was) is true only where key ``j <= `` query ``i`` and true at ``j == i``: the
:class:`~graphpass.static_shapes.padding_safety._Causal` fact (with ``diag`` proven, needing no input) that
``transformers``' own ``kv_idx <= q_idx`` masks get, so the existing proofs take it from there
(``where(mask, scores, finfo.min)``, the softmax, the product with the values).

The proof is about the values the tensor holds when the graph is planned. A buffer can be written in place later
(or replaced by another tensor of the same shape: Dynamo does not guard on a module input's values), so the plan
records each buffer it read (:class:`CausalTable`) and the dispatcher checks on every call that the tensor passed
is the same object at the same version counter (an in-place write bumps it), and otherwise checks the new values
again (:meth:`CausalTable.holds`); a call whose tensor is no longer causal runs unpadded with dynamic shapes.
A write through ``.data`` bypasses the version counter (as it bypasses autograd's checks) and is not seen.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["CausalTable", "is_causal_table"]


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor has no version counter
        return None


def is_causal_table(t: Any) -> bool:
    """``t`` is a real boolean tensor of static shape with at least 2 dims that is false everywhere above the
    diagonal of its last two dims (``t[..., i, j]`` for ``j > i``) and true everywhere on it (``t[..., i, i]``)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool or t.dim() < 2 or t.device.type == "meta":
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor) or type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
        return False  # no values to read (a fake tensor) or values behind a subclass's own semantics
    if any(not isinstance(s, int) for s in t.shape) or t.numel() == 0:
        return False
    with torch.no_grad():
        return not bool(t.triu(1).any()) and bool(t.diagonal(dim1=-2, dim2=-1).all())


class CausalTable:
    """A graph input whose values a padding proof read (see :func:`is_causal_table`): the tensor (weakly) and its
    version counter when proven. :meth:`holds` says whether a call's tensor is still proven causal."""

    def __init__(self, name: str, t: torch.Tensor) -> None:
        self.name = name
        self._ref = weakref.ref(t)
        self._version = _version(t)

    def holds(self, t: Any) -> bool:
        """``t`` is the proven tensor, unwritten since (same object, same version counter), or its values are
        causal again (then they are remembered as the proven ones)."""
        if (
            isinstance(t, torch.Tensor)
            and self._ref() is t
            and self._version is not None
            and _version(t) == self._version
        ):
            return True
        if not is_causal_table(t):
            return False
        self._ref, self._version = weakref.ref(t), _version(t)
        return True

    def __repr__(self) -> str:
        return f"CausalTable({self.name!r})"
