"""The one place graphpass answers for differences between the torch releases it supports (2.9 through
2.15). Anything else in graphpass that needs a torch API that moved or changed shape between those
releases calls a function here instead of testing the version or probing with ``hasattr`` itself.

Differences handled here:

- ``torch._dynamo.source.Source.name``: a method in torch 2.9 (``src.name()``), a property from 2.10
  on (``src.name``). :func:`source_name` returns the string on both.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["TORCH_RELEASE", "source_name", "torch_release_tuple"]


def torch_release_tuple(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the running torch), e.g. ``"2.9.0+cu128"`` -> ``(2, 9)``."""
    parts = str(torch.__version__ if version is None else version).split("+", 1)[0].split(".")
    return int(parts[0]), int(parts[1])


TORCH_RELEASE: tuple[int, int] = torch_release_tuple()


def source_name(source: Any) -> str:
    """The name Dynamo prints for ``source`` (a ``torch._dynamo.source.Source``), such as
    ``L['self']._modules['fc']._parameters['weight']``: ``Source.name`` is a method in torch 2.9
    and a property later."""
    name = source.name
    return str(name() if callable(name) else name)
