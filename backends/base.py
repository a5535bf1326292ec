"""The interface every delegate adapter implements."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


class Delegate:
    """A compiler graphpass hands the rewritten graph to."""

    name: str = "delegate"
    host_code: bool = True  # can its compiled graph call graphpass's custom ops (Python)?

    def check(self) -> None:
        """Raise a DelegateError if this delegate cannot be used here (missing package, ...)."""

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
