"""What every pass receives: the graph, its example inputs, the config and the shared analysis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..analysis import GraphAnalysis
from ..config import GraphpassConfig
from ..roots import Roots



@dataclass
class PassContext:
    gm: torch.fx.GraphModule
    example_inputs: Sequence[Any]
    config: GraphpassConfig
    roots: Roots = field(default_factory=Roots)  # the model objects the graph's sources start from
    captures: list = field(default_factory=list)  # graphpass.capturing.CaptureSpec of attached ModelCaptures
    static_bounds: dict = field(default_factory=dict)  # sympy symbol -> upper bound (largest bucket)
    analysis: GraphAnalysis = None  # type: ignore[assignment]
    log: list[str] = field(default_factory=list)  # what each pass did, one line per change

    def __post_init__(self) -> None:
        if self.analysis is None:
            self.analysis = GraphAnalysis()



class GraphPass:
    """One step of the pipeline. Subclasses set ``name`` and implement :meth:`run`."""

    name: str = "pass"

    def should_run(self, ctx: PassContext) -> bool:
        return True

    def run(self, ctx: PassContext) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, ctx: PassContext) -> None:
        if self.should_run(ctx):
            self.run(ctx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
