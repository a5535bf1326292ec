"""The interface every delegate adapter implements."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

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


def call_registered(
    name: str,
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable:
    """Compile ``gm`` with the Dynamo backend registered as ``name``, passing ``options`` and a
    non-default ``mode`` the way ``torch.compile`` passes them to a backend."""
    from torch._dynamo.backends.registry import lookup_backend

    fn = lookup_backend(name)
    kwargs: dict[str, Any] = {}
    if options:
        kwargs["options"] = dict(options)
    if mode not in (None, "default"):
        kwargs["mode"] = mode
    return fn(gm, list(example_inputs), **kwargs)
