"""Running the fuzzer's programs (see :mod:`graphpass.static_shapes.padding_fuzz`): one program through the full
path against eager (:func:`run_program`), shrinking a failure (:func:`shrink`), many seeds (:func:`fuzz`)."""

from __future__ import annotations

import logging
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch

from .emit import _Built, _interpret, build_module, program_source
from .programs import CATEGORIES, FAMILIES, B, H, V, Program, generate

log = logging.getLogger("graphpass.static_shapes.padding_fuzz")

# ----------------------------------------------------------------------------------------------------------------
# Running one program: the full path
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    """What one program did. ``category``: one of :data:`CATEGORIES`; ``padded``: the call lengths that ran padded
    (at their bucket's length); ``wrong``: ``(length, output index, what differs)`` for every padded call that differs
    from eager; ``detail``: the refusal, the error, or the first difference."""

    program: Program
    category: str
    padded: tuple[int, ...] = ()
    wrong: tuple[tuple[int, int, str], ...] = ()
    detail: str = ""
    seconds: float = 0.0
    shrunk: Program | None = None

    @property
    def families(self) -> set[str]:
        return {s.kind for s in self.program.steps}


class _RecordingDelegate:
    """A ``then=`` delegate that runs the graph as it is (like ``then="eager"``) and records, per run of the compiled
    function, the length dim of every ``[B, n, ...]`` tensor argument (``x``, ``ids``, ``attention_mask``; the weights
    never have ``B`` rows first): a run at the bucket's length instead of the call's was padded."""

    __name__ = "padding_fuzz_recorder"

    def __init__(self) -> None:
        self.runs: list[set[int]] = []
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self.compiles += 1
        forward = gm.forward
        runs = self.runs

        def run(*args: Any) -> Any:
            runs.append(
                {int(a.shape[1]) for a in args if isinstance(a, torch.Tensor) and a.dim() in (2, 3) and a.shape[0] == B}
            )
            return forward(*args)

        return run


