"""Handing the rewritten graph to the delegate.

Delegates that can run host code get the whole graph, boundary nodes included. For delegates that
cannot (``host_code = False``, e.g. Neuron), the graph is split at every graphpass node (trap
boundaries, offload loads and evictions, captures): each stretch of compute between them becomes a
piece compiled by the delegate on its first call, and the graphpass nodes run on the host between
the pieces.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import sympy
import torch
from torch.fx.passes.split_module import split_module

from graphpass.backends import Delegate

from .fx_utils import is_graphpass_node


class _LazyPiece(torch.nn.Module):
    """One piece of a split graph, compiled by the delegate with the real inputs of its first call,
    and again for every new input signature (shapes, dtypes, devices): a delegate without host code
    compiles static shapes (TorchNeuron rejects dynamic ones), so a piece compiled for one size must
    never run another."""

    def __init__(self, piece: torch.fx.GraphModule, delegate: Delegate) -> None:
        super().__init__()
        self.piece = piece
        self.delegate = delegate
        self.compiled: dict[tuple, Callable] = {}
        out = next(n for n in piece.graph.nodes if n.op == "output")
        self.single = not isinstance(out.args[0], (tuple, list))
        if self.single:  # delegates expect a tuple of outputs
            out.args = ((out.args[0],),)
            piece.recompile()

    def forward(self, *args: Any) -> Any:
        key = tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a) for a in args)
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compiled[key] = self.delegate.compile(self.piece, list(args))
        result = fn(*args)
        return result[0] if self.single else tuple(result)


def split_at_boundaries(gm: torch.fx.GraphModule, delegate: Delegate) -> tuple[torch.fx.GraphModule, int]:
    """Split ``gm`` so no piece handed to ``delegate`` holds a graphpass op. Returns (parent, pieces)."""
    part: dict[torch.fx.Node, int] = {}
    seg = 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if is_graphpass_node(n):
            seg += 1
            part[n] = seg
            seg += 1
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0] in part \
                and is_graphpass_node(n.args[0]):
            part[n] = part[n.args[0]]  # a graphpass op's list output is unpacked on the host
        else:
            part[n] = seg
    _forget_undefined_symbols(gm)
    parent = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
    pieces = 0
    for name, sub in list(parent.named_children()):
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        if any(is_graphpass_node(n) for n in sub.graph.nodes):
            continue  # host code: runs as Python between the delegate's pieces
        setattr(parent, name, _LazyPiece(sub, delegate))
        pieces += 1
    return parent, pieces


def _forget_undefined_symbols(gm: torch.fx.GraphModule) -> None:
    """Drop example values that mention a size symbol no node of ``gm`` defines any more (a
    static-shape bucket bakes its size inputs in): ``split_module`` would look for the node that
    defines the symbol. The pieces are compiled from real inputs, so nothing needs those values."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    defined = set()
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
            defined.add(v.node.expr)
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if v is not None and not free_symbols(v) <= defined:
            del n.meta["example_value"]


def compile_with_delegate(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], delegate: Delegate) -> Callable:
    if delegate.host_code:
        return delegate.compile(gm, list(example_inputs))
    if not any(is_graphpass_node(n) for n in gm.graph.nodes):
        return delegate.compile(gm, list(example_inputs))
    parent, _ = split_at_boundaries(gm, delegate)
    return parent.forward
