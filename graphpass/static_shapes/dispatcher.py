"""Run a symbolic-shape graph as one static graph per bucket.

:class:`BucketDispatcher` is what graphpass returns to Dynamo for a graph with a bucketing plan
(:mod:`graphpass.passes.plan_static_shapes`). Each call:

1. reads the actual size ``L`` of each bucketed dim and picks the smallest bucket ``B >= L``;
2. copies every padded input into a persistent staging buffer of the bucket's shape (allocated
   once per bucket and input; the padding is filled with the pad value), so input addresses are
   stable from call to call, as CUDA graphs need;
3. runs the bucket's graph, compiled by the delegate the first time the bucket is used with the
   padded inputs, so its sizes are all static;
4. slices every output dim that depends on ``L`` back (``B + b`` -> ``L + b``).

On a lazy-tensor device (``xla``, ``lazy``: torch_xla, and Neuron through it) every tensor operation
outside a compiled graph is itself recorded and compiled for its exact shapes, so a device-side
copy into the staging buffer and a device-side slice of an output would cost two XLA compilations
per distinct length. There steps 2 and 4 run on the host instead: the input is copied to a host
staging buffer, padded there and transferred to the device; an output is transferred to the host,
sliced and transferred back. Transfers compile nothing, so the only XLA compilations are the
bucket graphs' own.

With ``static_shapes={..., "verify": True}`` (the checked mode) the first call that lands in a bucket
(per compiled graph) also runs a second time, with the padding of every padded input the proof does not
read as zeros (``BucketPlan.zero_inputs``) filled with another value (:func:`other_fill`), from separate
buffers; the real rows of both results are compared bitwise. Equal, or different only within the
dtype's rounding (a mixture of experts routes the padding tokens too, which changes the sizes of its
experts' GEMMs): the bucket is verified and costs nothing more. Otherwise the bucket is refused (its calls run unpadded with dynamic shapes, with one
warning naming the bucket, the output and the largest difference), and that call returns the unpadded
result. Inputs the graph writes in place are restored between the runs (:meth:`BucketDispatcher._verify`).

Graphs whose plan was refused (padding not proven safe) never get here: graphpass compiles them
as the dynamic graphs Dynamo traced, with one warning naming the node and the reason. A call
larger than the largest bucket runs the unpadded graph with dynamic shapes (warned once), compiled
once for all such sizes from the symbolic values Dynamo traced (or per size while Dynamo's graph is
still the static one of its first call).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from graphpass.backends import Delegate

from ..fx_utils import copy_graph, shape_env_hints
from ..tensor_utils import shape_env_of
from ..bucket_context import running_bucket
from .config import LAZY_DEVICE_TYPES, StaticShapesConfig, pads_on_host  # noqa: F401 (re-exported)


def scalar_items(gm: torch.fx.GraphModule) -> list[int]:
    """Placeholders Dynamo lifted from Python floats (``eps``, ``norm_type``): 0-d tensors read
    only through ``.item()``."""
    out = []
    for i, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        val = ph.meta.get("example_value")
        if (
            isinstance(val, torch.Tensor)
            and val.dim() == 0
            and ph.users
            and all(u.op == "call_method" and u.target == "item" for u in ph.users)
        ):
            out.append(i)
    return out


def _fold_scalars(gm: torch.fx.GraphModule, args: Sequence[Any], indices: list[int]) -> None:
    """Replace ``x.item()`` of lifted scalars by their value in this call (part of the bucket key):
    a graph compiled outside Dynamo's trace cannot read a tensor's value while tracing it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i in indices:
        value = args[i].item()
        for user in list(placeholders[i].users):
            user.replace_all_uses_with(value)
            gm.graph.erase_node(user)
    gm.graph.lint()
    gm.recompile()


def _compile_bucket(gm: torch.fx.GraphModule, args: Sequence[Any], delegate: Delegate, scalars: list[int]) -> Callable:
    """Compile a copy of the graph for one concrete call: lifted scalars folded, and size inputs
    (Python ints here) baked in and dropped from the signature, so the delegate sees a fully
    static graph with tensor inputs only (CUDA-graph backends need exactly that)."""
    from ..delegation import compile_with_delegate

    _fold_scalars(gm, args, scalars)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    baked = [i for i, a in enumerate(args) if isinstance(a, int) and not isinstance(a, bool)]
    for i in baked:
        placeholders[i].replace_all_uses_with(args[i])
        gm.graph.erase_node(placeholders[i])
    gm.graph.lint()
    gm.recompile()
    keep = [i for i in range(len(args)) if i not in set(baked)]
    fn = compile_with_delegate(gm, [args[i] for i in keep], delegate)
    if not baked:
        return fn
    return lambda *call_args: fn(*(call_args[i] for i in keep))


