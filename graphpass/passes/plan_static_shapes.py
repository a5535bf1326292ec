"""Static-shape bucketing plan: inserts nothing; fills ``ctx.analysis.bucket_plan``.

For a graph with symbolic sizes, it finds the symbol of each dim named in
``static_shapes["dims"]`` (from the example value of the input's placeholder), and records the
pad/slice contract at the graph boundary: which input dims to pad (every tensor input sized by
exactly that symbol), which size inputs become the bucket size, and how to slice each output dim
back (``s + b`` -> ``L + b``). Then it runs the padding-safety analysis: where an op mixes rows
along a padded dim (softmax, reductions, cumsum, sort, normalisation or attention over it) the plan
is refused with the node and the reason, and the graph runs as a dynamic graph instead, unless
the user declared a mask contract (``masked``) for that input. It also sets ``ctx.static_bounds``
(:meth:`BucketPlan.bounds`: symbol -> largest bucket) for :mod:`slice_static_buffers` when the plan holds, and keeps an
unsliced copy of the graph for the dynamic fallback (sizes beyond the largest bucket).

A graph whose marked dims are plain ints (Dynamo's first, exact-size trace) gets no plan. When
Dynamo will never make them symbolic (``torch._dynamo.config.automatic_dynamic_shapes`` off, as
``import torch_xla`` leaves it), it raises :class:`~graphpass.errors.DynamicShapesDisabledError`
instead of letting every length compile a static graph of its own.
Assumes :mod:`analyze_ownership` ran (input names).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import sympy
import torch

from .. import dynamo_records
from ..analysis import TensorOwnership
from ..errors import ConfigError
from ..fx_utils import example_of, is_symbolic, shape_env_hints, size_expr
from ..tensor_utils import shape_env_of
from ..torch_compat import source_name
from ..static_shapes.plan import BucketPlan  # noqa: F401 (re-exported)
from .base import GraphPass, PassContext


def _expr(s: Any) -> sympy.Expr | None:
    """A symbolic size's expression; None for a fixed size."""
    return size_expr(s) if is_symbolic(s) else None


def _linear(expr: sympy.Expr, sym: sympy.Symbol) -> tuple[int, int] | None:
    """(1, b) when expr == sym + b (b an integer constant), else None.

    Only ``L + b`` can be sliced back: a merged dim such as ``B*L`` interleaves padding rows with
    real ones, so its first ``B*L`` rows are not the real rows. A size that is no polynomial in
    ``sym`` (torch's ``FloorDiv``, as in ``(s*s)//s`` when Dynamo gave a batch equal to the length the
    same symbol) cannot be sliced back either.
    """
    try:
        poly = sympy.Poly(expr, sym) if expr.free_symbols == {sym} else None
    except sympy.PolynomialError:
        return None
    if poly is None or poly.degree() != 1:
        return None
    a, b = (int(c) for c in poly.all_coeffs())
    return (a, b) if a == 1 else None


