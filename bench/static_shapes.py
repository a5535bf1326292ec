"""64 distinct sequence lengths: compilations and per-call latency of graphpass buckets against
``dynamic=True`` and Dynamo's default automatic dynamic shapes, all delegating to inductor, in one
process on the same model and inputs.

    python bench/static_shapes.py [--lengths 64] [--buckets 16 32 64]

Compilations are counted with a counting delegate wrapped around inductor. Latency: after every
variant has seen every length once (compiles done), each length is called once per variant,
interleaved, for ``--rounds`` rounds; median per-call time is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

import graphpass
from graphpass.models.transformer import TinyTransformer, TransformerConfig


class Counting:
    __name__ = "counting_inductor"

    def __init__(self):
        self.calls = 0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.calls += 1
        return compile_fx(gm, example_inputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, default=64)
    ap.add_argument("--buckets", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab=1024, hidden=128, heads=4, layers=4, mlp=512, max_seq=max(args.buckets))
    model = TinyTransformer(cfg).eval()
    lengths = torch.randperm(args.lengths, generator=torch.Generator().manual_seed(1)).add(1).tolist()
    inputs = {n: torch.randint(0, cfg.vocab, (1, n)) for n in lengths}

    counters = {k: Counting() for k in ("graphpass buckets", "dynamic=True", "automatic dynamic")}
    variants = {
        "graphpass buckets": torch.compile(
            model,
            backend=graphpass.backend(
                then=counters["graphpass buckets"], static_shapes={"dims": {"ids": 1}, "buckets": args.buckets}
            ),
        ),
        "dynamic=True": torch.compile(model, backend=counters["dynamic=True"], dynamic=True),
        "automatic dynamic": torch.compile(model, backend=counters["automatic dynamic"]),
    }
    first_pass = {}
    with torch.no_grad():
        for name, f in variants.items():
            t0 = time.perf_counter()
            for n in lengths:
                torch.testing.assert_close(f(inputs[n]), model(inputs[n]), rtol=1e-4, atol=1e-5)
            first_pass[name] = time.perf_counter() - t0
        times = {k: [] for k in variants}
        for _ in range(args.rounds):
            for n in lengths:
                for name, f in variants.items():
                    t = time.perf_counter()
                    f(inputs[n])
                    times[name].append(time.perf_counter() - t)
    base = statistics.median(times["automatic dynamic"])
    rows = [
        [
            k,
            counters[k].calls,
            f"{first_pass[k]:.1f}",
            f"{statistics.median(v) * 1e3:.3f}",
            f"{statistics.median(v) / base:.3f}",
        ]
        for k, v in times.items()
    ]
    print(
        f"TinyTransformer {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, batch 1, "
        f"{args.lengths} distinct lengths 1..{args.lengths}, buckets {args.buckets}, delegate inductor"
    )
    print(
        tabulate(
            rows,
            headers=[
                "variant",
                "compilations",
                "first pass over all lengths s",
                "median ms/call",
                "ratio vs automatic dynamic",
            ],
        )
    )


if __name__ == "__main__":
    main()
