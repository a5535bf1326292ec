"""What capture ON costs against capture OFF, per step, on a deep transformers Llama.

One process builds ``LlamaForCausalLM`` (``--layers`` decoder layers, default 32, hidden
``--hidden``, default 512, intermediate 2x hidden) and compiles it once with graphpass
(-> ``--delegate``, default inductor). Two ``ModelCapture`` objects of every decoder layer
(``model.layers.0-N``) are attached before the first call, one per write-behind writer
(``StagingConfig(writer="process")``, the default on Linux, and ``writer="thread"``); each variant
enables the one it measures. One step per call (``with capture.step(...)``), for two step sizes:
decode-sized (1 token) and prefill-sized (``--prefill`` tokens), no KV cache.

Variants, measured interleaved in blocks of ``--block`` calls (order reversed every round):

* ``off``: capture off (the capture nodes are in the graph and return at once);
* ``on (write-behind, process)``: ``step(wait=False)``, written by the writer process;
* ``on (write-behind, thread)``: ``step(wait=False)``, written by a writer thread of this process;
* ``on (wait=True)``: each step written before the call returns.

A block's time includes a final ``flush()``, so every file of the block is on disk when its clock
stops (per-step figure = block time / block). Prints, per step size, the median per-step wall
time over blocks and its ratio to ``off`` measured in the same run, and the calling thread's CPU
time per step (``time.thread_time``; it leaves out the writer's work, which the wall time of a
block, flush included, does not).

``--device cuda --mode reduce-overhead`` measures the same on a GPU with the graphs under CUDA graphs
(graphpass -> inductor ``mode="reduce-overhead"``; issue 24's "capture on under CUDA graphs within 1.10x capture
off", run by ``bench/gpu_check.sh``): the model and inputs live on the device, each call and each block end with
``torch.cuda.synchronize()``, and the run prints how many graphs inductor kept off CUDA graphs
(``counters["inductor"]["cudagraph_skips"]``) with its reasons, so a ratio measured without CUDA graphs is seen as such.

``--threads`` (default 1): torch's intra-op threads. With 1 on a 2-core machine the writer has a
core of its own, as on a GPU server, whose host cores are mostly idle while the device computes.

    python bench/capture_cost.py [--layers 32] [--hidden 512] [--rounds 15] [--block 8] [--prefill 128]
    python bench/capture_cost.py --device cuda --mode reduce-overhead --hidden 4096 --layers 32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from tabulate import tabulate

import graphpass


def build(layers: int, hidden: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--delegate", default="inductor")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--mode", default=None, help="torch.compile mode passed to the delegate (reduce-overhead: CUDA graphs)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: the writer gets the other core of a 2-core machine)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    model = build(args.layers, args.hidden).to(args.device)
    model = torch.compile(model, backend=graphpass.backend(then=args.delegate, mode=args.mode))
    modules = [f"model.layers.0-{args.layers - 1}"]
    tmp = tempfile.TemporaryDirectory(prefix="gp-capture-cost-")
    caps = {
        w: graphpass.ModelCapture(model, modules=modules, capture_dir=f"{tmp.name}/{w}", staging={"writer": w})
        for w in ("process", "thread")
    }
    sizes = {"decode (1 token)": 1, f"prefill ({args.prefill} tokens)": args.prefill}
    if args.prefill <= 1:  # --prefill 0: decode only
        sizes.pop(f"prefill ({args.prefill} tokens)")
    rows = []
    with torch.no_grad():
        for label, n in sizes.items():
            rows += measure(label, n, model, caps, args)
            print(tabulate(rows[-4:]), flush=True)  # partial results as they come (the full table follows)
    print(
        f"LlamaForCausalLM, {args.layers} layers, hidden {args.hidden}, every decoder layer captured "
        f"({args.layers} files a step), graphpass -> {args.delegate}"
        f"{f' mode={args.mode}' if args.mode else ''} on {args.device}, torch {torch.__version__}, "
        f"{args.threads} intra-op thread(s); {args.rounds} rounds x {args.block} calls per variant, interleaved "
        "(order reversed every round), one step per call; block time includes the final flush()"
    )
    print(
        tabulate(
            rows,
            headers=[
                "step",
                "variant",
                "wall ms / step (median)",
                "wall min",
                "wall ratio to off",
                "caller CPU ms / step",
                "CPU ratio to off",
            ],
        )
    )
    if args.device == "cuda":
        from torch._dynamo.utils import counters

        skips = (
            dict(counters["inductor"].get("cudagraph_skips", {}))
            if "cudagraph_skips" in counters["inductor"]
            else {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
        )
        print(f"inductor graphs kept off CUDA graphs: {skips or 'none'}")
    for cap in caps.values():
        cap.disable()
    tmp.cleanup()


def measure(label: str, n: int, model, caps: dict, args) -> list[list]:
    ids = torch.randint(0, 1024, (1, n), device=args.device)
    is_prefill = n > 1
    pos = torch.arange(n)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def block(writer: str | None, wait: bool) -> tuple[float, float]:
        for w, cap in caps.items():
            (cap.enable if w == writer else cap.disable)()
        cap = caps[writer or "process"]
        sync()
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(args.block):
            with cap.step(is_prefill=is_prefill, positions=pos, wait=wait):
                model(ids)
            sync()
        c = time.thread_time() - c  # CPU time of the calling thread (not the writer's), before the flush
        cap.flush()
        return (time.perf_counter() - t) / args.block, c / args.block

    variants = {
        "off": lambda: block(None, True),
        "on (write-behind, process)": lambda: block("process", False),
        "on (write-behind, thread)": lambda: block("thread", False),
        "on (wait=True)": lambda: block("process", True),
    }
    for f in variants.values():  # compile and warm up
        f()
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]
        for k, f in order:
            times[k].append(f())
    wall = {k: [w for w, _ in v] for k, v in times.items()}
    cpu = {k: [c for _, c in v] for k, v in times.items()}
    off, off_cpu = statistics.median(wall["off"]), statistics.median(cpu["off"])
    return [
        [
            label,
            k,
            f"{statistics.median(wall[k]) * 1e3:.2f}",
            f"{min(wall[k]) * 1e3:.2f}",
            f"{statistics.median(wall[k]) / off:.3f}",
            f"{statistics.median(cpu[k]) * 1e3:.2f}",
            f"{statistics.median(cpu[k]) / off_cpu:.3f}",
        ]
        for k in variants
    ]


if __name__ == "__main__":
    main()
