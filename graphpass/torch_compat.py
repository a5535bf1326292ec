"""The one place graphpass answers for differences between the torch releases it supports (2.9 through
2.15). Anything else in graphpass that needs a torch API that moved or changed shape between those
releases calls a function here instead of testing the version or probing with ``hasattr`` itself.

Differences handled here:

- ``torch._dynamo.source.Source.name``: a method in torch 2.9 (``src.name()``), a property in later
  releases (``src.name``). :func:`source_name` returns the string on both.
- Slicing by a data-dependent (unbacked) size, ``x[:n]`` with ``n`` from ``nonzero``: torch 2.9's fake
  tensors guard on ``n <= size`` and Dynamo breaks the graph there; from 2.10 on the slice gets a fresh
  unbacked size instead (pytorch/pytorch#161414). :data:`UNBACKED_SAFE_SLICING` says which.
- Inductor and ops marked with ``torch.fx.node.has_side_effect`` whose outputs nobody reads (the trap
  boundaries, captures, evictions): torch 2.9's inductor keeps a fallback kernel only when its schema
  mutates an input (``FallbackKernel.has_side_effects``) and silently drops the others; later releases
  also keep the marked ops (``torch._library.utils.is_impure``). :func:`keep_marked_ops_in_inductor`
  gives graphpass's ops, on 2.9, an inductor lowering that keeps them.
- A frame Dynamo skips for a graph break inside a loop: later releases count it in
  ``torch._dynamo.utils.counters["unimplemented"]`` ("graph break in loop ... frame skipped: forward
  (/path/model.py line 187)"), which :mod:`graphpass.dynamo_records` reads; torch 2.9 only logs it at
  INFO. :func:`count_loop_skips` makes 2.9 count it in the same words.
- The ``forward`` of an inbuilt module (``torch.nn.Linear``) called from a frame running eagerly:
  later releases compile it as a frame of its own when the module has hooks (graphpass's offload
  guard is one); torch 2.9's Dynamo skips every frame in ``torch/nn``, so it runs eagerly.
  :func:`dynamo_compiles_own_frame` says whether a module class's ``forward`` gets its own frame.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import torch

__all__ = [
    "TORCH_RELEASE",
    "UNBACKED_SAFE_SLICING",
    "INDUCTOR_KEEPS_MARKED_OPS",
    "count_loop_skips",
    "dynamo_compiles_own_frame",
    "keep_marked_ops_in_inductor",
    "source_name",
    "torch_release_tuple",
]


def torch_release_tuple(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the running torch), e.g. ``"2.9.0+cu128"`` -> ``(2, 9)``."""
    parts = str(torch.__version__ if version is None else version).split("+", 1)[0].split(".")
    return int(parts[0]), int(parts[1])


TORCH_RELEASE: tuple[int, int] = torch_release_tuple()

# Dynamo traces ``x[:n]`` with an unbacked ``n`` without a graph break (see the module docstring).
UNBACKED_SAFE_SLICING: bool = TORCH_RELEASE >= (2, 10)


def source_name(source: Any) -> str:
    """The name Dynamo prints for ``source`` (a ``torch._dynamo.source.Source``), such as
    ``L['self']._modules['fc']._parameters['weight']``: ``Source.name`` is a method in torch 2.9
    and a property later."""
    name = source.name
    return str(name() if callable(name) else name)


# Inductor keeps a fallback op marked with torch.fx.node.has_side_effect although nothing reads its
# outputs: FallbackKernel.has_side_effects asks torch._library.utils.is_impure (not in torch 2.9).
INDUCTOR_KEEPS_MARKED_OPS: bool = hasattr(torch._library.utils, "is_impure")

_KEEP_LOCK = threading.Lock()
_KEPT_MARK = "_graphpass_kept_fallback"