def _inputs(prog: Program, built: _Built, n: int, call: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(prog.seed * 1009 + n)
    out = {"x": torch.randn(B, n, H, generator=g)}
    if built.uses_ids:
        out["ids"] = torch.randint(0, V, (B, n), generator=g)
    if built.uses_mask:
        m = torch.ones(B, n, dtype=torch.long)
        if call == 1:  # one call with leading zeros (a left-padded row): the per-call checks see it
            m[1, :2] = 0
        out["attention_mask"] = m.bool() if prog.mask_bool else m
    return out


def _first_difference(got: Any, want: Any, exact: bool) -> tuple[int, str] | None:
    got_t = list(got) if isinstance(got, (tuple, list)) else [got]
    want_t = list(want) if isinstance(want, (tuple, list)) else [want]
    if len(got_t) != len(want_t):
        return -1, f"{len(got_t)} outputs, eager has {len(want_t)}"
    for k, (a, b) in enumerate(zip(got_t, want_t)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return k, f"{a!r} vs {b!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return k, f"shape/dtype {tuple(a.shape)} {a.dtype} vs eager's {tuple(b.shape)} {b.dtype}"
        if not (a.is_floating_point() or a.is_complex()):
            if not torch.equal(a, b):
                return k, f"integer values differ at {int((a != b).sum())} positions"
            continue
        na, nb = a.isnan(), b.isnan()
        if not torch.equal(na, nb):
            return k, f"NaN at {int((na ^ nb).sum())} positions of one only"
        a0, b0 = a.masked_fill(na, 0), b.masked_fill(nb, 0)
        if exact:
            if not torch.equal(a0, b0):
                return k, f"not bitwise equal (largest difference {(a0 - b0).abs().max().item():.3g})"
            continue
        fa, fb = a0.isfinite(), b0.isfinite()
        if not torch.equal(fa, fb) or not torch.equal(a0[~fa], b0[~fb]):
            return k, "infinities differ"
        if not fa.any():
            continue
        scale = 1.0 + b0[fb].abs().max().item()
        diff = (a0[fa] - b0[fb]).abs()
        bad = diff > 1e-5 * scale + 1e-5 * b0[fb].abs()
        if bad.any():
            return k, f"largest difference {diff.max().item():.3g} (eager's largest |value| {scale - 1:.3g})"
    return None


def _is_graphpass_error(err: BaseException) -> bool:
    from ..errors import GraphpassError

    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, GraphpassError):
            return True
        e = e.__cause__ or e.__context__
    return False


def _short_error(err: BaseException) -> str:
    tb = traceback.extract_tb(err.__traceback__)
    where = f" ({tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    msg = str(err).strip().splitlines()
    return f"{type(err).__name__}: {msg[0][:300] if msg else ''}{where}"


def _all_refused(gp: Any) -> str | None:
    """The first refusal when every graph graphpass planned so far was refused (no later call can pad), else None."""
    plans = [r.analysis.bucket_plan for r in gp.graphs]
    if plans and all(p is not None and p.refused for p in plans):
        return plans[0].refused[0]
    return None


def run_program(prog: Program) -> Result:
    """Compile ``prog`` with graphpass's bucketing (a recording delegate) and check every padded call against eager
    (see the module's docstring). Once every graph's plan is refused after a call, the remaining lengths are not
    called (no call can pad any more)."""
    import graphpass

    t0 = time.perf_counter()
    built = _interpret(prog)
    try:
        module = build_module(prog)
    except Exception as err:  # noqa: BLE001 - a generator bug: reported, never counted against graphpass
        return Result(prog, "invalid", detail=_short_error(err), seconds=time.perf_counter() - t0)
    names = ["x"] + (["ids"] if built.uses_ids else []) + (["attention_mask"] if built.uses_mask else [])
    fills = {"x": prog.x_fill, "ids": prog.ids_fill, "attention_mask": prog.mask_fill}
    rec = _RecordingDelegate()
    torch._dynamo.reset()
    gp = graphpass.backend(
        then=rec,
        static_shapes={
            "dims": {n: 1 for n in names},
            "buckets": list(prog.buckets),
            "pad_value": {n: fills[n] for n in names},
        },
    )
    compiled = torch.compile(module, backend=gp)
    padded: list[int] = []
    wrong: list[tuple[int, int, str]] = []
    refused = None
    try:
        # Dynamo's fake-tensor memo cache pays for entries no later program reuses (each program is new code)
        with torch.no_grad(), warnings.catch_warnings(), torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            warnings.simplefilter("ignore")
            for i, n in enumerate(prog.call_lengths):
                inp = _inputs(prog, built, n, i)
                try:
                    want = module(**inp)
                except Exception as err:  # noqa: BLE001 - a generator bug
                    return Result(prog, "invalid", detail=_short_error(err), seconds=time.perf_counter() - t0)
                if i == 0:
                    for t in inp.values():
                        torch._dynamo.maybe_mark_dynamic(t, 1)
                start = len(rec.runs)
                got = compiled(**inp)
                lengths = set().union(*rec.runs[start:]) if len(rec.runs) > start else set()
                if lengths and n not in lengths:
                    padded.append(n)
                    diff = _first_difference(got, want, exact=not built.inexact)
                    if diff is not None:
                        wrong.append((n, diff[0], diff[1]))
                refused = _all_refused(gp)
                if refused is not None and not padded:
                    break
    except Exception as err:  # noqa: BLE001 - a crash in compiling or calling: reported
        cat = "graphpass_error" if _is_graphpass_error(err) else "error"
        return Result(prog, cat, tuple(padded), tuple(wrong), _short_error(err), time.perf_counter() - t0)
    finally:
        torch._dynamo.reset()
    return _verdict(prog, gp, padded, wrong, refused, time.perf_counter() - t0)


def _verdict(prog: Program, gp: Any, padded: list, wrong: list, refused: str | None, seconds: float) -> Result:
    """The result of a program whose every call ran: refused, exact, WRONG, or a graph break."""
    if not padded and gp.graphs and all(r.analysis.bucket_plan is None for r in gp.graphs):
        return Result(
            prog,
            "refused",
            (),
            (),
            f"not bucketed: {len(gp.graphs)} graphs without a symbolic length (Dynamo specialized it)",
            seconds,
        )
    if len(gp.graphs) > 1 and any(r.analysis.bucket_plan is None for r in gp.graphs) and not padded:
        return Result(prog, "graph_break", tuple(padded), tuple(wrong), f"{len(gp.graphs)} graphs", seconds)
    if wrong:
        n, k, what = wrong[0]
        return Result(prog, "WRONG", tuple(padded), tuple(wrong), f"length {n}, output {k}: {what}", seconds)
    if padded:
        return Result(prog, "exact", tuple(padded), (), "", seconds)
    return Result(prog, "refused", (), (), refused or "no call padded (per-call checks)", seconds)


# ----------------------------------------------------------------------------------------------------------------
# Shrinking
# ----------------------------------------------------------------------------------------------------------------

#: Per family, simpler values to try for each parameter (first the simplest).
_SIMPLER: dict[str, dict[str, tuple[Any, ...]]] = {
    "attn": {
        "sink": (False,),
        "or_false": (False,),
        "proj": (False,),
        "and_am": (False,),
        "window": (None,),
        "int_dt": (None,),
        "oq": (0,),
        "ok": (0,),
        "cmp": ("le",),
        "src": ("self",),
        "mask": ("causal", "bool", "none"),
    },
    "conv": {"act": (False,), "dilation": (1,), "k": (1, 2, 3), "cut": ("prefix", "none")},
    "intpos": {"shift": (0,), "dt": ("int64",)},
}


def _candidates(prog: Program) -> Iterable[Program]:
    steps = prog.steps
    for i in range(len(steps)):
        yield replace(prog, steps=steps[:i] + steps[i + 1 :])
    for i, s in enumerate(steps):
        for name, values in _SIMPLER.get(s.kind, {}).items():
            for v in values:
                if s.get(name) != v and name in dict(s.params):
                    yield replace(prog, steps=steps[:i] + (s.with_(**{name: v}),) + steps[i + 1 :])
    if prog.x_fill not in (1.5,):
        yield replace(prog, x_fill=1.5)
    if prog.mask_bool:
        yield replace(prog, mask_bool=False)
    if prog.ids_fill:
        yield replace(prog, ids_fill=0)
    if prog.mask_fill:
        yield replace(prog, mask_fill=0)


def shrink(result: Result, run: Callable[[Program], Result] = run_program, budget: int = 60) -> Result:
    """Greedily shrink a failing ``result``'s program (drop steps, simplify parameters and fills, keep the failing
    lengths) while it fails the same way (same category); at most ``budget`` runs. Returns the smallest failing
    result, with ``shrunk`` set."""
    cat = result.category
    best = result
    if cat == "WRONG":
        first_bad = best.wrong[0][0]
        keep = tuple(dict.fromkeys((best.program.call_lengths[0], first_bad)))
        trial = run(replace(best.program, lengths=keep))
        budget -= 1
        if trial.category == cat:
            best = trial
    improved = True
    while improved and budget > 0:
        improved = False
        for cand in _candidates(best.program):
            if budget <= 0:
                break
            budget -= 1
            got = run(cand)
            if got.category == cat and (cat != "error" or got.detail.split(":")[0] == best.detail.split(":")[0]):
                best = got
                improved = True
                break
    return replace(
        result,
        shrunk=best.program,
        detail=result.detail if best is result else f"{result.detail}; shrunk: {best.detail}",
    )


def format_failure(result: Result) -> str:
    """A failure as text: the category, what differed, and the (shrunk) program's Python source."""
    prog = result.shrunk or result.program
    built = _interpret(prog)
    fills = {"x": prog.x_fill, "ids": prog.ids_fill, "attention_mask": prog.mask_fill}
    names = ["x"] + (["ids"] if built.uses_ids else []) + (["attention_mask"] if built.uses_mask else [])
    cfg = {"dims": {n: 1 for n in names}, "buckets": list(prog.buckets), "pad_value": {n: fills[n] for n in names}}
    return (
        f"[{result.category}] seed {result.program.seed}: {result.detail}\n"
        f"# static_shapes={cfg}, lengths {list(prog.call_lengths)}"
        f"{', attention_mask as bool' if prog.mask_bool and built.uses_mask else ''}\n" + program_source(prog)
    )


# ----------------------------------------------------------------------------------------------------------------
# Many programs
# ----------------------------------------------------------------------------------------------------------------


def fuzz(
    seeds: Iterable[int],
    shrink_failures: bool = True,
    run: Callable[[Program], Result] = run_program,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Run the programs of ``seeds``; failures (``WRONG``, ``error``) shrunk when ``shrink_failures``."""
    out = []
    for seed in seeds:
        r = run(generate(seed))
        if r.category in ("WRONG", "error") and shrink_failures:
            r = shrink(r, run)
            log.warning("padding fuzz: %s", format_failure(r))
        elif r.category in ("invalid", "graph_break"):
            log.info("padding fuzz: seed %d %s: %s", seed, r.category, r.detail)
        out.append(r)
        if on_result is not None:
            on_result(r)
    return out


def summarize(results: Sequence[Result]) -> dict[str, Any]:
    """Counts: per category, and per op family the programs with a step of it and how many of them were padded."""
    counts = {c: 0 for c in CATEGORIES}
    fam: dict[str, list[int]] = {f: [0, 0] for f in FAMILIES}
    for r in results:
        counts[r.category] += 1
        for f in r.families:
            fam[f][0] += 1
            fam[f][1] += r.category in ("exact", "WRONG")
    return {"programs": len(results), "counts": counts, "families": fam, "seconds": sum(r.seconds for r in results)}