class PlanStaticShapes(GraphPass):
    name = "plan_static_shapes"
    requires = ("analyze_ownership",)

    def should_run(self, ctx: PassContext) -> bool:
        return ctx.config.static_shapes is not None

    def run(self, ctx: PassContext) -> bool:
        cfg = ctx.config.static_shapes
        placeholders = [n for n in ctx.gm.graph.nodes if n.op == "placeholder"]
        inputs = _Inputs(ctx, placeholders)
        found = self._bucket_symbols(ctx, inputs)
        if found is None:
            return False  # not bucketed; the reason is in ctx.log
        symbols, masked_syms = found
        ties = _tied_symbols(placeholders, symbols)
        plan = BucketPlan(
            symbols={**symbols, **{t: where for t, (_, where) in ties.items()}},
            pad={},
            pad_values={},
            size_inputs={},
            outputs=[],
            ties={t: sym for t, (sym, _) in ties.items()},
        )
        masked_syms |= {t for t, sym in plan.ties.items() if sym in masked_syms}
        syms = set(plan.symbols)
        _plan_inputs(plan, placeholders, syms, inputs.pad_values(cfg.pad_value))
        if not ctx.roots.is_entry_frame:
            _refuse_unrelated_sizes(plan, placeholders, syms, ctx.roots.frame_name)
        _plan_outputs(plan, ctx.gm, syms)
        unmasked = syms - masked_syms
        if unmasked and not plan.refused:
            _prove_padding(ctx, plan, placeholders, unmasked, syms)
        from ..fx_utils import copy_graph

        plan.unsliced = copy_graph(ctx.gm)  # the dynamic fallback must not slice fixed-size buffers
        ctx.analysis.bucket_plan = plan
        if plan.active:
            ctx.static_bounds = plan.bounds(cfg)
        state = "bucketed" if plan.active else "refused: " + plan.refused[0]
        if plan.ties:
            ctx.log.append(
                f"{self.name}: padded with the bucketed dim (equal when traced, checked per call): "
                + ", ".join(f"{t} = {sym}" for t, sym in plan.ties.items())
            )
        ctx.log.append(f"{self.name}: {len(plan.pad)} padded inputs, {len(plan.outputs)} outputs; {state}")
        return False  # a plan: the graph itself is padded per bucket by the dispatcher

    def _bucket_symbols(self, ctx: PassContext, inputs: "_Inputs") -> tuple[dict, set] | None:
        """The symbol of every bucketed dim (-> (placeholder index, dim)) and those the user masks,
        or None (logged) when this graph is not bucketed."""
        cfg = ctx.config.static_shapes
        symbols: dict[sympy.Symbol, tuple[int, int]] = {}
        masked_syms: set[sympy.Symbol] = set()
        missing = []
        for name, dims in cfg.dims.items():
            t = inputs.find(name)
            if t is None:
                missing.append(name)
                continue
            val = example_of(inputs.placeholders[inputs.index[t.node]])
            for d in dims:
                if d >= val.dim():
                    raise ConfigError(f"static_shapes.dims.{name}", d, f"input {name!r} has only {val.dim()} dims")
                e = _expr(val.shape[d])
                if e is None:
                    _refuse_if_never_dynamic(name, d, int(val.shape[d]))
                    ctx.log.append(
                        f"{self.name}: {name} dim {d} is static here ({int(val.shape[d])}): exact-size graph"
                    )
                    _warn_if_specialized(ctx, inputs.placeholders[inputs.index[t.node]], val, name, d)
                    return None
                if not isinstance(e, sympy.Symbol):
                    ctx.log.append(f"{self.name}: {name} dim {d} has size {e}, not a plain symbol: not bucketed")
                    if e.is_number:  # a SymInt Dynamo made dynamic, then specialized
                        _warn_if_specialized(ctx, inputs.placeholders[inputs.index[t.node]], val, name, d)
                    return None
                symbols[e] = (inputs.index[t.node], d)
                if name in cfg.masked:
                    masked_syms.add(e)
        if missing and not symbols:
            if ctx.roots.is_entry_frame:
                known = ", ".join(sorted(inputs.by_name)) or "none"
                raise ConfigError(
                    "static_shapes.dims",
                    missing[0],
                    f"no input of the compiled function has this name (inputs: {known})",
                )
            ctx.log.append(f"{self.name}: inputs {missing} not in this graph (a graph after a break): not bucketed")
            _warn_if_entry_skipped(missing, ctx.roots)
            return None
        if missing:
            ctx.log.append(f"{self.name}: inputs {missing} not in this graph; bucketing the others")
        return symbols, masked_syms


