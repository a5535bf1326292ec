"""What every pass receives: the graph, its example inputs, the config and the shared analysis."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..analysis import GraphAnalysis
from ..config import GraphpassConfig

_GRAPH_IDS = itertools.count()


@dataclass
class PassContext:
    gm: torch.fx.GraphModule
    example_inputs: Sequence[Any]
    config: GraphpassConfig
    roots: dict[str, Any] = field(default_factory=dict)  # local/global name -> object Dynamo read it from
    prefixes: dict[str, str] = field(default_factory=dict)  # root name -> its FQN in the enclosing model
    models: dict[str, Any] = field(default_factory=dict)  # root name -> the whole model it belongs to
    analysis: GraphAnalysis = None  # type: ignore[assignment]
    log: list[str] = field(default_factory=list)  # what each pass did, one line per change

    def __post_init__(self) -> None:
        if self.analysis is None:
            self.analysis = GraphAnalysis(graph_id=next(_GRAPH_IDS), root=None)


    def model_roots(self) -> dict[str, torch.nn.Module]:
        """Root name -> the outermost module it belongs to (itself when compiled directly)."""
        out = {}
        for name, obj in self.roots.items():
            model = self.models.get(name, obj)
            if isinstance(model, torch.nn.Module):
                out[name] = model
        return out


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
