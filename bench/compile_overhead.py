"""Compile-time and steady-state overhead of graphpass (traps only, delegating to inductor)
against plain inductor, side by side in one run.

Compile time: each (model, variant, round) compiles in a fresh process with an empty inductor
cache directory, so both variants compile cold, with TORCHINDUCTOR_COMPILE_THREADS=1 so all the
work is in that process and the compiler runs it waits for: reported as wall time and as CPU
time of the process and those children (steadier on a noisy machine); variants alternate so drift on the machine hits
both alike; the median over rounds is reported. Timed: ``torch.compile(...)`` and the first call
(backend resolution and the imports it triggers, Dynamo, the backend, inductor), because
``backend="inductor"`` imports inductor inside ``torch.compile(...)`` while graphpass imports it
at its first compile.

Steady-state latency: one process compiles both variants, then times them interleaved
(A, B, B, A, ...) so both see the same machine state and neither always runs second; reported are the median and the minimum
per-forward time and the median of per-pair ratios (call i of graphpass over call i of inductor,
which cancels drift), as graphpass/inductor ratios. "graphpass passes ms" is the wall time of
graphpass's own pipeline inside its compile.

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
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(cfg).eval()
        return model, (torch.randint(0, 128, (1, 8)),), {"use_cache": False}
    raise SystemExit(f"unknown model {name}")


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _compiled(model, variant: str):
    """(compiled model, graphpass backend instance or None)."""
    import torch

    if variant == "inductor":
        return torch.compile(model, backend="inductor"), None
    import graphpass

    gp = graphpass.backend(then="inductor")
    return torch.compile(model, backend=gp), gp


def worker(name: str, variant: str, iters: int) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, inputs, kwargs = build(name)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if variant != "latency":
        with torch.no_grad():
            # torch.compile(...) is inside the timed region: backend="inductor" imports inductor
            # there, while graphpass imports it at its first compile; timing only the first call
            # charged that import (about 1 s, seen in cProfile) to graphpass alone.
            t0, c0 = time.perf_counter(), _cpu()
            compiled, gp = _compiled(model, variant)
            compiled(*inputs, **kwargs)
            compile_s, cpu_s = time.perf_counter() - t0, _cpu() - c0
        graphs = gp.graphs if gp is not None else []
        return {
            "model": name,
            "variant": variant,
            "compile_s": compile_s,
            "cpu_s": cpu_s,
            "params": params,
            "pass_s": sum(g.pass_seconds for g in graphs),
        }
    fns = {v: _compiled(model, v)[0] for v in ("inductor", "graphpass")}
    times: dict[str, list[float]] = {v: [] for v in fns}
    with torch.no_grad():
        for f in fns.values():
            for _ in range(3):
                f(*inputs, **kwargs)
        for it in range(iters):
            order = list(fns.items()) if it % 2 == 0 else list(fns.items())[::-1]  # ABBA: no position bias
            for v, f in order:
                t = time.perf_counter()
                f(*inputs, **kwargs)
                times[v].append(time.perf_counter() - t)
    paired = statistics.median(g / i for i, g in zip(times["inductor"], times["graphpass"]))
    return {
        "model": name,
        "variant": "latency",
        "params": params,
        "paired_ratio": paired,
        **{f"{v}_median_ms": statistics.median(ts) * 1e3 for v, ts in times.items()},
        **{f"{v}_min_ms": min(ts) * 1e3 for v, ts in times.items()},
    }


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

    def run(name: str, variant: str) -> dict:
        with tempfile.TemporaryDirectory(prefix="gp-bench-cache-") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            if variant != "latency":
                # compile in-process, so the process's CPU time covers all of it (no worker pool)
                env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
            out = subprocess.run(
                [sys.executable, __file__, "--worker", name, variant, "--iters", str(args.iters)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
        return json.loads(out.stdout.strip().splitlines()[-1])

    results: list[dict] = []
    rows = []
    for name in args.models:
        compile_s: dict[str, list[float]] = {"inductor": [], "graphpass": []}
        cpu_s: dict[str, list[float]] = {"inductor": [], "graphpass": []}
        for r in range(args.rounds):
            order = ("inductor", "graphpass") if r % 2 == 0 else ("graphpass", "inductor")
            for variant in order:
                res = run(name, variant)
                results.append(dict(res, round=r))
                compile_s[variant].append(res["compile_s"])
                cpu_s[variant].append(res["cpu_s"])
                print(
                    f"  {name:10s} {variant:9s} round {r}: compile {res['compile_s']:.2f} s wall, "
                    f"{res['cpu_s']:.2f} s CPU",
                    file=sys.stderr,
                )
        lat = run(name, "latency")
        results.append(lat)
        print(
            f"  {name:10s} latency: {json.dumps({k: round(v, 4) for k, v in lat.items() if k.endswith('ms')})}",
            file=sys.stderr,
        )
        ci, cg = statistics.median(compile_s["inductor"]), statistics.median(compile_s["graphpass"])
        ui, ug = statistics.median(cpu_s["inductor"]), statistics.median(cpu_s["graphpass"])
        pass_s = statistics.median(
            x.get("pass_s", 0.0) for x in results if x["model"] == name and x["variant"] == "graphpass"
        )
        rows.append(
            [
                name,
                f"{lat['params'] / 1e6:.1f} M",
                f"{ci:.2f}",
                f"{cg:.2f}",
                f"{cg / ci:.3f}",
                f"{ui:.2f}",
                f"{ug:.2f}",
                f"{ug / ui:.3f}",
                f"{pass_s * 1e3:.1f}",
                f"{lat['inductor_median_ms']:.3f}",
                f"{lat['graphpass_median_ms']:.3f}",
                f"{lat['graphpass_median_ms'] / lat['inductor_median_ms']:.3f}",
                f"{lat['graphpass_min_ms'] / lat['inductor_min_ms']:.3f}",
                f"{lat['paired_ratio']:.3f}",
            ]
        )
    print(
        tabulate(
            rows,
            headers=[
                "model",
                "params",
                "compile inductor s",
                "compile graphpass s",
                "ratio",
                "CPU inductor s",
                "CPU graphpass s",
                "CPU ratio",
                "graphpass passes ms",
                "latency inductor ms",
                "latency graphpass ms",
                "ratio (median)",
                "ratio (min)",
                "ratio (paired)",
            ],
        )
    )
    print(
        f"(compile: median of {args.rounds} cold-cache rounds per variant, fresh process each; "
        f"latency: {args.iters} interleaved calls per variant in one process)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
