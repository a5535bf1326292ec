"""Handing the rewritten graph to the delegate.

Delegates that can run host code get the whole graph, boundary nodes included. For delegates that
cannot (``host_code = False``, e.g. Neuron, whose compiler takes aten/prims ops only), the graph is
split at every node only the host can run:

* graphpass's own ops (trap boundaries, offload loads and evictions, captures);
* custom ops of other libraries that have no aten decomposition (no ``CompositeImplicitAutograd``
  kernel, no entry in torch's decomposition table), e.g. transformers' ``grouped_mm_fallback``
  (a Python loop over experts): each is logged, once per graph, as running on the host.

Each stretch of compute between them becomes a piece compiled by the delegate on its first call,
and the host nodes run as Python between the pieces. Custom ops that do decompose stay in their
piece and reach the delegate as aten (the delegate lowers them, e.g. ``NeuronDelegate``).

The pieces are contiguous stretches of the graph's (topological) node order, so every edge between
two of them runs forward: the split can never make a cycle.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from typing import Any, Callable, Sequence

import torch
from torch.fx.passes.split_module import split_module

from graphpass.backends import Delegate

from .errors import DelegateError, GraphpassError, _short
from .fx_utils import (
    aten_decomposition,
    copy_graph,
    example_of,
    find_calls,
    graphpass_op_name,
    is_custom_op,
    is_graphpass_node,
)

log = logging.getLogger("graphpass.delegation")


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
            fn = self.compiled[key] = call_delegate(self.delegate, self.piece, list(args), "a piece of a split graph")
        result = fn(*args)
        return result[0] if self.single else tuple(result)


def runs_on_host(node: torch.fx.Node) -> bool:
    """Whether a delegate without host code must leave ``node`` to the host: a graphpass op, or a
    custom op AOTAutograd cannot lower to aten (see :func:`graphpass.fx_utils.aten_decomposition`)."""
    if is_graphpass_node(node):
        return True
    return node.op == "call_function" and is_custom_op(node.target) and aten_decomposition(node.target) is None


def split_at_boundaries(gm: torch.fx.GraphModule, delegate: Delegate) -> tuple[torch.fx.GraphModule, int]:
    """Split ``gm`` so no piece handed to ``delegate`` holds a node only the host can run (see the
    module docstring). Returns (parent, pieces). ``gm`` itself is left as it is."""
    work = _split_copy(gm)
    part = _contiguous_parts(work)
    _log_host_ops(work, delegate)
    parent = split_module(work, work, lambda n: part[n], keep_original_order=True)
    pieces = 0
    for name, sub in list(parent.named_children()):
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        if any(runs_on_host(n) for n in sub.graph.nodes):
            continue  # host code: runs as Python between the delegate's pieces
        setattr(parent, name, _LazyPiece(sub, delegate))
        pieces += 1
    return parent, pieces


def _split_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The copy of ``gm`` the split works on:

    * the getitems unpacking a host node's results moved right after it, so they run on the host with
      it and the partitions stay contiguous (``split_module`` requires that where the graph toggles
      grad mode or autocast);
    * no example value that mentions a size symbol. ``split_module`` makes a symbol's defining node
      an input of every piece that receives a value sized by it, and takes the first node whose value
      is that symbol as its definition. Where the placeholder defining it is gone (a static-shape
      bucket bakes its sizes in), that node may lie in the piece that uses the value, and the piece
      then depends on itself: "cycle exists between partitions!". The pieces are compiled from the
      real inputs of their first call, so nothing needs those values."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    work = copy_graph(gm)
    for node in list(work.graph.nodes):
        if runs_on_host(node):
            cursor = node
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem:
                    cursor.append(user)
                    cursor = user
    for node in work.graph.nodes:
        value = node.meta.get("example_value")
        if value is not None and free_symbols(value):
            del node.meta["example_value"]
    return work


def _contiguous_parts(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """Partition of every node: each host node (with the getitems that unpack it) a partition of its
    own, each stretch between two host nodes one partition, numbered in node order. Node order is
    topological, so each edge goes from a partition to itself or to a later one: no cycle."""
    part: dict[torch.fx.Node, int] = {}
    seg = 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if runs_on_host(n):
            seg += 1
            part[n] = seg
            seg += 1
        elif (
            n.op == "call_function"
            and n.target is operator.getitem
            and isinstance(n.args[0], torch.fx.Node)
            and n.args[0] in part
            and runs_on_host(n.args[0])
        ):
            part[n] = part[n.args[0]]  # moved right after its host node by _split_copy
        else:
            part[n] = seg
    return part


def _log_host_ops(gm: torch.fx.GraphModule, delegate: Delegate) -> None:
    """One line per graph naming the custom ops that run on the host between the delegate's pieces."""
    ops = Counter(str(n.target) for n in gm.graph.nodes if runs_on_host(n) and not is_graphpass_node(n))
    if ops:
        listed = ", ".join(f"{op} ({count} call{'s' if count > 1 else ''})" for op, count in sorted(ops.items()))
        log.warning(
            "delegate %r cannot run host code and these custom ops have no aten decomposition "
            "(CompositeImplicitAutograd kernel or torch._decomp entry): they run on the host between "
            "its compiled pieces: %s",
            delegate.name,
            listed,
        )


