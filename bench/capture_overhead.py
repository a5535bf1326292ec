"""Cost of capture nodes when capture is off, against the same model compiled without them.

One process compiles three variants of the same model (same weights, graphpass -> inductor):
``plain`` (no ModelCapture), ``capture off`` (ModelCapture attached, disabled: the clone nodes
are in the graph but return at once) and ``capture on`` (enabled, writing to a temp dir each
step). Calls are interleaved, the order reversed every other round (A, B, C, C, B, A, ...).

    python bench/capture_overhead.py [--iters 60] [--layers 12]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
from tabulate import tabulate

import graphpass
from graphpass.models.transformer import TinyTransformer, TransformerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab=32000, hidden=512, heads=8, layers=args.layers, mlp=2048, max_seq=512)
    base = TinyTransformer(cfg).eval()
    (ids,) = base.example_inputs(batch=1, seq=args.seq)
    modules = [f"layers.0-{args.layers - 1}", "lm_head"]
    tmp = tempfile.TemporaryDirectory(prefix="gp-capture-bench-")

    plain = torch.compile(copy.deepcopy(base), backend=graphpass.backend())
    m_off, m_on = copy.deepcopy(base), copy.deepcopy(base)
    off = torch.compile(m_off, backend=graphpass.backend())
    cap_off = graphpass.ModelCapture(off, modules=modules, capture_dir=f"{tmp.name}/off")
    on = torch.compile(m_on, backend=graphpass.backend())
    cap_on = graphpass.ModelCapture(on, modules=modules, capture_dir=f"{tmp.name}/on")
    cap_on.enable()

    def run_plain():
        plain(ids)

    def run_off():
        with cap_off.step(is_prefill=True, positions=torch.arange(args.seq)):
            off(ids)

    def run_on():
        with cap_on.step(is_prefill=True, positions=torch.arange(args.seq)):
            on(ids)

    variants = {"plain (no capture nodes)": run_plain, "capture off": run_off, "capture on (writes files)": run_on}
    times = {k: [] for k in variants}
    with torch.no_grad():
        for f in variants.values():
            for _ in range(3):
                f()
        for it in range(args.iters):
            for k, f in list(variants.items()) if it % 2 == 0 else list(variants.items())[::-1]:
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
    base_med = statistics.median(times["plain (no capture nodes)"])
    base_min = min(times["plain (no capture nodes)"])
    rows = [
        [
            k,
            f"{statistics.median(v) * 1e3:.2f}",
            f"{min(v) * 1e3:.2f}",
            f"{statistics.median(v) / base_med:.3f}",
            f"{min(v) / base_min:.3f}",
        ]
        for k, v in times.items()
    ]
    params = sum(p.numel() for p in {id(p): p for p in base.parameters()}.values())
    print(
        f"TinyTransformer {params / 1e6:.1f} M params, batch 1 x {args.seq} tokens, graphpass -> inductor, "
        f"capturing {', '.join(modules)}; {args.iters} interleaved calls each"
    )
    print(tabulate(rows, headers=["variant", "median ms", "min ms", "ratio (median)", "ratio (min)"]))
    tmp.cleanup()


if __name__ == "__main__":
    main()
