"""``graphpass.audit``: which variable-size allocations could become fixed-size preallocated buffers.

Dynamo traces ``fn(*inputs)`` with the dims named in ``dynamic=`` marked dynamic; every graph is
lowered to aten by AOTAutograd (forward and, in training mode, backward); every aten node that
allocates a tensor with a symbolic size, or a size only known from tensor values, becomes one
:class:`AllocationRow` with its source line, symbolic shape, upper bound and a verdict:

``YES``      the size depends only on input sizes and has a finite bound: one max-size buffer,
             sliced per call, works.
``PARTIAL``  bounded, but a max-size buffer is a poor fit (see :data:`RULES`).
``NO``       data-dependent size, no upper bound, or inside an activation-checkpoint region.

The graphs run eagerly on the example inputs (to get past graph breaks); nothing is compiled.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ConfigError
from .allocation_analysis import _analyze, _int_oo
from .allocation_rows import RULES, VERDICTS, AllocationRow, AuditReport, DynamicDim  # noqa: F401 (re-exported)

__all__ = ["audit", "AuditReport", "AllocationRow", "VERDICTS", "RULES"]

# ------------------------------------------------------------------------- argument checking


def _target(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn.forward if isinstance(fn, torch.nn.Module) else fn


def _bind_inputs(fn: Callable[..., Any], inputs: tuple) -> dict[str, Any]:
    try:
        sig = inspect.signature(_target(fn))
    except (TypeError, ValueError) as exc:
        raise ConfigError("dynamic", fn, f"cannot read the parameter names of {fn!r}: {exc}") from None
    try:
        bound = sig.bind(*inputs)
    except TypeError as exc:
        raise ConfigError("inputs", inputs, f"the example inputs do not fit {sig}: {exc}") from None
    return {
        name: value
        for name, value in bound.arguments.items()
        if sig.parameters[name].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _normalize_dynamic(dynamic: Any, named: dict[str, Any], names: list[str]) -> dict[str, dict[int, tuple]]:
    """``{"x": 0}``, ``{"x": (0, 1)}``, ``{"x": {0: (2, 1024)}}`` -> ``{"x": {0: (2, 1024)}}``."""
    if not isinstance(dynamic, dict) or not dynamic:
        raise ConfigError("dynamic", dynamic, "expected a non-empty dict {input name: dim | dims | {dim: (min, max)}}")
    out: dict[str, dict[int, tuple]] = {}
    for name, spec in dynamic.items():
        entry = {name: spec}
        if name not in named:
            known = ", ".join(names) or "none"
            raise ConfigError("dynamic", entry, f"{name!r} is not an input of the function (inputs: {known})")
        t = named[name]
        if not isinstance(t, torch.Tensor):
            raise ConfigError("dynamic", entry, f"{name!r} is a {type(t).__name__}, not a tensor")
        if _is_int(spec):
            dims: dict[Any, Any] = {spec: None}
        elif isinstance(spec, (tuple, list)) and spec and all(_is_int(d) for d in spec):
            dims = {d: None for d in spec}
        elif isinstance(spec, dict) and spec:
            dims = dict(spec)
        else:
            raise ConfigError("dynamic", entry, "expected a dim, a tuple of dims, or {dim: (min, max)}")
        norm: dict[int, tuple] = {}
        for dim, rng in dims.items():
            if not _is_int(dim) or not -t.dim() <= dim < t.dim():
                raise ConfigError(
                    "dynamic", entry, f"dim {dim!r} is out of range for {name!r} of shape {tuple(t.shape)}"
                )
            d = dim % t.dim()
            lo, hi = _range(rng, entry)
            size = t.shape[d]
            if (lo is not None and size < lo) or (hi is not None and size > hi):
                raise ConfigError("dynamic", entry, f"the example {name}.size({d}) = {size} is outside [{lo}, {hi}]")
            norm[d] = (lo, hi)
        out[name] = norm
    return out


def _range(rng: Any, entry: dict) -> tuple[int | None, int | None]:
    if rng is None:
        return None, None
    if isinstance(rng, (tuple, list)) and len(rng) == 2 and all(v is None or _is_int(v) for v in rng):
        lo, hi = rng
        if lo is not None and lo < 0:
            raise ConfigError("dynamic", entry, f"min {lo} is negative")
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError("dynamic", entry, f"min {lo} is larger than max {hi}")
        return lo, hi
    raise ConfigError("dynamic", entry, f"a range must be (min, max) of ints or None, got {rng!r}")


def _normalize_max_sizes(
    max_sizes: Any, dyn: dict[str, dict[int, tuple]], named: dict[str, Any]
) -> dict[tuple[str, int], int]:
    """``{"x": 1024}`` (every dynamic dim of x) or ``{"x": {0: 1024}}`` -> ``{("x", 0): 1024}``."""
    if max_sizes is None:
        return {}
    if not isinstance(max_sizes, dict):
        raise ConfigError("max_sizes", max_sizes, "expected {input name: max | {dim: max}}")
    out: dict[tuple[str, int], int] = {}
    for name, spec in max_sizes.items():
        entry = {name: spec}
        if name not in dyn:
            raise ConfigError("max_sizes", entry, f"{name!r} has no dim in dynamic=")
        items = {d: spec for d in dyn[name]} if _is_int(spec) else spec
        if not isinstance(items, dict):
            raise ConfigError("max_sizes", entry, "expected a max (int) or {dim: max}")
        for dim, hi in items.items():
            if not _is_int(hi) or hi < 0:
                raise ConfigError("max_sizes", entry, f"max {hi!r} is not a non-negative int")
            ndim = named[name].dim()
            if not _is_int(dim) or not -ndim <= dim < ndim or dim % ndim not in dyn[name]:
                raise ConfigError("max_sizes", entry, f"dim {dim!r} of {name!r} is not marked in dynamic=")
            size = named[name].shape[dim % ndim]
            if hi < size:
                raise ConfigError(
                    "max_sizes", entry, f"max {hi} is below the example {name}.size({dim % ndim}) = {size}"
                )
            out[(name, dim % ndim)] = hi
    return out


# ----------------------------------------------------------------------------------- tracing


@dataclass
class _Graph:
    label: str
    gm: torch.fx.GraphModule


class _Recorder:
    """The Dynamo backend: lower each graph with AOTAutograd and keep the aten graphs."""

    def __init__(self) -> None:
        self.graphs: list[_Graph] = []
        self.dynamo_graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

        index = len(self.dynamo_graphs)
        self.dynamo_graphs.append(gm)

        def record(kind: str):
            def compiler(g: torch.fx.GraphModule, _inputs):
                self.graphs.append(_Graph(f"{index}/{kind}", g))
                return make_boxed_func(g.forward)

            return compiler

        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=record("forward"),
            bw_compiler=record("backward"),
            inference_compiler=record("inference"),
        )


# Names for fresh entry code objects: unique per process, so two audits (two threads, two models)
# never share Dynamo's cache entry. itertools.count's __next__ is atomic; the lock makes it explicit.
_ENTRY_NAMES = itertools.count(1)
_ENTRY_LOCK = threading.Lock()


def _fresh_entry(fn: Callable[..., Any]) -> types.FunctionType:
    """A wrapper with a code object of its own, so Dynamo's cache of earlier audits never answers."""

    def entry(*args):
        return fn(*args)

    with _ENTRY_LOCK:
        n = next(_ENTRY_NAMES)
    code = entry.__code__.replace(co_name=f"graphpass_audit_{n}")
    return types.FunctionType(code, entry.__globals__, code.co_name, None, entry.__closure__)