@contextlib.contextmanager
def _floats_specialized(fakes: Sequence[Any]):
    """Compile outside Dynamo with the float symbols Dynamo specialized kept specialized.

    AOTAutograd's scalar-tensorify pass asks Dynamo to restart analysis when it meets a float
    symbol Dynamo already specialized but that is not in Dynamo's (private) list of forced
    specializations, which Dynamo clears after its compile. There is no Dynamo to restart here:
    the list is filled for the duration of this compile and restored afterwards."""
    try:
        from torch._dynamo.symbolic_convert import TensorifyState
        from torch.utils._sympy.symbol import SymT, symbol_is_type
    except ImportError:  # pragma: no cover - other torch versions
        yield
        return
    shape_env = shape_env_of(list(fakes))
    saved = set(TensorifyState.force_specializations)
    if shape_env is not None:
        for sym in shape_env_hints(shape_env):
            if symbol_is_type(sym, SymT.FLOAT):
                TensorifyState.specialize(str(sym))
    try:
        yield
    finally:
        TensorifyState.force_specializations.clear()
        TensorifyState.force_specializations.update(saved)


def other_fill(pad: float, dtype: torch.dtype) -> float | int | bool:
    """The checked mode's second padding value for an input of ``dtype`` padded with ``pad``.

    Floating point: ``pad + 1`` (``pad - 1``, 0 or 1 where that rounds back to ``pad`` or ``pad`` is not finite): a
    finite value of the scale of real activations, so every sum, mean, max or softmax that reads the padding moves,
    while a sound proof that multiplies padding rows by exact zeros (an additive mask's zero attention weights) still
    gets exact zeros (``0 * inf`` and ``0 * nan`` are NaN: a false alarm). Integers: one step from ``pad`` towards
    1 (``pad - 1`` when ``pad >= 1``, else ``pad + 1``): still a valid index wherever ``pad`` and 0 are (an
    embedding's vocabulary: ``pad + 1`` past a last-token pad id would index out of range). Booleans: ``not pad``."""
    if dtype == torch.bool:
        return not pad
    if not (dtype.is_floating_point or dtype.is_complex):
        p = int(pad)
        return p - 1 if p >= 1 else p + 1
    for alt in (pad + 1, pad - 1, 0.0, 1.0):
        if (
            abs(alt) != float("inf")
            and alt == alt
            and bool(torch.tensor(alt, dtype=dtype) != torch.tensor(pad, dtype=dtype))
        ):
            return alt
    return 1.0  # pragma: no cover - every candidate rounds to pad: not a float dtype we know


