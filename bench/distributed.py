"""graphpass under tensor parallelism: steady-state latency against plain inductor on the same mesh.

Spawns ``--world`` gloo ranks on this machine (one thread each). Every rank builds the same
TinyTransformer, parallelizes each block with the standard colwise/rowwise plan over a 1-D mesh,
and compiles four copies (same weights):

* ``inductor``: ``torch.compile(model)``, the baseline;
* ``graphpass -> inductor``: ``backend=graphpass.backend(then="inductor")`` (trap boundaries; no
  capture, no offload);
* ``graphpass -> eager`` and ``graphpass -> eager + capture on``: the capture cost, with a
  ``ModelCapture`` of every layer and the head enabled, writing each step's files (per rank:
  ``dp0/<step>/<module>/rank<t>.safetensors``), against the same delegate without one (measured
  under ``then="eager"``; DTensor captures now work under every delegate, docs/distributed.md).

Calls are interleaved and the order is reversed every other round (A, B, C, C, B, A, ...); every
rank runs the same variant at the same time (the collectives pair up). Each rank times its own
calls; the table shows, per variant, the median over rounds of the slowest rank's time.

    python bench/distributed.py [--world 2] [--iters 40] [--layers 4] [--seq 128] [--no-capture]
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(args):
    from graphpass.models.transformer import TinyTransformer, TransformerConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab=8192, hidden=args.hidden, heads=8, layers=args.layers, mlp=4 * args.hidden, max_seq=max(512, args.seq)
    )
    base = TinyTransformer(cfg).eval().requires_grad_(False)
    # the fused q|k|v and gate|up outputs are split unevenly: colwise layers all-gather their output
    plan = {
        "attn.qkv": ColwiseParallel(output_layouts=Replicate()),
        "attn.o_proj": RowwiseParallel(input_layouts=Replicate()),
        "mlp.gate_up": ColwiseParallel(output_layouts=Replicate()),
        "mlp.down": RowwiseParallel(input_layouts=Replicate()),
    }
    mesh = init_device_mesh("cpu", (args.world,))
    models = []
    for _ in range(4):
        m = copy.deepcopy(base)
        for block in m.layers:
            parallelize_module(block, mesh, plan)
        models.append(m)
    (ids,) = base.example_inputs(batch=1, seq=args.seq)
    return models, ids


# variant -> the variant its ratio is taken against
BASELINE = {
    "inductor": "inductor",
    "graphpass -> inductor": "inductor",
    "graphpass -> eager": "graphpass -> eager",
    "graphpass -> eager + capture on": "graphpass -> eager",
}


def _variants(args, models, ids, folder):
    import graphpass

    plain = torch.compile(models[0])
    traps = torch.compile(models[1], backend=graphpass.backend(then="inductor"))
    variants = {"inductor": lambda: plain(ids), "graphpass -> inductor": lambda: traps(ids)}
    if args.no_capture:
        return variants
    # The capture cost under then="eager" (the recorded numbers' delegate), against the same
    # delegate without a ModelCapture.
    eager = torch.compile(models[2], backend=graphpass.backend(then="eager"))
    on = torch.compile(models[3], backend=graphpass.backend(then="eager"))
    capture = graphpass.ModelCapture(on, modules=[f"layers.0-{args.layers - 1}", "lm_head"], capture_dir=folder)
    capture.enable()
    positions = torch.arange(args.seq)

    def run_capture():
        with capture.step(is_prefill=True, positions=positions):
            return on(ids)

    variants["graphpass -> eager"] = lambda: eager(ids)
    variants["graphpass -> eager + capture on"] = run_capture
    return variants


def _rank(rank: int, args, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    try:
        models, ids = _build(args)
        with tempfile.TemporaryDirectory(prefix="gp-dist-bench-") as folder, torch.no_grad():
            variants = _variants(args, models, ids, folder)
            outs = {k: fn() for k, fn in variants.items()}  # compile (and check) each variant once
            ref = outs["inductor"]
            diffs = {k: (o - ref).abs().max().item() for k, o in outs.items()}
            for _ in range(3):
                for fn in variants.values():
                    fn()
            times = {k: [] for k in variants}
            names = list(variants)
            for i in range(args.iters):
                for k in names if i % 2 == 0 else names[::-1]:
                    dist.barrier()
                    t0 = time.perf_counter()
                    variants[k]()
                    times[k].append(time.perf_counter() - t0)
        torch.save({"times": times, "diffs": diffs}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--no-capture", action="store_true", help="leave out the capture-on variant")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(args, _free_port(), out), nprocs=args.world, start_method="spawn")
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(args.world)]
    names = list(ranks[0]["times"])
    slowest = {k: [max(r["times"][k][i] for r in ranks) for i in range(args.iters)] for k in names}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    rows = [
        (
            k,
            f"{med[k] * 1e3:.2f}",
            f"{min(slowest[k]) * 1e3:.2f}",
            BASELINE[k],
            f"{med[k] / med[BASELINE[k]]:.3f}",
            f"{max(r['diffs'][k] for r in ranks):.1e}",
        )
        for k in names
    ]
    print(
        f"TP={args.world} (gloo, CPU, 1 thread per rank), TinyTransformer hidden {args.hidden}, {args.layers} layers, "
        f"batch 1 x {args.seq} tokens, {args.iters} interleaved rounds; per round the slowest rank's time"
    )
    print(tabulate(rows, headers=("variant", "median ms", "min ms", "baseline", "ratio", "max |out - inductor|")))


if __name__ == "__main__":
    main()
