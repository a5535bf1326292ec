"""The cost of static_shapes' checked mode (``"verify": True``): first-call and steady-state time per bucket, with
and without it, on the bundled TinyTransformer, in one process.

    python bench/static_verify.py [--buckets 64 128 256] [--then inductor] [--rounds 20] [--repeats 2] [--threads 1]

Two inputs: ``ids`` (TinyTransformer's token ids: zero-padded integers, which the checked mode keeps, so it has
nothing to vary and runs nothing more) and ``embeds`` (the same layers fed float embeddings, as ``inputs_embeds``:
their padding is varied, so the first call of each bucket runs the graph twice and compares). Per variant the
compiled model is fresh (after ``torch._dynamo.reset()``, the two variants compiled one after the other); each bucket's
first call (a length inside it; the first one also pays Dynamo's trace and graphpass's passes, with the checked mode's
extra padding proof) is timed, then ``--rounds`` rounds over the same lengths, the two variants' calls interleaved,
give the steady-state median. After one warm-up (not shown), the whole is repeated ``--repeats`` times, variants in
alternating order; the medians over repeats are shown, with ratios against verify off for the same input, and the time of the checked first
call's own step (``BucketDispatcher._verify``, timed by wrapping it) against one steady call. Under
inductor its FX graph cache is off, so the second variant compiles its buckets as the first did.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
from tabulate import tabulate

import graphpass
from graphpass.models.transformer import TinyTransformer, TransformerConfig


class FromEmbeddings(nn.Module):
    """TinyTransformer's layers fed float embeddings (``inputs_embeds``) instead of token ids."""

    def __init__(self, model: TinyTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return self.model.lm_head(self.model.norm(x))


def delegate(then: str):
    if then == "inductor":

        def compile_inductor(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)

        return compile_inductor
    return then


def compiled(model, name, buckets, then, verify):
    return torch.compile(
        model,
        dynamic=True,
        backend=graphpass.backend(
            then=delegate(then), static_shapes={"dims": {name: 1}, "buckets": buckets, "verify": verify}
        ),
    )


class TimedVerify:
    """Times each call of the dispatcher's checked first call (``BucketDispatcher._verify``: the usual run, the copy
    of its results, the other fill's staging, the second run and the comparison)."""

    def __init__(self) -> None:
        from graphpass.static_shapes.dispatcher import BucketDispatcher

        self.spent: list[float] = []
        inner = BucketDispatcher._verify

        def timed(dispatcher, *a, **k):
            t0 = time.perf_counter()
            try:
                return inner(dispatcher, *a, **k)
            finally:
                self.spent.append(time.perf_counter() - t0)

        BucketDispatcher._verify = timed


def one_repeat(model, name, inputs, buckets, then, order, rounds, timer):
    """First call of each bucket per variant (variants compiled one after the other, in ``order``), then the
    steady state with the variants' calls interleaved. Returns {verify: (first-call s per bucket, median s per
    bucket, checked first call's own s per bucket or None)}."""
    torch._dynamo.reset()
    fs, first, checked = {}, {}, {}
    with torch.no_grad():
        for verify in order:
            fs[verify] = f = compiled(model, name, buckets, then, verify)
            first[verify] = []
            timer.spent.clear()
            for x in inputs:
                t0 = time.perf_counter()
                f(x)
                first[verify].append(time.perf_counter() - t0)
            checked[verify] = list(timer.spent) if verify else None
        steady = {v: [[] for _ in inputs] for v in order}
        for _ in range(rounds):
            for k, x in enumerate(inputs):
                for verify in order:
                    t0 = time.perf_counter()
                    fs[verify](x)
                    steady[verify][k].append(time.perf_counter() - t0)
        for x in inputs:  # the checked mode changes no result
            for f in fs.values():
                torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-5)
    return {v: (first[v], [statistics.median(s) for s in steady[v]], checked[v]) for v in order}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buckets", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--then", default="inductor", help="delegate: inductor (default), eager, aot_eager")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on shared cores, a thread waiting for a busy core stalls "
        "every parallel op, and the timings follow the other load instead of the model)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.then == "inductor":  # each variant compiles its buckets itself: no graph from the other one's cache
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = False
        inductor_config.fx_graph_remote_cache = False
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab=1024, hidden=128, heads=4, layers=4, mlp=512, max_seq=max(args.buckets))
    lm = TinyTransformer(cfg).eval()
    lows = [2] + [b + 1 for b in args.buckets[:-1]]
    lengths = [(lo + b) // 2 for lo, b in zip(lows, args.buckets)]  # one length inside each bucket
    g = torch.Generator().manual_seed(1)
    cases = {
        "ids": (lm, "ids", [torch.randint(0, cfg.vocab, (args.batch, n), generator=g) for n in lengths]),
        "embeds": (
            FromEmbeddings(lm).eval(),
            "x",
            [torch.randn(args.batch, n, cfg.hidden, generator=g) for n in lengths],
        ),
    }
    rows = []
    timer = TimedVerify()
    for case, (model, name, inputs) in cases.items():
        got = {False: [], True: []}
        one_repeat(
            model, name, inputs, args.buckets, args.then, (False, True), 1, timer
        )  # warm-up (process caches), not shown
        for r in range(args.repeats):
            res = one_repeat(
                model,
                name,
                inputs,
                args.buckets,
                args.then,
                (False, True) if r % 2 == 0 else (True, False),
                args.rounds,
                timer,
            )
            for v, got_v in res.items():
                got[v].append(got_v)
        med = {
            v: [[statistics.median(rep[j][k] for rep in got[v]) for k in range(len(lengths))] for j in (0, 1)]
            for v in got
        }
        own = [statistics.median(rep[2][k] for rep in got[True]) for k in range(len(lengths))]
        for k, (n, b) in enumerate(zip(lengths, args.buckets)):
            f0, f1 = med[False][0][k], med[True][0][k]
            s0, s1 = med[False][1][k], med[True][1][k]
            rows.append(
                [
                    case,
                    b,
                    n,
                    f"{f0 * 1e3:.1f}",
                    f"{f1 * 1e3:.1f}",
                    f"{f1 / f0:.2f}",
                    f"{own[k] * 1e3:.1f}",
                    f"{own[k] / s0:.2f}",
                    f"{s0 * 1e3:.3f}",
                    f"{s1 * 1e3:.3f}",
                    f"{s1 / s0:.2f}",
                ]
            )
    print(
        f"TinyTransformer {sum(p.numel() for p in lm.parameters()) / 1e6:.2f} M params, batch {args.batch}, "
        f"buckets {args.buckets}, delegate {args.then}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds, median of {args.repeats} repeats"
    )
    print(
        tabulate(
            rows,
            headers=[
                "input",
                "bucket",
                "length",
                "first call ms",
                "first call ms verify",
                "ratio",
                "checked run ms",
                "/ steady",
                "steady ms",
                "steady ms verify",
                "ratio",
            ],
        )
    )
    print(
        "first call: the bucket's first call (the first bucket's includes Dynamo's trace and graphpass's passes); "
        "checked run: the time inside the checked first call's own step (usual run, copy of the results, other "
        "fill, second run, comparison; compile excluded), '/ steady' against one steady call without verify"
    )


if __name__ == "__main__":
    main()