def _prove_padding(
    ctx: PassContext, plan: BucketPlan, placeholders: list[torch.fx.Node], unmasked: set, syms: set
) -> None:
    """Run the padding proof on the dims bucketing pads without a user mask (``unmasked``): its violations refuse
    the plan; what it needs checked goes into it: the per-call checks (``plan.call_checks``, looped over by the
    dispatcher) and the buckets where it does not hold, with typed reasons (``plan.invalid_buckets``)."""
    from ..static_shapes.padding_proof import prove_padding
    from ..static_shapes.topk_mask import TOPK_MASKS

    cfg = ctx.config.static_shapes
    zero = {placeholders[i].name for i, v in plan.pad_values.items() if v == 0}
    values = {n.name: v for n, v in zip(placeholders, ctx.example_inputs) if isinstance(v, torch.Tensor)}
    owners = {name: t.fqn for name, t in ctx.analysis.tensors.items()}  # placeholder -> its owner: a table's FQN
    upper = {str(s): cfg.largest for s in (*plan.symbols, *plan.ties)}  # the largest size a padded call runs at
    proof = prove_padding(
        ctx.gm,
        unmasked,
        ties=plan.ties,
        zero_padded=zero,
        values=values,
        rules=[TOPK_MASKS],
        buckets=cfg.buckets,
        bucket_symbols=syms,
        table_names=owners,
        upper=upper,
    )
    for v in proof.violations:
        plan.refused.append(f"{v.op} at node {v.node}{f' ({v.source})' if v.source else ''}: {v.reason}")
    plan.refused += proof.refused
    plan.invalid_buckets.update(proof.invalid_buckets)
    plan.call_checks = list(proof.call_checks)
    plan.zero_inputs = _zero_inputs(
        ctx,
        plan,
        placeholders,
        unmasked,
        values,
        dict(rules=[TOPK_MASKS], buckets=cfg.buckets, bucket_symbols=syms, table_names=owners, upper=upper),
        proof,
    )
    if proof.trusted and proof.safe and plan.invalid_buckets:
        ctx.log.append(
            f"{PlanStaticShapes.name}: buckets where the traced graph is not the code's trace (calls run "
            f"unpadded): {plan.invalid_buckets}"
        )
    if plan.causal_tables and not plan.refused:
        ctx.log.append(
            f"{PlanStaticShapes.name}: causal masks read from the values of "
            f"{', '.join(t.name for t in plan.causal_tables.values())} (checked unchanged per call)"
        )
    if plan.ones_inputs and not plan.refused:
        ctx.log.append(
            f"{PlanStaticShapes.name}: padded only on calls where {', '.join(plan.ones_inputs.values())} "
            "holds 1 everywhere (an additive attention mask must leave every real row a key)"
        )


def _zero_inputs(
    ctx: PassContext,
    plan: BucketPlan,
    placeholders: list[torch.fx.Node],
    unmasked: set,
    values: dict,
    options: dict,
    proof: Any,
) -> dict[int, str]:
    """The padded inputs whose zero padding the padding proof may rely on (``BucketPlan.zero_inputs``: the checked
    mode keeps their fill and varies every other one). Conservatively every zero-padded integer or boolean input
    (token ids, attention masks: the proof reads a mask's zero padding). A zero-padded floating-point input counts
    too where the proof needs it (a float attention mask read as a boolean): in the checked mode the proof is run
    again with only the integer and boolean inputs zero-padded, and when it fails, with each floating-point input
    dropped in turn from the zero-padded ones and kept out where the proof still holds, with no per-call check that
    ``proof`` (the proof with all of them) did not already need (the inputs it needs to hold 1, the trusted
    functions, the causal tables). The proof holds with exactly these inputs zero-padded, so varying every other
    padding never contradicts it (no false alarm). ``options``: the other arguments ``proof`` was made with."""
    zero = {i: placeholders[i].name for i, v in plan.pad_values.items() if v == 0}
    exact = {
        i: name
        for i, name in zero.items()
        if (t := example_of(placeholders[i])) is not None and not (t.is_floating_point() or t.is_complex())
    }
    if exact == zero or plan.refused or not ctx.config.static_shapes.verify:
        return exact
    from ..static_shapes.padding_proof import prove_padding

    def holds(kept: dict[int, str]) -> bool:
        trial = prove_padding(
            ctx.gm, unmasked, ties=plan.ties, zero_padded=set(kept.values()), values=values, **options
        )
        return (
            trial.safe
            and not trial.refused
            and trial.relied_on <= proof.relied_on
            and trial.trusted <= proof.trusted
            and set(trial.tables) <= set(proof.tables)
        )

    if holds(exact):
        return exact
    kept = dict(zero)
    for i in [i for i in zero if i not in exact]:
        trial = {j: n for j, n in kept.items() if j != i}
        if holds(trial):
            kept = trial
    ctx.log.append(
        f"{PlanStaticShapes.name}: the padding proof relies on the zero padding of "
        f"{', '.join(n for i, n in kept.items() if i not in exact)} too (verify keeps it)"
    )
    return kept