def _run(fn: Callable[..., Any], inputs: tuple, dyn: dict, names: list[str], training: bool, strict: bool) -> _Recorder:
    # fresh tensor objects: the marks must not stick to the caller's tensors
    args = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]
    for name, dims in dyn.items():
        t = args[names.index(name)]
        for d, (lo, hi) in dims.items():
            if strict and (lo, hi) == (None, None):
                torch._dynamo.mark_dynamic(t, d)
            elif strict:  # torch 2.13 fails on a range with one end None
                torch._dynamo.mark_dynamic(t, d, min=0 if lo is None else lo, max=_int_oo() if hi is None else hi)
            else:
                torch._dynamo.maybe_mark_dynamic(t, d)
    rec = _Recorder()
    compiled = torch.compile(_fresh_entry(fn), backend=rec, dynamic=False)
    patch = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)
    with patch, torch.set_grad_enabled(training):
        compiled(*args)
    return rec


def _check_options(fn: Any, train: Any, partial_factor: Any, kw: dict[str, Any]) -> None:
    """:func:`audit`'s argument checks, before anything runs: a :class:`~graphpass.ConfigError` for the first bad
    one."""
    if kw:
        key = next(iter(kw))
        raise ConfigError(
            key, kw[key], "unknown option of graphpass.audit (known: dynamic, max_sizes, train, partial_factor)"
        )
    if not callable(fn):
        raise ConfigError("fn", fn, "expected a module or a function")
    if isinstance(partial_factor, bool) or not isinstance(partial_factor, (int, float)) or partial_factor < 1:
        raise ConfigError("partial_factor", partial_factor, "expected a number >= 1")
    if train is not None and not isinstance(train, bool):
        raise ConfigError("train", train, "expected True, False or None")


