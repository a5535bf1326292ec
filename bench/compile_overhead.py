"""Compile-time and steady-state overhead of graphpass (traps only, delegating to inductor)
against plain inductor, side by side in one run.

Each (model, variant, round) runs in a fresh process with an empty inductor cache directory,
so both variants compile cold. Variants alternate (inductor, graphpass, inductor, graphpass, ...)
so drift on the machine hits both alike. Reported: median compile time (first call: Dynamo +
backend) and median per-forward latency after warm-up, and graphpass/inductor ratios.

    python bench/compile_overhead.py               # both models, 2 rounds
    python bench/compile_overhead.py --rounds 3 --models large
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ("large", "tiny_llama")


def build(name: str):
    import torch

    torch.manual_seed(0)
    if name == "large":
        from graphpass.models.transformer import TinyTransformer, TransformerConfig

        cfg = TransformerConfig(vocab=32000, hidden=512, heads=8, layers=12, mlp=2048, max_seq=512)
        model = TinyTransformer(cfg).eval()
        return model, model.example_inputs(batch=1, seq=128), {}
    if name == "tiny_llama":
        import transformers

        cfg = transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(cfg).eval()
        return model, (torch.randint(0, 128, (1, 8)),), {"use_cache": False}
    raise SystemExit(f"unknown model {name}")


def worker(name: str, variant: str, iters: int) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, inputs, kwargs = build(name)
    if variant == "inductor":
        compiled = torch.compile(model, backend="inductor")
    else:
        import graphpass

        compiled = torch.compile(model, backend=graphpass.backend(then="inductor"))
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled(*inputs, **kwargs)
        compile_s = time.perf_counter() - t0
        for _ in range(3):
            compiled(*inputs, **kwargs)
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            compiled(*inputs, **kwargs)
            times.append(time.perf_counter() - t)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return {"model": name, "variant": variant, "compile_s": compile_s, "latency_ms": statistics.median(times) * 1e3,
            "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.iters)))
        return

    from tabulate import tabulate

    results: list[dict] = []
    for name in args.models:
        for r in range(args.rounds):
            for variant in ("inductor", "graphpass"):
                with tempfile.TemporaryDirectory(prefix="gp-bench-cache-") as cache:
                    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
                    out = subprocess.run(
                        [sys.executable, __file__, "--worker", name, variant, "--iters", str(args.iters)],
                        env=env, capture_output=True, text=True, check=True,
                    )
                res = json.loads(out.stdout.strip().splitlines()[-1])
                res["round"] = r
                results.append(res)
                print(f"  {name:10s} {variant:9s} round {r}: compile {res['compile_s']:.2f} s, "
                      f"latency {res['latency_ms']:.3f} ms", file=sys.stderr)
    rows = []
    for name in args.models:
        med = {}
        for variant in ("inductor", "graphpass"):
            rs = [x for x in results if x["model"] == name and x["variant"] == variant]
            med[variant] = (statistics.median(x["compile_s"] for x in rs), statistics.median(x["latency_ms"] for x in rs))
        params = next(x["params"] for x in results if x["model"] == name)
        rows.append([
            name, f"{params / 1e6:.1f} M",
            f"{med['inductor'][0]:.2f}", f"{med['graphpass'][0]:.2f}", f"{med['graphpass'][0] / med['inductor'][0]:.3f}",
            f"{med['inductor'][1]:.3f}", f"{med['graphpass'][1]:.3f}", f"{med['graphpass'][1] / med['inductor'][1]:.3f}",
        ])
    print(tabulate(rows, headers=["model", "params", "compile inductor s", "compile graphpass s", "ratio",
                                  "latency inductor ms", "latency graphpass ms", "ratio"]))
    print(f"(median of {args.rounds} cold-cache rounds per variant; latency: median of {args.iters} calls)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
