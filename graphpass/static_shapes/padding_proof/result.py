"""What the padding proof returns (:class:`PaddingProof`) and the protocols of what it asks the caller to check:
per call (:class:`CallCheck`: an input that must hold 1 everywhere, a causal table that must keep its values) and
per bucket (:class:`BucketCheck`, whose verdicts are the typed :class:`InvalidBucket` reasons)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from ..buffer_masks import CausalTable
from ..position_tables import TableRead

__all__ = ["BucketCheck", "CallCheck", "GuardFails", "InvalidBucket", "NotProven", "PaddingProof", "PaddingViolation"]


@dataclass
class PaddingViolation:
    node: str  # FX node name
    op: str  # readable target, e.g. "torch.softmax", "aten.sum.dim_IntList", "Tensor.cumsum"
    dim: int | None  # the padded dim the op mixes along (None for full reductions)
    reason: str  # one line: "softmax along the padded dim mixes rows", ...
    source: str  # "file.py:LINE" from node.meta["stack_trace"] (basename), or ""

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        dim = "" if self.dim is None else f" (dim {self.dim})"
        return f"{self.node} [{self.op}]{dim}: {self.reason}{where}"


@runtime_checkable
class CallCheck(Protocol):
    """A condition the proof holds under, checked by the dispatcher on every call: ``holds(args)`` (the graph's
    call arguments, by placeholder position); when it fails, ``why()`` says why (the warning's text) and the call
    runs unpadded. ``inputs``: the placeholder positions it reads."""

    name: str
    inputs: tuple[int, ...]

    def holds(self, args: Sequence[Any]) -> bool: ...

    def why(self) -> str: ...


@dataclass(frozen=True)
class InvalidBucket:
    """Why calls landing in a bucket run unpadded (``BucketPlan.invalid_buckets``): ``text`` names the cause."""

    text: str

    def __str__(self) -> str:
        return self.text

    def __contains__(self, part: str) -> bool:
        return part in self.text

    def warning(self, bucket: int) -> str:
        """The warning's text for a call landing in ``bucket``."""
        return f"bucket {bucket} cannot be used for this graph: {self.text}"


@dataclass(frozen=True)
class GuardFails(InvalidBucket):
    """A Dynamo guard on the padded length (``text``: the guard and its source line) fails at the bucket: the graph
    of a causal function proven as code is not that code's graph at the bucket's size."""

    def warning(self, bucket: int) -> str:
        return f"Dynamo's guard {self.text} fails at bucket {bucket}, so this graph is not the traced code's graph at that size"


@dataclass(frozen=True)
class NotProven(InvalidBucket):
    """A proof that holds at some buckets only (a top-k keeping fewer keys than the bucket, a position table with
    too few rows) does not hold at this one."""

    def warning(self, bucket: int) -> str:
        return f"bucket {bucket} is not proven for this graph: {self.text}"


@runtime_checkable
class BucketCheck(Protocol):
    """A condition on the bucket sizes: ``mark(proof, names, buckets)`` records in ``proof.invalid_buckets`` the
    buckets (of ``buckets``, the padded symbols named ``names`` set to each) where it fails, skipping those already
    marked, and refuses (``proof.refused``) when every bucket is marked."""

    name: str

    def mark(self, proof: "PaddingProof", names: set[str], buckets: tuple[int, ...]) -> None: ...


@dataclass
class PaddingProof:
    """The padding proof of one graph: its violations (padding is safe when there are none), what the caller must
    check per call (:attr:`call_checks`) and per bucket (:attr:`bucket_checks`, decided into :attr:`invalid_buckets`
    and :attr:`refused` by :meth:`check_buckets`), and which rule accepted each node (:attr:`proven_by`: node name
    -> rule name; :attr:`accepted_by`: rule name -> how many nodes)."""

    violations: list[PaddingViolation] = field(default_factory=list)
    call_checks: list[CallCheck] = field(default_factory=list)
    bucket_checks: list[BucketCheck] = field(default_factory=list)
    invalid_buckets: dict[int, InvalidBucket] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)  # why no bucket can be used (every one invalid)
    proven_by: dict[str, str] = field(default_factory=dict)
    accepted_by: Counter[str] = field(default_factory=Counter)
    proofs: list[Any] = field(default_factory=list)  # the proofs of the extra pattern rules (``rules=``)
    relied_on: set[str] = field(default_factory=set)  # zero-padded inputs an accepted proof needs to hold 1
    trusted: set[str] = field(default_factory=set)  # causal functions proven as code (their guards: per bucket)
    tables: dict[str, CausalTable] = field(default_factory=dict)  # inputs proven causal tables on their values
    table_reads: list[TableRead] = field(default_factory=list)  # static-size tables looked up by position

    @property
    def safe(self) -> bool:
        return not self.violations

    def check_buckets(self, names: set[str], buckets: tuple[int, ...]) -> None:
        """Decide :attr:`bucket_checks` at ``buckets`` (the padded symbols named ``names``), in order, while the
        graph is neither refused nor unsafe."""
        for check in self.bucket_checks:
            if self.violations or self.refused:
                return
            check.mark(self, names, buckets)