def audit(
    fn: Any,
    *inputs: Any,
    dynamic: dict[str, int | tuple[int, ...] | dict],
    max_sizes: dict | None = None,
    train: bool | None = None,
    partial_factor: float = 16.0,
    **kw: Any,
) -> AuditReport:
    """Trace ``fn(*inputs)`` with the ``dynamic`` dims symbolic and report every variable-size allocation.

    ``dynamic`` maps a parameter name of ``fn`` (or ``fn.forward``) to the dim(s) that vary:
    ``{"x": 0}``, ``{"x": (0, 1)}``, ``{"x": {0: (2, 1024)}}`` (a range ``(min, max)``, either may be
    ``None``). ``max_sizes`` gives upper bounds where ``dynamic`` has no max: ``{"x": 1024}`` or
    ``{"x": {0: 1024}}``. ``train``: trace forward and backward with grad enabled; the default is
    training when an input requires grad or ``fn`` is a module in training mode with trainable
    parameters, else inference under ``no_grad``. ``partial_factor``: bound-to-example ratio above
    which a bounded allocation is PARTIAL. Bad arguments raise :class:`~graphpass.ConfigError`
    before anything runs.
    """
    _check_options(fn, train, partial_factor, kw)
    named = _bind_inputs(fn, inputs)
    names = list(named)
    dyn = _normalize_dynamic(dynamic, named, names)
    user_max = _normalize_max_sizes(max_sizes, dyn, named)
    # max_sizes fills in the max where dynamic= gave none
    dyn = {
        name: {d: (lo, hi if hi is not None else user_max.get((name, d))) for d, (lo, hi) in dims.items()}
        for name, dims in dyn.items()
    }
    if train is None:
        train = any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs) or (
            isinstance(fn, torch.nn.Module) and fn.training and any(p.requires_grad for p in fn.parameters())
        )

    notes: list[str] = []
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    try:
        rec = _run(fn, inputs, dyn, names, train, strict=True)
    except ConstraintViolationError as exc:
        first = next(
            (ln.strip() for ln in str(exc).splitlines() if ln.strip().startswith("-")), str(exc).splitlines()[0]
        )
        notes.append(
            "note: the code narrows or specializes a dim marked in dynamic= (mark_dynamic refused: "
            f"{first.lstrip('- ')}); audited again with maybe_mark_dynamic, the declared ranges applied to the bounds"
        )
        rec = _run(fn, inputs, dyn, names, train, strict=False)

    return _analyze(rec, named, dyn, train, float(partial_factor), notes)