def _tied_symbols(placeholders: list[torch.fx.Node], symbols: dict) -> dict:
    """Input dims sized by a symbol of their own that had the same value as a bucketed dim when
    Dynamo traced (transformers' ``attention_mask`` beside ``input_ids``: Dynamo gives each its own
    symbol). They are padded to the same bucket: symbol -> (the bucketed symbol, (placeholder, dim)).
    The dispatcher checks the equality on every call and runs the call unpadded when it fails, so a
    wrong guess costs bucketing, never correctness."""
    hints = {}
    for i, _ in symbols.values():
        env = shape_env_of(example_of(placeholders[i]))
        if env is not None:
            hints = shape_env_hints(env)
            break
    by_value = {hints.get(sym): sym for sym in symbols if hints.get(sym) is not None}
    ties: dict = {}
    for i, ph in enumerate(placeholders):
        val = example_of(ph)
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            e = _expr(size)
            if isinstance(e, sympy.Symbol) and e not in symbols and e not in ties and hints.get(e) in by_value:
                ties[e] = (by_value[hints[e]], (i, d))
    return ties


def _refuse_if_never_dynamic(name: str, d: int, size: int) -> None:
    """Raise DynamicShapesDisabledError when a static marked dim will stay static for every length.

    With ``torch._dynamo.config.automatic_dynamic_shapes`` off (``import torch_xla`` sets it so for
    the whole process; ``torch.compile(dynamic=False)`` for its calls), Dynamo retraces each new length
    as another graph with that length fixed, and graphpass never receives a symbol to pad: bucketing
    would silently never happen. A size of 0 or 1 is static under every setting (Dynamo specializes
    it), so it says nothing about the next length. graphpass does not flip Dynamo's process-wide
    setting itself; the error says how the caller can."""
    import sys

    import torch._dynamo.config as dynamo_config

    if dynamo_config.automatic_dynamic_shapes or size in (0, 1):
        return
    from ..errors import DynamicShapesDisabledError

    cause = (
        "importing torch_xla turned it off for the whole process (transformers and accelerate import torch_xla "
        "whenever it is installed, unless USE_TORCH_XLA=0 is set)"
        if "torch_xla" in sys.modules
        else "torch.compile(dynamic=False) or the process's own setting turned it off"
    )
    raise DynamicShapesDisabledError(
        name,
        d,
        (
            f"graphpass static_shapes: cannot bucket {name} dim {d}: {DynamicShapesDisabledError.setting} is False here "
            f"({cause}). Dynamo then traces every new length as a graph of its own with the length fixed, so graphpass "
            f"never receives a symbolic length to pad to a bucket and each length would compile its own static graph. "
            f"Fix, either: call torch._dynamo.mark_dynamic(<the {name} tensor>, {d}) before the first call (that dim symbolic "
            f"from the first graph, one static graph per bucket); or compile with torch.compile(model, backend=..., "
            f"dynamic=True) (every dim symbolic; keep the first call's other sizes unequal to its length, which Dynamo would "
            f"give the same symbol); or set {DynamicShapesDisabledError.setting} = True after importing torch_xla "
            f"(then the first call's exact size compiles one extra graph)."
        ),
    )