def keep_marked_ops_in_inductor(namespace: str = "graphpass") -> list[Any]:
    """Make inductor keep every op of ``namespace`` marked with ``torch.fx.node.has_side_effect``
    (returns the ops it registered a lowering for now). A no-op where inductor already keeps them
    (:data:`INDUCTOR_KEEPS_MARKED_OPS`); on torch 2.9 it registers, per op, the lowering inductor's own
    implicit fallback would make (same layout constraint), with a kernel that reports a side effect.
    Torch's lowering table is process-wide, like the ops themselves; registering twice changes nothing."""
    if INDUCTOR_KEEPS_MARKED_OPS:
        return []
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag
    from torch.fx.node import _side_effectful_functions

    from .fx_utils import op_name

    added = []
    with _KEEP_LOCK:
        for op in list(_side_effectful_functions):
            if not isinstance(op, torch._ops.OpOverload) or op_name(op).namespace != namespace:
                continue
            if getattr(lowering.lowerings.get(op), _KEPT_MARK, False):
                continue
            lowering.add_needs_realized_inputs(op)
            lowering.add_layout_constraint(
                op, lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            )
            lowering.register_lowering(op, type_promotion_kind=None)(_kept_fallback_handler(op))
            added.append(op)
    return added


def _kept_fallback_handler(op: Any) -> Any:
    """inductor's ``fallback_handler(op)`` with a kernel that inductor never removes as dead code."""
    from torch._inductor import ir
    from torch.utils import _pytree as pytree

    class KeptFallbackKernel(ir.FallbackKernel):
        def has_side_effects(self) -> bool:
            return True

    def handler(*args: Any, **kwargs: Any) -> Any:
        out = KeptFallbackKernel.create(op, *args, **kwargs)
        return pytree.tree_map(lambda x: ir.TensorBox.create(x) if isinstance(x, ir.IRNode) else x, out)

    handler._is_fallback_handler = True  # type: ignore[attr-defined]  # what inductor's own handler says
    setattr(handler, _KEPT_MARK, True)
    return handler


_LOOP_SKIP = "Skipping frame because there is a graph break in a for/while loop"
_FRAME_SUMMARY = re.compile(r"<FrameSummary file (?P<file>.+), line (?P<line>\d+) in (?P<name>\S+)>")


def count_loop_skips() -> bool:
    """Make Dynamo count every frame it skips for a graph break inside a loop in
    ``counters["unimplemented"]``, as torch 2.10 and later do, with the frame's code name, file and the
    line it broke at (``frame skipped: NAME (FILE line N)``). Torch 2.9 only logs the skip
    (``symbolic_convert.log.info``): its module logger is wrapped so the message is counted, then
    logged as before (levels and handlers untouched). Returns whether the wrapper is in place (False
    where Dynamo counts the skips itself); installing twice changes nothing."""
    from torch._dynamo import symbolic_convert

    if hasattr(symbolic_convert.InstructionTranslatorBase, "raise_loop_graph_break"):
        return False
    with _KEEP_LOCK:
        if not isinstance(symbolic_convert.log, _LoopSkipCounter):
            symbolic_convert.log = _LoopSkipCounter(symbolic_convert.log)
    return True


class _LoopSkipCounter:
    """A logger wrapper that counts Dynamo's "skipping frame" messages (everything else delegated)."""

    def __init__(self, log: Any) -> None:
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(msg, str) and msg.startswith(_LOOP_SKIP):
            m = _FRAME_SUMMARY.search(msg)
            where = f"{m['name']} ({m['file']} line {m['line']})" if m else "?"
            from torch._dynamo.utils import counters

            counters["unimplemented"][
                "graph break in loop\n  Explanation: torch.compile detected a graph break in a for/while loop. "
                f"Skipping the frame and falling back to eager.\n\n  Developer debug context: frame skipped: {where}"
            ] += 1
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1  # the record names Dynamo's line, not this one
        self._log.info(msg, *args, **kwargs)


_INBUILT_MODULES = ("torch.nn.", "torch.ao.")


def dynamo_compiles_own_frame(module_class: type) -> bool:
    """Whether Dynamo compiles ``module_class.forward`` as a frame of its own when a hooked instance is
    called from code running eagerly (a frame Dynamo skipped). True for user classes; for inbuilt
    ones (``torch.nn.*``, ``torch.ao.*``) only where Dynamo's trace rules look at the frame's module
    (``trace_rules.check_verbose(..., frame=)``, after torch 2.9)."""
    if not module_class.__module__.startswith(_INBUILT_MODULES):
        return True
    import inspect

    from torch._dynamo import trace_rules

    return "frame" in inspect.signature(trace_rules.check_verbose).parameters
