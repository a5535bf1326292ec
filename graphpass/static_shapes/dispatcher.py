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

Graphs whose plan was refused (padding not proven safe) never get here: graphpass compiles them
as the dynamic graphs Dynamo traced, with one warning naming the node and the reason. A call
larger than the largest bucket runs the unpadded graph with dynamic shapes (warned once), compiled
once for all such sizes from the symbolic values Dynamo traced (or per size while Dynamo's graph is
still the static one of its first call).
"""

from __future__ import annotations

import contextlib
import warnings
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
        if isinstance(val, torch.Tensor) and val.dim() == 0 and ph.users and all(
            u.op == "call_method" and u.target == "item" for u in ph.users
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


class BucketDispatcher:
    def __init__(self, gm: torch.fx.GraphModule, plan: Any, cfg: StaticShapesConfig, delegate: Delegate,
                 log: list[str] | None = None) -> None:
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
        symbolic = any(isinstance(f, torch.SymInt) or (isinstance(f, torch.Tensor) and any(
            isinstance(d, torch.SymInt) for d in f.shape)) for f in fakes)
        if not symbolic or any(f is None for f in fakes):
            return None  # a static graph (Dynamo has not seen a second size yet): compile per size
        gm = copy_graph(source)
        _fold_scalars(gm, args, self.scalars)  # lifted Python scalars (eps): part of the key
        try:
            with _floats_specialized(fakes):
                return compile_with_delegate(gm, fakes, self.delegate)
        except Exception as exc:  # a delegate that cannot take fake inputs: fall back per size
            self.log.append(f"static_shapes: dynamic fallback not compiled ({type(exc).__name__}: {exc}); per size instead")
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
            self._warn(f"graphpass static_shapes: {plan.invalid_buckets[bad[0]].warning(bad[0])}; running it unpadded "
                       "with dynamic shapes")
            return self._run_unpadded(args, self._shape_key(args))
        subs = {sym: b for sym, b in buckets.items()}
        others = tuple((i, int(a)) for i, a in enumerate(args) if isinstance(a, int) and i not in plan.size_inputs)
        key = (tuple(sorted((str(s), b) for s, b in subs.items())), others,
               tuple(args[i].item() for i in self.scalars))
        padded = list(args)
        for i, expr in plan.size_inputs.items():
            padded[i] = int(expr.subs(subs))
        for i, dims in plan.pad.items():
            padded[i] = self._stage(key, i, args[i], dims, subs)
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compiled[key] = _compile_bucket(copy_graph(self.gm), padded, self.delegate, self.scalars)
            self.log.append(f"static_shapes: compiled bucket {dict((str(s), b) for s, b in subs.items())}")
        with running_bucket(max(subs.values())):  # capture steps are named after the bucket
            outs = fn(*padded)
        return self._slice(outs, sizes)

    @staticmethod
    def _shape_key(args: Sequence[Any]) -> tuple:
        return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args if isinstance(a, (torch.Tensor, int)))

    def _warn_untied(self, sizes: dict) -> None:
        """An input padded with a bucketed dim (equal to it when traced) differs from it in this call."""
        pairs = ", ".join(f"{t}={sizes[t]} vs {sym}={sizes[sym]}" for t, sym in self.plan.ties.items() if sizes[t] != sizes[sym])
        self._warn(f"graphpass static_shapes: inputs padded together with the bucketed dim have other lengths in this call "
                   f"({pairs}); running it unpadded with dynamic shapes")

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