def _tensors(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _kept(result: Any) -> tuple[Any, Any]:
    """``(to return, to compare)``: copies of ``result`` that the next run of the same graph cannot overwrite (its
    outputs may alias the graph's own buffers: CUDA graphs' static outputs). On a lazy-tensor device the outputs are
    values already: they are returned as they are and compared from a host copy."""

    def keep(t: Any) -> tuple[Any, Any]:
        if not isinstance(t, torch.Tensor):
            return t, t
        if pads_on_host(t):
            return t, t.cpu()
        c = t.clone()
        return c, c

    if not isinstance(result, (tuple, list)):
        return keep(result)
    pairs = [keep(t) for t in result]
    wrap = tuple if isinstance(result, tuple) else list
    return wrap(p[0] for p in pairs), wrap(p[1] for p in pairs)


def first_difference(a: Any, b: Any) -> tuple[int, str] | None:
    """``(output index, what differs)`` for the first output where ``a`` and ``b`` are not bitwise equal (NaN at the
    same positions counts as equal), or None. Compared on the host for a lazy-tensor device."""
    for k, (x, y) in enumerate(zip(_tensors(a), _tensors(b))):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x is not y and x != y:
                return k, f"{x!r} vs {y!r}"
            continue
        x, y = (x.cpu() if pads_on_host(x) else x), (y.cpu() if pads_on_host(y) else y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return k, f"shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
        if torch.equal(x, y):
            continue
        if x.is_floating_point() or x.is_complex():
            nx, ny = x.isnan(), y.isnan()
            same_nan = torch.equal(nx, ny)
            if same_nan and torch.equal(x.masked_fill(nx, 0), y.masked_fill(ny, 0)):
                continue
            both = ~(nx | ny)
            diff = (x[both] - y[both]).abs()
            largest = f"largest difference {diff.max().item():.6g}" if diff.numel() else "no finite pair"
            return k, largest + ("" if same_nan else f", NaN in {int((nx ^ ny).sum())} positions of one only")
        diff = (x.long() - y.long()).abs() if x.dtype != torch.bool else (x ^ y).long()
        return k, f"largest difference {int(diff.max())}"
    return None


#: dtype -> (rtol, atol): torch.testing.assert_close's defaults (a floating type not listed: bfloat16's)
ROUNDING = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def within_rounding(a: Any, b: Any) -> bool:
    """Every floating-point output of ``a`` and ``b`` close within its dtype's rounding (:data:`ROUNDING`:
    float32 ``rtol=1.3e-6, atol=1e-5``, bfloat16 ``1.6e-2, 1e-5``, ...; NaN where the other is NaN), every other
    output equal. The accuracy bucketing promises (padded results match unpadded ones within rounding)."""
    for x, y in zip(_tensors(a), _tensors(b)):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x is not y and x != y:
                return False
            continue
        x, y = (x.cpu() if pads_on_host(x) else x), (y.cpu() if pads_on_host(y) else y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not (x.is_floating_point() or x.is_complex()):
            if not torch.equal(x, y):
                return False
            continue
        rtol, atol = ROUNDING.get(x.dtype, ROUNDING[torch.bfloat16])
        if not torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True).all():
            return False
    return True


@dataclass
class _CheckedRun:
    """One checked first call of a bucket (:meth:`BucketDispatcher._verify`): what it runs, and the inputs the graph
    writes in place as they were before the call (``before``) and after its first run (``after``)."""

    key: tuple
    fn: Callable
    slice: Callable  # BucketDispatcher._slice: outputs -> their real rows
    args: Sequence[Any]
    padded: list
    sizes: dict
    subs: dict
    first: Any = None  # the first run's results, kept (:func:`_kept`)
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The bucket, as the messages name it: its size, or each symbol's where the graph has several."""
        buckets = self.key[0]
        return ", ".join(f"{s}={b}" for s, b in buckets) if len(buckets) > 1 else str(buckets[0][1])

    def run(self, inputs: list) -> Any:
        """The bucket's graph on ``inputs``, its outputs sliced to this call's sizes."""
        with running_bucket(max(self.subs.values())):
            return self.slice(self.fn(*inputs), self.sizes)


class BucketDispatcher:
    def __init__(
        self,
        gm: torch.fx.GraphModule,
        plan: Any,
        cfg: StaticShapesConfig,
        delegate: Delegate,
        log: list[str] | None = None,
    ) -> None:
        self.gm = gm
        self.plan = plan
        self.cfg = cfg
        self.delegate = delegate
        self.compiled: dict[tuple, Callable] = {}  # (bucket per symbol, other size inputs) -> compiled fn
        self.staging: dict[tuple, torch.Tensor] = {}  # (bucket key, input index) -> persistent padded buffer
        self.oversize: dict[tuple, Callable] = {}  # graphs for calls beyond the largest bucket
        self.dynamic_fallback: bool | None = None  # None: not tried yet; False: per size instead
        self.warned = False
        self.log = log if log is not None else []
        self.scalars = scalar_items(gm)
        self.verified: dict[
            tuple, str
        ] = {}  # checked mode: bucket key -> "verified" / "unchecked: why" / "refused: why"
        self._written: list[int] | None = None  # checked mode: placeholders the graph writes in place

    # -- helpers -------------------------------------------------------------------------------
    def _warn(self, msg: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(msg, stacklevel=3)
            self.log.append(msg)

    def _run_unpadded(self, args: Sequence[Any], key: tuple) -> Any:
        """A call beyond the largest bucket: the unpadded graph (without fixed-size buffer slices),
        compiled once with symbolic sizes (per lifted-scalar values), or for this exact size when
        that is not possible (a static graph, or a delegate that cannot compile from fake values)."""
        dyn_key = ("dynamic", tuple(args[i].item() for i in self.scalars))
        fn = self.oversize.get(dyn_key) or self.oversize.get(key)
        if fn is None:
            source = self.plan.unsliced if self.plan.unsliced is not None else self.gm
            if self.dynamic_fallback is not False:
                fn = self._compile_dynamic(source, args)
                self.dynamic_fallback = fn is not None  # tried once: not again for every size
            if fn is not None:
                self.oversize[dyn_key] = fn
            else:
                fn = self.oversize[key] = _compile_bucket(copy_graph(source), list(args), self.delegate, self.scalars)
        return fn(*args)

    def _compile_dynamic(self, source: torch.fx.GraphModule, args: Sequence[Any]) -> Callable | None:
        """The graph as Dynamo traced it, with symbolic sizes, compiled once for every size beyond
        the largest bucket: the delegate gets the placeholders' fake values (sizes as Dynamo's
        symbols) instead of this call's tensors, so it does not specialize to this size."""
        from ..delegation import compile_with_delegate

        fakes = [ph.meta.get("example_value") for ph in source.graph.nodes if ph.op == "placeholder"]
        symbolic = any(
            isinstance(f, torch.SymInt)
            or (isinstance(f, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in f.shape))
            for f in fakes
        )
        if not symbolic or any(f is None for f in fakes):
            return None  # a static graph (Dynamo has not seen a second size yet): compile per size
        gm = copy_graph(source)
        _fold_scalars(gm, args, self.scalars)  # lifted Python scalars (eps): part of the key
        try:
            with _floats_specialized(fakes):
                return compile_with_delegate(gm, fakes, self.delegate)
        except Exception as exc:  # a delegate that cannot take fake inputs: fall back per size
            self.log.append(
                f"static_shapes: dynamic fallback not compiled ({type(exc).__name__}: {exc}); per size instead"
            )
            return None

    # -- the call --------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        plan = self.plan
        sizes = {sym: int(args[i].shape[d]) for sym, (i, d) in plan.symbols.items()}
        if any(sizes[t] != sizes[sym] for t, sym in plan.ties.items()):
            self._warn_untied(sizes)
            return self._run_unpadded(args, self._shape_key(args))
        for check in plan.call_checks:  # what the padding proof holds under (padding_proof.CallCheck)
            if not check.holds(args):
                self._warn(f"graphpass static_shapes: {check.why()}; running it unpadded with dynamic shapes")
                return self._run_unpadded(args, self._shape_key(args))
        buckets = {sym: self.cfg.bucket_for(n) for sym, n in sizes.items()}
        if any(b is None for b in buckets.values()):
            self._warn(
                f"graphpass static_shapes: size {max(sizes.values())} is larger than the largest bucket "
                f"{self.cfg.largest}; running it unpadded with dynamic shapes (add a bucket to avoid it)"
            )
            return self._run_unpadded(args, self._shape_key(args))
        bad = sorted({b for b in buckets.values() if b in plan.invalid_buckets})
        if bad:  # a typed reason (padding_proof.InvalidBucket) that words its own warning
            self._warn(
                f"graphpass static_shapes: {plan.invalid_buckets[bad[0]].warning(bad[0])}; running it unpadded "
                "with dynamic shapes"
            )
            return self._run_unpadded(args, self._shape_key(args))
        subs = {sym: b for sym, b in buckets.items()}
        others = tuple((i, int(a)) for i, a in enumerate(args) if isinstance(a, int) and i not in plan.size_inputs)
        key = (tuple(sorted((str(s), b) for s, b in subs.items())), others, tuple(args[i].item() for i in self.scalars))
        state = self.verified.get(key, "") if self.cfg.verify else ""
        if state.startswith("refused: "):
            self._warn(state[len("refused: ") :])
            return self._run_unpadded(args, self._shape_key(args))
        padded = list(args)
        for i, expr in plan.size_inputs.items():
            padded[i] = int(expr.subs(subs))
        for i, dims in plan.pad.items():
            padded[i] = self._stage(key, i, args[i], dims, subs)
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compiled[key] = _compile_bucket(copy_graph(self.gm), padded, self.delegate, self.scalars)
            self.log.append(f"static_shapes: compiled bucket {dict((str(s), b) for s, b in subs.items())}")
        if self.cfg.verify and key not in self.verified:
            return self._verify(key, fn, args, padded, sizes, subs)
        with running_bucket(max(subs.values())):  # capture steps are named after the bucket
            outs = fn(*padded)
        return self._slice(outs, sizes)

    # -- the checked mode -------------------------------------------------------------------------
    def _verify(self, key: tuple, fn: Callable, args: Sequence[Any], padded: list, sizes: dict, subs: dict) -> Any:
        """The first call of a bucket in the checked mode: run it as usual, then again with another padding fill for
        every padded input outside ``plan.zero_inputs`` (separate buffers: the staging buffers stay as they are),
        and compare the real rows bitwise (:meth:`_judge`). Inputs the graph writes in place (a static cache's slots)
        are restored to their values before the call for the second run, and to the first run's afterwards."""
        run = _CheckedRun(key, fn, self._slice, args, padded, sizes, subs)
        varied = {
            i: other_fill(self.plan.pad_values.get(i, 0.0), args[i].dtype)
            for i in self.plan.pad
            if i not in self.plan.zero_inputs and isinstance(args[i], torch.Tensor)
        }
        if not varied:  # every padding is one the proof may read as zeros: nothing to vary, no cost
            self.verified[key] = "unchecked: every padded input is one the proof reads as zero-padded"
            self.log.append(f"static_shapes: verify: bucket {run.name} not checked: {self.verified[key][11:]}")
            return run.run(padded)
        written = [i for i in self._written_inputs() if i not in self.plan.pad and isinstance(args[i], torch.Tensor)]
        versions = {i: a._version for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in self.plan.pad}
        run.before = self._save(args, written)
        result, run.first = _kept(run.run(padded))
        missed = [i for i, v in versions.items() if args[i]._version != v and i not in written]
        if missed:  # a write the graph's analysis did not see: a second run would apply it twice
            self.verified[key] = f"unchecked: the graph writes into input(s) {missed} in place"
            self._warn_verify(
                f"graphpass static_shapes: verify: bucket {run.name} not checked (the graph writes into "
                f"input(s) {missed} in place, and a second run would apply that twice); it stays padded"
            )
            return result
        run.after = self._save(args, written)
        self._restore(args, run.before)
        alt = list(padded)
        for i, fill in varied.items():
            alt[i] = self._padded_copy(args[i], self.plan.pad[i], subs, fill)
        if self._judge(run, run.run(alt), len(varied)):
            return result
        return self._run_unpadded(args, self._shape_key(args))

    def _judge(self, run: "_CheckedRun", second: Any, n_varied: int) -> bool:
        """Compare the checked run's results with the first run's; False: the bucket is refused (the inputs are as
        before the call, for the unpadded run). Equal, or different only within the dtype's rounding
        (:func:`within_rounding`: the padding changed the sizes real rows were computed with, as a mixture of
        experts' routing of the padding tokens does, not their values): verified. A larger difference is checked
        against a third run with the usual fill: when that one differs too, the graph is not deterministic (GPU
        atomics), the comparison says nothing about the padding, and the bucket is kept (warned)."""
        key, args = run.key, run.args
        diff = first_difference(run.first, second)
        if diff is None or (self.cfg.verify != "bitwise" and within_rounding(run.first, second)):
            self._restore(args, run.after)
            self.verified[key] = (
                "verified" if diff is None else f"verified within rounding (output {diff[0]}, {diff[1]})"
            )
            self.log.append(
                f"static_shapes: verify: bucket {run.name} {self.verified[key]}; padding of {n_varied} input(s) varied"
            )
            return True
        self._restore(args, run.before)
        for i, dims in self.plan.pad.items():  # the usual fill again (the first run may have written its buffers)
            run.padded[i] = self._stage(key, i, args[i], dims, run.subs)
        if (again := first_difference(run.first, run.run(run.padded))) is not None:
            self._restore(args, run.after)
            self.verified[key] = "unchecked: not bitwise deterministic"
            self._warn_verify(
                f"graphpass static_shapes: verify: bucket {run.name} not checked: two runs with the same "
                f"padding differ bitwise (output {again[0]}, {again[1]}), so the graph is not deterministic "
                "(atomics?) and a bitwise comparison says nothing about the padding; it stays padded "
                "(torch.use_deterministic_algorithms makes it checkable)"
            )
            return True
        self._restore(args, run.before)
        msg = (
            f"graphpass static_shapes: verify: bucket {run.name} refused: its real rows changed when the padding "
            f"did (output {diff[0]}, {diff[1]}), so the padding proof does not hold for this graph; calls landing "
            "in it run unpadded with dynamic shapes"
        )
        self.verified[key] = "refused: " + msg
        self.compiled.pop(key, None)
        for k in [k for k in self.staging if k[0] == key]:
            del self.staging[k]
        self._warn_verify(msg)
        return False

    def _warn_verify(self, msg: str) -> None:
        """What the checked mode found, said once per bucket: through :meth:`_warn`, or directly when another message
        already took this graph's one warning (a refused bucket must not go unsaid)."""
        if not self.warned:
            self._warn(msg)
            return
        warnings.warn(msg, stacklevel=4)
        self.log.append(msg)

    def _written_inputs(self) -> list[int]:
        """Placeholders the graph writes in place (through any view), found once: by the graph's ops, or by the
        version counter of the value Dynamo traced them with."""
        if self._written is None:
            from ..fx_utils import AliasIndex, example_of, find_write

            index = AliasIndex(self.gm.graph)
            phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
            self._written = [
                i
                for i, ph in enumerate(phs)
                if find_write(ph, index) is not None
                or (isinstance(v := example_of(ph), torch.Tensor) and v._version > 0)
            ]
        return self._written

    @staticmethod
    def _save(args: Sequence[Any], indices: list[int]) -> dict[int, torch.Tensor]:
        return {i: args[i].detach().clone() for i in indices}

    @staticmethod
    def _restore(args: Sequence[Any], saved: dict[int, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, t in saved.items():
                args[i].copy_(t)

    def _padded_copy(self, t: torch.Tensor, dims: tuple, subs: dict, fill: Any) -> torch.Tensor:
        """``t`` padded to the bucket in a new buffer, the padding filled with ``fill`` (on the host for a lazy-tensor
        device, then transferred)."""
        target = list(t.shape)
        for d, sym in dims:
            target[d] = subs[sym]
        on_host = pads_on_host(t)
        buf = torch.full(target, fill, dtype=t.dtype, device=torch.device("cpu") if on_host else t.device)
        view = buf
        for d, _ in dims:
            view = view.narrow(d, 0, t.shape[d])
        view.copy_(t.cpu() if on_host else t)
        return buf.to(t.device) if on_host else buf

    @staticmethod
    def _shape_key(args: Sequence[Any]) -> tuple:
        return tuple(
            tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args if isinstance(a, (torch.Tensor, int))
        )

    def _warn_untied(self, sizes: dict) -> None:
        """An input padded with a bucketed dim (equal to it when traced) differs from it in this call."""
        pairs = ", ".join(
            f"{t}={sizes[t]} vs {sym}={sizes[sym]}" for t, sym in self.plan.ties.items() if sizes[t] != sizes[sym]
        )
        self._warn(
            f"graphpass static_shapes: inputs padded together with the bucketed dim have other lengths in this call "
            f"({pairs}); running it unpadded with dynamic shapes"
        )

    def _stage(self, key: tuple, i: int, t: torch.Tensor, dims: tuple, subs: dict) -> torch.Tensor:
        """Copy ``t`` into this bucket's persistent buffer for input ``i`` and fill the padding (on a
        lazy-tensor device: a host buffer, transferred to the device afterwards)."""
        target = list(t.shape)
        for d, sym in dims:
            target[d] = subs[sym]
        on_host = pads_on_host(t)
        where = torch.device("cpu") if on_host else t.device
        buf = self.staging.get((key, i))
        if buf is None or list(buf.shape) != target or buf.dtype != t.dtype or buf.device != where:
            buf = torch.empty(target, dtype=t.dtype, device=where)
            self.staging[(key, i)] = buf
        view = buf
        for d, _ in dims:
            view = view.narrow(d, 0, t.shape[d])
        view.copy_(t.cpu() if on_host else t)
        pad = self.plan.pad_values.get(i, 0.0)
        for d, _ in dims:
            n = t.shape[d]
            if buf.shape[d] > n:
                buf.narrow(d, n, buf.shape[d] - n).fill_(pad)
        return buf.to(t.device) if on_host else buf

    def _slice(self, outs: Any, sizes: dict) -> Any:
        """Narrow each output's padded dims back to this call's sizes (on a lazy-tensor device: on
        the host, then transferred back)."""
        if not isinstance(outs, (tuple, list)):
            return outs
        result = list(outs)
        for k, spec in enumerate(self.plan.outputs):
            if spec is None or k >= len(result) or not isinstance(result[k], torch.Tensor):
                continue
            t = result[k]
            on_host = pads_on_host(t)
            view = t.cpu() if on_host else t
            for d, lin in enumerate(spec):
                if lin is not None:
                    sym, a, b = lin
                    view = view.narrow(d, 0, a * sizes[sym] + b)
            result[k] = view.to(t.device) if on_host else view
        return tuple(result) if isinstance(outs, tuple) else result
