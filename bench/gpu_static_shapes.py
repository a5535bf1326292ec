"""GPU check for static-shape buckets (prepared for a lent H200; needs CUDA).

64 distinct sequence lengths through the same model, side by side in one process:
graphpass buckets delegating to ``cudagraphs`` (each bucket compiled, i.e. recorded, once),
graphpass buckets delegating to inductor with ``mode="reduce-overhead"``, and plain inductor with
``dynamic=True`` as the baseline. Prints recordings (delegate compilations) and median latency.

    python bench/gpu_static_shapes.py [--lengths 64] [--buckets 16 32 64 128]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from tabulate import tabulate

import graphpass
from graphpass.models.transformer import TinyTransformer, TransformerConfig


class Counting:
    def __init__(self, name: str, **kw):
        self.name, self.kw, self.calls = name, kw, 0
        self.__name__ = f"counting_{name}"

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.calls += 1
        if self.name == "inductor" and self.kw.get("mode"):
            # the registered inductor backend does not take mode= on every torch version
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches=torch._inductor.list_mode_options(self.kw["mode"]))
        return lookup_backend(self.name)(gm, example_inputs, **self.kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, default=64)
    ap.add_argument("--buckets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_static_shapes.py needs a CUDA device")
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab=32000, hidden=1024, heads=16, layers=8, mlp=4096, max_seq=max(args.buckets))
    model = TinyTransformer(cfg).cuda().eval().to(torch.bfloat16)
    lengths = [n + 2 for n in torch.randperm(args.lengths).tolist()]  # a size of 1 is always specialized
    inputs = {n: torch.randint(0, cfg.vocab, (4, n), device="cuda") for n in lengths}
    counters = {
        "graphpass buckets -> cudagraphs": Counting("cudagraphs"),
        "graphpass buckets -> inductor reduce-overhead": Counting("inductor", mode="reduce-overhead"),
        "inductor dynamic=True": Counting("inductor"),
    }
    static = {"dims": {"ids": 1}, "buckets": args.buckets}
    variants = {
        "graphpass buckets -> cudagraphs": torch.compile(
            model, backend=graphpass.backend(then=counters["graphpass buckets -> cudagraphs"], static_shapes=static)
        ),
        "graphpass buckets -> inductor reduce-overhead": torch.compile(
            model,
            backend=graphpass.backend(
                then=counters["graphpass buckets -> inductor reduce-overhead"], static_shapes=static
            ),
        ),
        "inductor dynamic=True": torch.compile(model, backend=counters["inductor dynamic=True"], dynamic=True),
    }
    times = {k: [] for k in variants}
    with torch.no_grad():
        for f in variants.values():
            for n in lengths:
                f(inputs[n])
        torch.cuda.synchronize()
        for _ in range(args.rounds):
            for n in lengths:
                for name, f in variants.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    f(inputs[n])
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end))
    base = statistics.median(times["inductor dynamic=True"])
    rows = [
        [k, counters[k].calls, f"{statistics.median(v):.3f}", f"{statistics.median(v) / base:.3f}"]
        for k, v in times.items()
    ]
    print(
        f"{torch.cuda.get_device_name()}: TinyTransformer {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M "
        f"params bf16, batch 4, {args.lengths} lengths, buckets {args.buckets}"
    )
    print(
        tabulate(rows, headers=["variant", "recordings / compilations", "median ms/call", "ratio vs dynamic inductor"])
    )


if __name__ == "__main__":
    main()