def _warn_if_entry_skipped(missing: list[str], roots) -> None:
    """A graph from inside the model does not take the bucketed inputs; when Dynamo reports that it
    skipped a frame (ran it eagerly), the graph that would take them may never come: say so."""
    skipped = dynamo_records.skipped_frames()
    if not skipped:
        return
    where = f"{roots.frame_name!r}" + (f" of {roots.frame_module!r}" if roots.frame_module else "")
    warnings.warn(
        f"graphpass static_shapes: the dims name {missing}, which this graph (frame {where}, inside the model) does not "
        f"take, and Dynamo skipped a frame: the frame that takes {missing[0]!r} may run eagerly, unbucketed.\n"
        + dynamo_records.skipped_frame_message(skipped),
        UserWarning,
        stacklevel=2,
    )


def specialized_by_code(placeholder: torch.fx.Node, val: Any, d: int) -> tuple[int, str] | None:
    """``(value, where)`` when Dynamo traced ``placeholder``'s dim ``d`` as a symbol and the code then
    specialized it (a guard ``Eq(s, value)``: ``range(seq_len)``, ``list(range(n))``, an ``int()`` of
    the size); ``where``: the user source line that guarded it. None for a dim never made dynamic
    (Dynamo's first, exact-size trace) or when torch's shape environment cannot tell."""
    try:
        source = source_name(placeholder.meta["grapharg"].source)
        env = shape_env_of(val)
        want = f"{source}.size()[{d}]"
        syms = [s for s, srcs in env.var_to_sources.items() if any(source_name(x) == want for x in srcs)]
        for s in syms:
            value = env.replacements.get(s)
            if value is None or not value.is_number:
                continue
            guards = [g for g in env.guards if s in g.expr.free_symbols]  # the Eq(s, value) that pinned it first
            guards.sort(key=lambda g: not isinstance(g.expr, sympy.Eq))
            where = str(guards[0].sloc) if guards else ""
            return int(value), re.sub(r"\s*\((_dynamo|torch)/[^()]*\)$", "", where)
    except Exception:  # noqa: BLE001 - private shape-environment fields moved: cannot tell
        return None
    return None


def _warn_if_specialized(ctx: PassContext, placeholder: torch.fx.Node, val: Any, name: str, d: int) -> None:
    """Say that Dynamo specialized a bucketed dim: every length then compiles its own static graph
    before graphpass sees it (plain torch.compile does the same). The message names no length, so
    Python's default warning filter shows it once per place."""
    found = specialized_by_code(placeholder, val, d)
    if found is None:
        return
    value, where = found
    msg = (
        f"graphpass static_shapes: not bucketing {name} dim {d}: Dynamo specialized it (to one value per length) because the "
        f"model's code pins the length to its exact value ({where or 'source line unknown'}), so every length "
        "compiles its own exact-size graph, as under plain torch.compile; graphpass receives no symbolic "
        "length to pad"
    )
    ctx.log.append(f"{PlanStaticShapes.name}: {name} dim {d} specialized to {value} by the code: {where}")
    warnings.warn(msg, UserWarning, stacklevel=2)


class _Inputs:
    """The graph's user inputs by name (``ids`` or ``kwargs['ids']``) and placeholder position."""

    def __init__(self, ctx: PassContext, placeholders: list[torch.fx.Node]) -> None:
        self.placeholders = placeholders
        self.index = {n.name: i for i, n in enumerate(placeholders)}
        self.by_name = {t.fqn: t for t in ctx.analysis.tensors.values() if t.kind == "input"}

    def find(self, name: str) -> TensorOwnership | None:
        for key in (name, f"kwargs[{name!r}]"):
            if key in self.by_name:
                return self.by_name[key]
        return None

    def pad_values(self, pad_value: dict[str, float]) -> dict[str, float]:
        """Placeholder name -> the pad value the user gave for that input."""
        found = ((self.find(n), v) for n, v in pad_value.items())
        return {t.node: v for t, v in found if t is not None}