def compile_with_delegate(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], delegate: Delegate, graph_name: str = "the graph"
) -> Callable:
    """The delegate's compiled ``gm``. A delegate without host code gets the graph split at the nodes
    only the host can run (graphpass's ops, custom ops without an aten decomposition), its pieces
    compiled on their first call."""
    if delegate.host_code or not any(runs_on_host(n) for n in gm.graph.nodes):
        try:
            return call_delegate(delegate, gm, list(example_inputs), graph_name)
        except _dynamo_fallbacks() as err:
            refuse_eager_fallback(gm, delegate, err, graph_name)
            raise
    parent, _ = split_at_boundaries(gm, delegate)
    return parent.forward


def call_delegate(delegate: Delegate, gm: torch.fx.GraphModule, example_inputs: list, graph_name: str) -> Callable:
    """``delegate.compile(gm, example_inputs)``, checked: a delegate that raises (other than a graphpass
    error, or an exception Dynamo takes as "run eagerly", which :func:`compile_with_delegate` handles)
    or returns something that is not callable raises a :class:`DelegateError` naming the delegate and
    the graph, the delegate's own exception as its cause (Dynamo would report either as its generic
    backend failure, naming graphpass instead of the delegate)."""
    scans_off_gpu_as_generic(gm, example_inputs)
    try:
        fn = delegate.compile(gm, example_inputs)
    except (GraphpassError, *_dynamo_fallbacks()):
        raise
    except Exception as err:
        raise DelegateError(
            f"delegate {delegate.name!r} failed to compile {graph_name}: {type(err).__name__}: {err}"
        ) from err
    if not callable(fn):
        raise DelegateError(
            f"delegate {delegate.name!r} returned {_short(fn)} instead of a callable when compiling {graph_name}: a "
            "backend must return the compiled function (for example gm.forward)"
        )
    return fn


