"""The facts of the padding proof: what a node's values are known to hold whatever the padding.

Each fact is a frozen dataclass whose docstring says in one line what it means; ``DIMS`` names its fields that
are tensor dims (renumbered by :func:`moved` when a view, a broadcast or a reshape moves them), and ``PAIR`` marks
the facts about two different dims (which must stay different). The fact rules (:mod:`.provenance`) compute them
in one forward sweep (:func:`~.provenance.index_provenance`); the op rules (:mod:`.op_checks`) and the pattern
rules (:mod:`.patterns`) read them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

import torch

from ...fx_utils import example_of

__all__ = [
    "AllTrue",
    "Causal",
    "Const",
    "Diag",
    "FACTS",
    "KeysOnly",
    "MaskedAbove",
    "NegKeys",
    "NegMask",
    "OnePad",
    "PadCount",
    "Positions",
    "ZeroAbove",
    "ZeroKeys",
    "ZeroPad",
    "ZeroPadIf",
    "aligned",
    "fact_dims",
    "moved",
]

# --------------------------------------------------------------------------------------------
# Index provenance: position tensors and causal masks
# --------------------------------------------------------------------------------------------
#
# transformers builds its attention masks from position indices: ``q = arange(L)[None, None, :, None]``,
# ``kv = arange(L)[None, None, None, :]``, ``position_ids[batch, q]`` and ``kv <= q``. Two facts,
# computed in one forward sweep over the graph, let the op rules accept them:
#
# * :class:`Positions`: an integer tensor whose value at index ``i`` along one dim is ``i + offset``
#   whatever the other indices (``arange``, and what views, ``+ c`` and indexing by positions keep).
#   Indexing a padded dim of length ``n`` with positions ``0 .. n - 1`` reads row ``i`` into row ``i``.
# * :class:`Causal`: a boolean tensor that is true only where the index along dim ``k`` is at most
#   the index along dim ``q`` (``kv <= q`` on positions with equal offsets, and anything ANDed with
#   such a mask). As an attention mask (queries on dim -2, keys on dim -1) it lets a real query row
#   ``i < L`` see keys ``j <= i`` only, so never the padding at the end: the same proof as ``is_causal``.
#
# Positions may carry a run-time offset (``base``: a 0-d length tensor added to them, a cache's slots); a causal
# fact then carries it as ``shift`` (``j <= i + X``) and is never plain causal nor proven on its diagonal
# (``diag``), which the additive-mask facts (:class:`NegMask` ...) need.


@dataclass(frozen=True)
class Positions:
    """An integer tensor whose value at index ``i`` along ``dim`` is ``i + offset`` (+ ``base``), whatever the other indices."""

    DIMS: ClassVar[tuple[str, ...]] = ("dim",)
    dim: int  # value at index i along dim == i + offset (+ base), whatever the other indices
    offset: int
    base: str | None = None  # a 0-d integer tensor (node name) added to every position: a run-time offset


@dataclass(frozen=True)
class Causal:
    """A boolean tensor true only where the index along ``k`` is at most the index along ``q`` (+ ``shift``)."""

    DIMS: ClassVar[tuple[str, ...]] = ("q", "k")
    PAIR: ClassVar[bool] = True  # about two different dims
    q: int  # true only where index along k <= index along q (+ the value of shift)
    k: int
    shift: str | None = None  # a 0-d integer tensor (node name): the query's positions start there
    # true on the diagonal (k == q) of every real row when the named zero-padded inputs hold 1 at every real
    # position (checked per call by the dispatcher); None: not proven
    diag: frozenset[str] | None = None


@dataclass(frozen=True)
class Diag:
    """A boolean tensor true on the diagonal of dims ``a`` and ``b`` when the ``needs`` inputs hold 1."""

    DIMS: ClassVar[tuple[str, ...]] = ("a", "b")
    PAIR: ClassVar[bool] = True  # about two different dims
    a: int  # true on the diagonal (index along a == index along b), when the named inputs hold 1 (as Causal.diag)
    b: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class AllTrue:
    """A boolean tensor true everywhere (``new_ones((), dtype=torch.bool)``, where transformers' ``and_masks`` starts)."""

    DIMS: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class ZeroPad:
    """A tensor holding 0 / False at every padding row along ``dim`` (a zero-padded input, and what keeps that)."""

    DIMS: ClassVar[tuple[str, ...]] = ("dim",)
    dim: int  # every padding row along dim holds 0 / False (an input the dispatcher pads with 0, and what keeps that)
    source: str | None = None  # the placeholder whose values it holds, read in place (None: combined with others)


@dataclass(frozen=True)
class NegMask:
    """A float tensor (scores plus an additive mask) whose every real row ``i`` along ``q`` holds a value
    ``<= -1e30`` at each key ``j > i`` along ``k`` and a moderate one (a finite score, not a fill value) at
    ``j == i`` when the ``needs`` inputs hold 1: a softmax over ``k`` gives exactly 0 at ``j > i``."""

    DIMS: ClassVar[tuple[str, ...]] = ("q", "k")
    PAIR: ClassVar[bool] = True  # about two different dims
    q: int
    k: int
    needs: frozenset[str] = frozenset()
    pure: bool = False  # the mask alone (where(mask, 0, fill)): exactly 0 on the diagonal, given needs
    tail: int = 0  # static columns of finite values (attention sinks) appended after the keys along k


@dataclass(frozen=True)
class MaskedAbove:
    """A boolean tensor true at every key ``j > i`` along ``k`` of every real row ``i`` along ``q`` and false on
    the diagonal when the ``needs`` inputs hold 1: the negation of a :class:`Causal` mask, as ``masked_fill`` takes it."""

    DIMS: ClassVar[tuple[str, ...]] = ("q", "k")
    PAIR: ClassVar[bool] = True  # about two different dims
    q: int
    k: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class KeysOnly:
    """A boolean tensor false at every padding row along ``dim`` (the keys) and true at every real one when the
    ``needs`` inputs hold 1: a bidirectional mask of a zero-padded attention mask."""

    DIMS: ClassVar[tuple[str, ...]] = ("dim",)
    dim: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class NegKeys:
    """A float tensor holding a value ``<= -1e30`` at every padding key along ``k`` and a finite score at every
    real key when the ``needs`` inputs hold 1 (scores plus the additive form of a :class:`KeysOnly`)."""

    DIMS: ClassVar[tuple[str, ...]] = ("k",)
    k: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ZeroKeys:
    """A float tensor exactly 0 at every padding key along ``k`` (a softmax over ``k`` of a :class:`NegKeys`)."""

    DIMS: ClassVar[tuple[str, ...]] = ("k",)
    k: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ZeroAbove:
    """A float tensor exactly 0 at every key ``j > i`` along ``k`` of every real row ``i`` along ``q`` (a softmax
    of a :class:`NegMask`): a product contracting ``k`` reads no row after ``i``."""

    DIMS: ClassVar[tuple[str, ...]] = ("q", "k")
    PAIR: ClassVar[bool] = True  # about two different dims
    q: int
    k: int
    needs: frozenset[str] = frozenset()
    tail: int = 0  # as NegMask.tail: dropped by a slice [..., :-tail] before any product


@dataclass(frozen=True)
class OnePad:
    """A number tensor exactly 1 at every padding row along ``dim`` and 0 at every real one when the ``needs``
    inputs hold 1: ``1.0 - m`` of a zero-padded input read in place (the legacy additive mask
    ``(1.0 - attention_mask[:, None, None, :]) * finfo.min`` of GPT-1 and other pre-``masking_utils`` models)."""

    DIMS: ClassVar[tuple[str, ...]] = ("dim",)
    dim: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PadCount:
    """An integer tensor holding, at every padding row along ``dim``, the number of real rows (>= 1) when the
    ``needs`` inputs hold 1 at every real position: the running count ``cumsum`` of a zero-padded mask."""

    DIMS: ClassVar[tuple[str, ...]] = ("dim",)
    dim: int
    needs: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Const:
    """A tensor holding ``value`` at every element, whatever the padding (``zeros_like(x)``, what compares, selects
    and indexes keep of it): GIT's text-only ``token_type_ids`` and the block ids and block mask built from them."""

    DIMS: ClassVar[tuple[str, ...]] = ()
    value: bool | int | float


@dataclass(frozen=True)
class ZeroPadIf:
    """A tensor that is 0 / False at every padding row along ``dim`` when the ``needs`` inputs hold 1 at every
    real position (``cumsum(mask) == 0``: transformers' count of left-padding tokens)."""

    DIMS: ClassVar[tuple[str, ...]] = ("dim",)
    dim: int
    needs: frozenset[str] = frozenset()


#: Every fact type, in the order of the section comment above.
FACTS: tuple[type, ...] = (
    Positions,
    Causal,
    Diag,
    AllTrue,
    ZeroPad,
    NegMask,
    MaskedAbove,
    KeysOnly,
    NegKeys,
    ZeroKeys,
    ZeroAbove,
    OnePad,
    PadCount,
    Const,
    ZeroPadIf,
)


def fact_dims(fact: Any) -> tuple[str, ...] | None:
    """The names of ``fact``'s dim fields (its class's ``DIMS``); None for anything that is not a fact."""
    return getattr(type(fact), "DIMS", None) if type(fact) in FACTS else None


def moved(fact: Any, where: Callable[[int], int | None]) -> Any:
    """``fact`` with its dims renumbered by ``where`` (None: a dim that does not survive)."""
    fields = fact_dims(fact)
    if fields is None:
        return None
    dims = {f: where(getattr(fact, f)) for f in fields}
    if any(d is None for d in dims.values()):
        return None
    if getattr(fact, "PAIR", False) and len(set(dims.values())) < 2:
        return None
    return replace(fact, **dims)


def aligned(fact: Any, src: Any, out: torch.Tensor) -> Any:
    """``fact`` of ``src`` on the dims of a broadcast result ``out`` (dims align from the right)."""
    t = example_of(src)
    if fact is None or not isinstance(t, torch.Tensor) or t.dim() > out.dim():
        return None
    return moved(fact, lambda d: d + out.dim() - t.dim())