def _plan_inputs(plan: BucketPlan, placeholders: list[torch.fx.Node], syms: set, pad_by_name: dict[str, float]) -> None:
    """Which dims of which inputs are padded, and the size inputs that follow a bucketed dim."""
    for i, ph in enumerate(placeholders):
        val = example_of(ph)
        if isinstance(val, torch.SymInt):
            e = val.node.expr
            if e.free_symbols & syms:
                plan.size_inputs[i] = e
            continue
        if not isinstance(val, torch.Tensor):
            continue
        dims = []
        for d, s in enumerate(val.shape):
            e = _expr(s)
            if e is None or not (e.free_symbols & syms):
                continue
            if e not in syms:
                plan.refused.append(
                    f"input {ph.name} dim {d} has size {e}: only dims sized exactly by a bucketed dim can be padded"
                )
            dims.append((d, e))
        if dims:
            plan.pad[i] = tuple(dims)
            plan.pad_values[i] = float(pad_by_name.get(ph.name, 0))


def _refuse_unrelated_sizes(plan: BucketPlan, placeholders: list[torch.fx.Node], syms: set, frame: str) -> None:
    """A graph that starts inside the model (after a graph break, or a submodule's own frame) gets
    values computed before the break as inputs of their own, and Dynamo gives their sizes fresh
    symbols: a mask or a length equal to the padded dim at run time is not known to be equal here.
    Padding the named input and not them would feed the graph mismatched sizes, so such a graph
    is refused (it runs with dynamic shapes) whenever another input has a size symbol of its own."""
    for ph in placeholders:
        val = example_of(ph)
        if isinstance(val, torch.SymInt):
            free = val.node.expr.free_symbols
        elif isinstance(val, torch.Tensor):
            free = set().union(*[e.free_symbols for e in map(_expr, val.shape) if e is not None])
        else:
            continue
        other = sorted(str(f) for f in free - syms)
        if other and not (free & syms):
            plan.refused.append(
                f"input {ph.name} has size symbol(s) {', '.join(other)} of its own in a graph that starts inside the "
                f"model (frame {frame!r}, after a graph break): it may equal the padded dim at run time without "
                f"this graph knowing, so padding only the named inputs is unsafe"
            )
            return


def _plan_outputs(plan: BucketPlan, gm: torch.fx.GraphModule, syms: set) -> None:
    """How each output is sliced back to the real size (``sym + b`` dims only)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for arg in out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]:
        val = example_of(arg)
        if isinstance(val, torch.Tensor):
            plan.outputs.append(_output_spec(plan, arg, val, syms))
        elif isinstance(val, torch.SymInt) and val.node.expr.free_symbols & syms:
            plan.refused.append(
                f"output {getattr(arg, 'name', arg)} is a size ({val.node.expr}) that depends on the padded dim"
            )
            plan.outputs.append(None)
        else:
            plan.outputs.append(None)


def _output_spec(plan: BucketPlan, arg: torch.fx.Node, val: torch.Tensor, syms: set) -> tuple | None:
    spec = []
    for d, s in enumerate(val.shape):
        e = _expr(s)
        if e is None or not (e.free_symbols & syms):
            spec.append(None)
            continue
        sym = next((sym for sym in syms if e.free_symbols == {sym}), None)
        lin = _linear(e, sym) if sym is not None else None
        if lin is None:
            plan.refused.append(f"output {arg.name} dim {d} has size {e}: cannot slice it back")
            spec.append(None)
        else:
            spec.append((sym, *lin))
    return tuple(spec) if any(x is not None for x in spec) else None