def scans_off_gpu_as_generic(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Point every ``torch.ops.higher_order.associative_scan`` node of ``gm`` whose tensors are not on CUDA or XPU
    at torch's own implementation of the op there (:func:`generic_associative_scan`: the generic odd/even
    decomposition, what the op runs eagerly off those devices). Returns how many nodes.

    Only CUDA and XPU have code generation for the op (inductor refuses it on the CPU, a static-only compiler
    takes no higher-order op). Traced again by a delegate that lowers to aten (aot_eager, inductor, Neuron,
    XLA), the decomposition unrolls into plain aten ops at the graph's sizes: at a bucket's static size (how
    ``graphpass.static_shapes.scan_trace`` means it), or under guards on a symbolic length, which Dynamo adds
    to the frame's (the same specialization the generic trace has). Eager delegates run what they ran."""
    try:
        from torch._higher_order_ops.associative_scan import associative_scan_op
    except ImportError:
        return 0
    nodes = find_calls(gm.graph, associative_scan_op)
    if not nodes:
        return 0
    inputs = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    count = 0
    for node in nodes:
        values = [example_of(n) for n in node.all_input_nodes]
        devices = {v.device.type for v in values if isinstance(v, torch.Tensor)} or {t.device.type for t in inputs}
        if devices & {"cuda", "xpu"}:
            continue
        node.target = generic_associative_scan
        count += 1
    if count:
        gm.recompile()
    return count


def generic_associative_scan(combine_fn: Callable, xs: list, additional_inputs: tuple) -> list:
    """torch's implementation of ``associative_scan`` off CUDA (the odd/even decomposition), called as a plain
    function: what :func:`scans_off_gpu_as_generic` points a scan node at."""
    from torch._higher_order_ops.associative_scan import associative_scan_op_dense

    return associative_scan_op_dense(combine_fn, xs, additional_inputs)


def _dynamo_fallbacks() -> tuple[type, ...]:
    """The exceptions Dynamo takes, from a backend, as "run this frame eagerly" instead of an error."""
    try:
        from torch._dynamo.exc import exceptions_allowed_to_be_fallback

        return tuple(exceptions_allowed_to_be_fallback)
    except ImportError:  # pragma: no cover - older layouts: the fake-tensor family it has always been
        from torch._subclasses import fake_tensor as ft

        return (ft.DataDependentOutputException, ft.DynamicOutputShapeException, ft.UnsupportedOperatorException)


def refuse_eager_fallback(gm: torch.fx.GraphModule, delegate: Delegate, err: BaseException, graph_name: str) -> None:
    """Raise a DelegateError where the delegate's failure would make Dynamo run the frame eagerly,
    without what graphpass inserted in ``gm`` (offload loads and evictions, captures): with offload
    the eager code computes with the model's stand-ins, and a capture writes nothing. A graph with only
    trap boundaries loses nothing numerical: that fallback is logged and left to Dynamo."""
    from .ops import is_boundary

    work = Counter(graphpass_op_name(n) for n in gm.graph.nodes if is_graphpass_node(n) and not is_boundary(n))
    what = f"{type(err).__name__}: {err}"
    if not work:
        log.warning(
            "delegate %r could not trace %s (%s): Dynamo runs that frame eagerly, without its trap boundaries",
            delegate.name,
            graph_name,
            what,
        )
        return
    ops = ", ".join(f"{count} {op}" for op, count in sorted(work.items()))
    raise DelegateError(
        f"delegate {delegate.name!r} could not trace {graph_name}, which graphpass rewrote ({ops}): {what}. "
        "Dynamo would run that frame eagerly without these nodes (offloaded weights are stand-ins there and "
        "captures write nothing), so graphpass refuses it. then='eager' runs the rewritten graph without "
        "compiling it; otherwise remove the op at fault (a data-dependent size or value) from the model's "
        "forward, or report it if the traceback ends in graphpass's own ops"
    ) from err


def __getattr__(name: str) -> Any:
    """``with_post_grad_passes``, deprecated here: it moved to :mod:`graphpass.pipeline`, where the post-grad passes
    are declared (the backend installs them in the inductor delegate before handing it down)."""
    if name == "with_post_grad_passes":
        import warnings

        from .pipeline import with_post_grad_passes  # the documented upward import (docs/architecture.md, Layers)

        warnings.warn(
            "graphpass.delegation.with_post_grad_passes moved to graphpass.pipeline.with_post_grad_passes",
            DeprecationWarning,
            stacklevel=2,
        )
        return with_post_grad_passes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
