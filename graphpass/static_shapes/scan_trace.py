"""Mamba (v1)'s selective scan traced as one scan op when graphpass pads to buckets, on any device.

transformers' ``mamba_selective_scan`` (Mamba, Falcon-Mamba, Jamba, Zamba) calls torch's ``associative_scan``
with ``combine_mode="pointwise"`` on CUDA and XPU and ``"generic"`` elsewhere (the CPU, and XLA, which Neuron
is built on). Under Dynamo the two trace differently:

* ``"pointwise"``: one ``torch.ops.higher_order.associative_scan`` node, no guard on the length. The padding
  proof trusts the whole function (:mod:`graphpass.static_shapes.causal_functions`) and the graph buckets.
* ``"generic"``: torch's odd/even recursion is inlined and unrolled for the traced length, under guards on the
  parities of ``s, s // 2, ...`` that pin the length: every length compiles anew, padded or not.

What this module inserts: nothing into a graph. :func:`install` registers, once per process, a Dynamo
substitute for torch's ``associative_scan`` (``torch.compiler.substitute_in_graph``; eager calls never see
it). While Dynamo traces a call, the substitute asks once (:func:`_one_op_wanted`, evaluated at trace time and
kept as a constant) whether all of these hold, and only then traces ``"generic"`` as ``"pointwise"``:

1. the graph goes to a graphpass backend whose config pads to buckets (``static_shapes`` set): other backends,
   and graphpass without static shapes, trace exactly what they traced before;
2. the caller is transformers' ``mamba_selective_scan`` itself, in one of the files of its proof and with the
   proven source digest (the same check that lets the padding proof trust it): its ``combine_fn`` is the
   pointwise composition of affine maps ``(a_l * a_r, a_r * b_l + b_r)``, so ``"pointwise"`` is valid for it.

Why it computes the same function: the higher-order op's implementation off CUDA is torch's generic
decomposition itself (``associative_scan_op_dense`` calls ``generic_associative_scan``), run at the call's
real (or padded) size; only the float summation tree of the scan may differ from the unrolled one, as it
already differs from transformers' eager loop. Off CUDA no delegate gets the op itself: before compiling,
``graphpass.delegation.scans_off_gpu_as_generic`` points it at that decomposition, which a delegate lowering to
aten (inductor, Neuron, XLA) unrolls at the bucket's static size.

On torch 2.9 transformers never reaches that call under Dynamo: it takes the associative scan only when
``is_torchdynamo_compiling() and not is_torchdynamo_exporting()``, and torch 2.9's Dynamo folds
``torch.compiler.is_exporting()`` to True in every trace (torch 2.10 reads whether ``torch.export`` runs). Mamba then
runs its per-token loop, which pins the length. So :func:`install` also registers a Dynamo substitute for
transformers' ``is_torchdynamo_exporting`` (once transformers is imported: checked when a compile starts,
``torch._dynamo.callback``): under a graphpass backend that pads to buckets it answers whether ``torch.export`` is
running (``torch.compiler._is_exporting_flag``, what torch 2.10 answers); under any other backend it is the original.

Assumes torch's ``associative_scan`` signature ``(combine_fn, xs, dim, reverse=False, combine_mode=...)``; a
torch without it, or a substitute someone else registered first, leaves tracing as it was (logged at DEBUG).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
import types
from typing import Any

import torch
import torch._dynamo

__all__ = ["install", "ONE_OP_CALLERS"]

log = logging.getLogger("graphpass.static_shapes.scan_trace")

# The proven functions (graphpass.static_shapes.causal_functions) whose associative_scan call may be traced as
# one op: their combine_fn is pointwise.
ONE_OP_CALLERS = ("mamba_selective_scan",)

_lock = threading.Lock()
_installed: list[bool] = []  # [True] once the substitute is registered (or [False]: it could not be)


def install() -> bool:
    """Register the substitute for torch's ``associative_scan`` (idempotent, thread-safe), and the one for
    transformers' ``is_torchdynamo_exporting`` once transformers is imported (now, or when a compile starts:
    graphpass calls this on import and whenever a backend with static shapes is made, so a
    ``torch._dynamo.reset()``, which drops Dynamo's callbacks, loses nothing). Returns whether the first is in
    place."""
    with _lock:
        if not _installed:
            _installed.append(_register())
        if not _register_exporting():
            from torch._dynamo.callback import callback_handler

            if _on_compile_start not in callback_handler.start_callbacks:
                callback_handler.register_start_callback(_on_compile_start)
        return _installed[0]


def _on_compile_start(_args: Any) -> None:
    """Dynamo's compile-start callback until transformers' substitute is registered (then it removes itself)."""
    with _lock:
        if not _register_exporting():
            return
    from torch._dynamo.callback import callback_handler

    if _on_compile_start in callback_handler.start_callbacks:
        callback_handler.remove_start_callback(_on_compile_start)


_exporting_done: list[bool] = []  # [True] once transformers' is_torchdynamo_exporting has its substitute


def _register_exporting() -> bool:
    """Substitute transformers' ``is_torchdynamo_exporting`` under Dynamo (see the module docstring), if
    transformers is imported. Returns whether nothing is left to do (registered, or it cannot be)."""
    if _exporting_done:
        return True
    module = sys.modules.get("transformers.utils.import_utils")
    original = getattr(module, "is_torchdynamo_exporting", None)
    if original is None:
        return False
    _exporting_done.append(True)
    frontend = _copy_of(original)

    def is_torchdynamo_exporting() -> bool:
        if _pads_now():
            return _export_running()
        return frontend()

    try:
        torch.compiler.substitute_in_graph(original)(is_torchdynamo_exporting)
    except Exception as exc:  # noqa: BLE001 - a signature transformers changed, a substitute registered first
        log.debug("not substituting transformers' is_torchdynamo_exporting under Dynamo: %s", exc)
    return True


@torch._dynamo.assume_constant_result
def _pads_now() -> bool:
    return _pads_to_buckets(_current_backend())


@torch._dynamo.assume_constant_result
def _export_running() -> bool:
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def _register() -> bool:
    try:
        module = importlib.import_module("torch._higher_order_ops.associative_scan")
        original = module.associative_scan
    except (ImportError, AttributeError):
        log.debug("torch has no associative_scan: Mamba (v1) scans trace as torch decides")
        return False
    frontend = _copy_of(original)
    cuda_only = _refuses_pointwise_off_cuda(original.__code__)

    def associative_scan(combine_fn, xs, dim, reverse=False, combine_mode="pointwise"):
        if combine_mode == "generic" and _one_op_wanted():
            if cuda_only:
                return _one_scan_op(combine_fn, xs, dim, reverse)
            combine_mode = "pointwise"
        return frontend(combine_fn, xs, dim, reverse=reverse, combine_mode=combine_mode)

    try:
        torch.compiler.substitute_in_graph(original)(associative_scan)
    except Exception as exc:  # a signature torch changed, a substitute someone else registered, an older torch
        log.debug("not substituting torch's associative_scan under Dynamo: %s", exc)
        return False
    return True


def _copy_of(fn: types.FunctionType) -> types.FunctionType:
    """Another function object with ``fn``'s code, defaults and closure: what a substitute calls, since calling
    ``fn`` itself from inside its substitute would be substituted again."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _refuses_pointwise_off_cuda(code: types.CodeType) -> bool:
    """Whether torch's ``associative_scan`` (its code object) refuses ``combine_mode="pointwise"`` for tensors off
    CUDA, as torch 2.9's does (torch 2.10 dropped that check)."""
    for const in code.co_consts:
        if isinstance(const, str) and "need to be on CUDA" in const:
            return True
        if isinstance(const, types.CodeType) and _refuses_pointwise_off_cuda(const):
            return True
    return False


