"""Guards recorded inside an op, checked by replaying the graph at a bucket's static sizes.

A graph proven through a causal function's code must be that code's trace at each bucket (:class:`.conditions.
GuardBuckets`): a guard on the padded length that fails at a bucket marks the bucket invalid. Not every guard is
about the code, though. torch 2.9's meta functions guard on the layout of their operands while computing an op's
result: whether a slice is contiguous (``check_contiguous_sizes_strides``), whether a reshape can be a view
(``_reshape_view_helper``), which stride order an elementwise result takes (``should_swap``). Mamba-2's padding
branch slices its ``P = s + Mod(8 - Mod(s, 8), 8)`` padded rows back to ``s``: at the traced length the slice is not
contiguous (``Ne(128*P, 128*s)``), at a bucket that is a multiple of the chunk ``P == s`` and it is. Such a guard
fails at every multiple, so the graph was refused there (torch 2.13 records none of these).

A guard is *recorded inside an op* (:func:`recorded_inside_an_op`) when torch recorded it while computing one graph
node's result on fake tensors: its innermost torch frame is Dynamo's ``run_node`` / ``get_fake_value`` (the node is
already in the graph; only its result's metadata is being computed) or torch's meta code under it (``_prims_common``,
``_refs``, ``_prims``, ``_decomp``, the meta registrations and fake kernels, which Dynamo never traces as user code),
or it has no user frame at all and that frame is torch's own code (a later trace of the captured graph: AOTAutograd,
functionalization, ``make_fx``). Such a guard cannot change which ops the graph
holds, only the metadata torch computed for one of them: sizes, strides, and whether the result is a view. The
graph Python code would trace at the bucket is the same graph; what may differ is that metadata. So instead of the
guard, its consequence is checked (:func:`replay_differs`): the graph is run on fake tensors of the bucket's static
sizes (each other symbol at its traced value), and every node must get the sizes its symbolic sizes evaluate to
there. Where the graph writes in place anywhere, each node must also share storage with its first operand exactly
where it did at the traced length (a reshape that becomes a view at the bucket would carry a write through to its
base). A graph with ``as_strided`` (which reads its operand's strides as numbers) is not replayed.

Guards from the user's code (a Python branch, ``if pad_size > 0``; a method that reads a layout,
``x.is_contiguous()``) are not recorded inside an op and stay as :class:`.conditions.GuardBuckets` checks them.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any, Mapping

import sympy
import torch

from ...fx_utils import example_of, mentions_symbol, op_name, shape_env_hints, storage_key, torch_relative, writes_into
from ...tensor_utils import static_fake_mode

__all__ = ["recorded_inside_an_op", "replay_differs"]

log = logging.getLogger("graphpass.static_shapes.padding_proof")

_RUN_NODE = (os.path.join("_dynamo", "utils.py"), frozenset({"run_node", "get_fake_value"}))
# torch's code that computes an op's result on fake tensors (reached from ``run_node``; Dynamo does not trace into it)
_META_CODE = tuple(
    os.path.join(*p.split("/"))
    for p in ("_prims_common/", "_refs/", "_prims/", "_decomp/", "_meta_registrations.py", "_subclasses/fake_impls.py")
)
_STRIDE_READERS = frozenset({"as_strided", "as_strided_", "as_strided_scatter", "set_"})


def recorded_inside_an_op(guard: Any) -> bool:
    """Whether torch recorded ``guard`` (a ``ShapeGuard``) while computing one graph node's result (see the module
    docstring): the innermost torch frame is Dynamo's ``run_node`` / ``get_fake_value``, or there is no user frame
    and that frame is torch's own code."""
    sloc = getattr(guard, "sloc", None)
    frame = getattr(sloc, "framework_loc", None)
    if not isinstance(frame, traceback.FrameSummary):
        return False
    inner = torch_relative(frame.filename)
    if inner is None:
        return False
    if getattr(sloc, "maybe_user_loc", None) is None:
        return True
    return (inner == _RUN_NODE[0] and frame.name in _RUN_NODE[1]) or inner.startswith(_META_CODE)


def _concrete(size: Any, values: Mapping[sympy.Symbol, int]) -> int | None:
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        expr = sympy.sympify(size.node.expr).xreplace(values)
        return int(expr) if expr.is_Integer else None
    return None