def _one_scan_op(combine_fn: Any, xs: Any, dim: int, reverse: bool) -> Any:
    """torch's ``associative_scan`` with ``combine_mode="pointwise"`` without its CUDA-only check (torch 2.9): the
    steps of its pointwise branch, one ``associative_scan_op`` over the leaves moved to dim 0. Off CUDA the op runs
    torch's generic decomposition (see the module docstring), so the device does not matter to it."""
    from torch._higher_order_ops.associative_scan import associative_scan_op, wrap_combine_fn_flat
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten(xs)
    dim = dim % leaves[0].ndim
    leaves = [torch.movedim(x, dim, 0) for x in leaves]
    if reverse:
        leaves = [torch.flip(x, [0]) for x in leaves]
    flat_fn = functools.partial(wrap_combine_fn_flat, combine_fn=combine_fn, spec=spec, num_leaves=len(leaves))
    out = associative_scan_op(flat_fn, leaves, additional_inputs=())
    if reverse:
        out = [x.flip([0]) for x in out]
    return pytree.tree_unflatten([torch.movedim(x, 0, dim) for x in out], spec)


# Evaluated by Dynamo at trace time, its result a constant of the trace (no guard): what it reads, the backend of
# the frame being compiled and the caller's source, does not change for that frame.
@torch._dynamo.assume_constant_result
def _one_op_wanted() -> bool:
    return _pads_now() and _caller_is_proven()


def _current_backend() -> Any:
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # not tracing
        return None
    return getattr(getattr(tx, "output", None), "compiler_fn", None)


def _pads_to_buckets(fn: Any) -> bool:
    """Whether the compiler Dynamo hands this graph to is a graphpass backend configured with static shapes
    (unwrapping torch.compile's and Dynamo's wrappers). A graphpass backend says so itself
    (``graphpass_pads_to_buckets(options)``: the backend object, and the function registered as ``"graphpass"``,
    which reads the ``options=`` of torch.compile's wrapper): this module does not import the backend above it."""
    seen: set[int] = set()
    options: Any = None
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        pads = getattr(fn, "graphpass_pads_to_buckets", None)
        if callable(pads):
            try:
                return bool(pads(options))
            except Exception:  # noqa: BLE001 - the compile itself reports a broken backend
                return False
        kwargs = getattr(fn, "kwargs", None)
        if isinstance(kwargs, dict) and "options" in kwargs:
            options = kwargs["options"]
        fn = (
            getattr(fn, "_torchdynamo_orig_backend", None)
            or getattr(fn, "compiler_fn", None)
            or getattr(fn, "__wrapped__", None)
        )
    return False


def _caller_is_proven() -> bool:
    """Whether the frame that called ``associative_scan`` is one of :data:`ONE_OP_CALLERS`, with its proof's
    source digest."""
    from ..tensor_utils import traced_user_stack
    from .causal_functions import is_proven_source

    stack = traced_user_stack()
    if len(stack) < 2:
        return False
    caller = stack[-2]  # stack[-1] is the substitute above
    return caller.name in ONE_OP_CALLERS and is_proven_source(caller.filename, caller.name)