def _bucket_values(env: Any, names: set[str], bucket: int) -> dict[sympy.Symbol, Any]:
    values: dict[sympy.Symbol, Any] = {s: sympy.Integer(int(v)) for s, v in shape_env_hints(env).items()}
    for s in list(values):
        if str(s) in names:
            values[s] = sympy.Integer(bucket)
    return values


def _fake_inputs(
    gm: torch.fx.GraphModule, values: Mapping[sympy.Symbol, Any], names: set[str], mode: Any
) -> list[Any] | str:
    """The placeholders' values at the bucket: fake tensors of the static sizes, ints for SymInts."""

    def padded(t: torch.Tensor) -> bool:
        return any(mentions_symbol(s, frozenset(names)) for s in t.shape)

    args: list[Any] = []
    for p in (n for n in gm.graph.nodes if n.op == "placeholder"):
        v = example_of(p)
        if isinstance(v, torch.SymInt):
            args.append(_concrete(v, values))
        elif isinstance(v, torch.Tensor):
            sizes = [_concrete(s, values) for s in v.shape]
            if any(s is None for s in sizes):
                return f"input {p.name}'s sizes {tuple(v.shape)} are not static at the bucket"
            # an unpadded input keeps its strides; a padded one is the dispatcher's staging buffer: contiguous
            strides = None if padded(v) else [_concrete(s, values) for s in v.stride()]
            with mode:
                if strides is None or any(s is None for s in strides):
                    args.append(torch.empty(sizes, dtype=v.dtype, device=v.device))
                else:
                    args.append(torch.empty_strided(sizes, strides, dtype=v.dtype, device=v.device))
        else:
            args.append(v)
    return args


class _Replay(torch.fx.Interpreter):
    """Runs the graph on fake tensors and keeps every node's result, without touching the graph's metadata."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.results: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        self.results[n] = out
        return out


def _shares_first_operand(node: torch.fx.Node, value_of: Any) -> bool | None:
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node):
        return None
    a, b = storage_key(value_of(node)), storage_key(value_of(first))
    return None if a is None or b is None else a == b


def _node_differs(
    node: torch.fx.Node,
    got: Any,
    values: Mapping[sympy.Symbol, Any],
    writes: bool,
    results: Mapping[torch.fx.Node, Any],
) -> str | None:
    traced = example_of(node)
    if not isinstance(traced, torch.Tensor):
        return None
    if not isinstance(got, torch.Tensor):
        return f"{node.name} is no tensor at the bucket"
    want = tuple(_concrete(s, values) for s in traced.shape)
    if want != tuple(got.shape):
        return f"{node.name} has sizes {tuple(got.shape)} at the bucket, its traced sizes say {want}"
    if writes and node.op in ("call_function", "call_method"):
        before = _shares_first_operand(node, example_of)
        after = _shares_first_operand(node, lambda n: results.get(n))
        if before is not None and after is not None and before != after:
            return (
                f"{node.name} ({op_name(node.target).name}) is {'a view' if after else 'a copy'} of its operand "
                f"at the bucket but was {'a view' if before else 'a copy'} when traced, and the graph writes in "
                "place"
            )
    return None


def replay_differs(gm: torch.fx.GraphModule, env: Any, names: set[str], bucket: int) -> str | None:
    """None where running ``gm`` on fake tensors of the bucket's static sizes (every symbol named in ``names`` set
    to ``bucket``, every other symbol at its traced value) gives each node the sizes its symbolic sizes evaluate to
    there, and, where the graph writes in place, the same storage sharing with its first operand as when traced;
    otherwise the first difference (see the module docstring)."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    readers = sorted({op_name(n.target).name for n in calls if n.op != "call_module"} & _STRIDE_READERS)
    if readers:
        return f"the graph calls {', '.join(readers)}, which reads its operand's strides"
    values = _bucket_values(env, names, bucket)
    mode = static_fake_mode()
    args = _fake_inputs(gm, values, names, mode)
    if isinstance(args, str):
        return args
    replay = _Replay(gm)
    try:
        with mode:
            replay.run(*args)
    except Exception as e:  # noqa: BLE001 - an op that fails at the bucket: the graph is not replayable there
        return f"the graph does not run at the bucket's sizes ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    writes = any(writes_into(n, a) for n in calls for a in n.all_input_nodes)
    for node in calls:
        why = _node_differs(node, replay.results.get(node), values, writes, replay.results)
        if why is not None:
            return why
    log.debug("graph replayed at bucket %d on fake tensors: every size as traced", bucket)
    return None
