"""Decode under CUDA graphs with a few layers streamed: per-step latency of a decoder whose budget
keeps most layers resident and streams the rest, against the bound max(resident compute under CUDA
graphs, streamed bytes / host-to-device bandwidth), beside graphpass without CUDA graphs and
accelerate, in one process.

    python bench/gpu_decode.py                       # H200: 8 layers of hidden 4096, 2 streamed
    python bench/gpu_decode.py --device cpu --small  # smoke test of the code path (no CUDA graphs)

Model: ``--layers`` decoder layers in bf16 (LayerNorm, fused QKV projection, attention of the new
token over a ``--context``-token KV cache the layer holds, output projection, LayerNorm, MLP
hidden -> 4 hidden -> hidden). A step decodes one token for each sequence of the batch (``--batch``,
default 1 and 8) at context ``--context``: the cache is read, not appended (the step costs what a
decode step at that context costs; shapes are static, as CUDA graphs need). The cache stays
resident (``exclude_patterns=["layers.*.cache"]``); the budget ``max_device_bytes`` keeps all but
``--streamed`` layers resident. Rows:

1. resident under CUDA graphs: ``torch.compile(mode="reduce-overhead")`` (inductor), every weight on
   the device (the compute term of the bound);
2. graphpass offload (pinned) -> inductor ``mode="reduce-overhead"``: the loads of the streamed layers
   are recorded into the CUDA graph (fixed page-locked sources, fixed device slots, side stream joined
   by events);
3. graphpass offload (pinned) -> inductor: the same schedule and kernels without CUDA graphs;
4. accelerate ``cpu_offload`` of the streamed layers (the others resident), eager.

Latency: wall time of one step with a synchronize after it, median of ``--iters`` after warm-up.
Target: graphpass under CUDA graphs within 1.10 x the bound.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

import graphpass
from gpu_offload import time_forward  # same folder: sys.path[0] is bench/ when run as a script
from train_offload import bandwidth

MiB = 1 << 20
TARGET = 1.10


class Cache(nn.Module):
    """A layer's KV cache (resident: excluded from offload by its module name)."""

    def __init__(self, batch: int, context: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("k", torch.randn(batch, context, hidden, dtype=dtype) * 0.1)
        self.register_buffer("v", torch.randn(batch, context, hidden, dtype=dtype) * 0.1)


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, batch: int, context: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)
        self.cache = Cache(batch, context, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, 1, hidden]
        b, _, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        keys = torch.cat([self.cache.k, k], dim=1).view(b, -1, self.heads, h // self.heads).transpose(1, 2)
        vals = torch.cat([self.cache.v, v], dim=1).view(b, -1, self.heads, h // self.heads).transpose(1, 2)
        q = q.view(b, 1, self.heads, h // self.heads).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, keys, vals).transpose(1, 2).reshape(b, 1, h)
        x = x + self.out(att)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, batch: int, context: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(hidden, heads, batch, context, dtype) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def step_time(fn, x, iters: int, warmup: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """Median seconds of one decode step, and its output (cloned: a CUDA graph reuses its memory)."""
    median, _, out = time_forward(fn, x, iters, warmup, device)
    return median, out.clone()


def layer_bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in layer.named_parameters())


def offloaded(base: nn.Module, args, device: torch.device, storage: str):
    """A copy of ``base`` offloaded with a budget that keeps all but ``--streamed`` layers resident."""
    model = copy.deepcopy(base)
    one = layer_bytes(model.layers[0])
    cfg = graphpass.OffloadConfig(
        include_patterns=["layers.*"],
        exclude_patterns=["layers.*.cache"],
        device=str(device),
        storage=storage,
        prefetch_distance=1,
        max_device_bytes=(args.layers - args.streamed) * one + 2 * one,
    )
    state = graphpass.offload(model, cfg)
    return model, state


def accelerate_model(base: nn.Module, args, device: torch.device):
    from accelerate import cpu_offload

    model = copy.deepcopy(base)
    streamed = list(range(args.layers - args.streamed, args.layers))
    for i, layer in enumerate(model.layers):
        if i not in streamed:
            layer.to(device)
    model.norm.to(device)
    for i in streamed:
        model.layers[i].cache.to(device)
        for mod in (m for n, m in model.layers[i].named_children() if n != "cache"):
            cpu_offload(mod, execution_device=device)
    return model


def run_batch(batch: int, args, device: torch.device, bw: float | None) -> list[list]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    base = (
        Decoder(args.layers, args.hidden, args.heads, batch, args.context, dtype).to(dtype).eval().requires_grad_(False)
    )
    x = torch.randn(batch, 1, args.hidden, dtype=dtype, device=device)
    cuda = device.type == "cuda"
    storage = "pinned" if cuda else "cpu"
    rows, ref = [], None
    then = "inductor" if cuda else "aot_eager"
    variants = [
        ("resident, inductor reduce-overhead (= compute)", None, "reduce-overhead"),
        ("graphpass offload -> inductor reduce-overhead", storage, "reduce-overhead"),
        (f"graphpass offload -> {then} (no CUDA graphs)", storage, None),
        ("accelerate cpu_offload (eager)", "accelerate", None),
    ]
    times: dict[str, float] = {}
    streamed = args.streamed * layer_bytes(base.layers[0])
    for name, how, mode in variants:
        if mode and not cuda:
            rows.append([batch, name, "skipped (CUDA graphs need CUDA)", "", "", "", ""])
            continue
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            if how is None:
                model = copy.deepcopy(base).to(device)
                fn = torch.compile(model, backend=then, mode=mode, dynamic=False)
            elif how == "accelerate":
                fn = model = accelerate_model(base, args, device)
            else:
                model, state = offloaded(base, args, device, how)
                fn = torch.compile(model, backend=graphpass.backend(then=then, mode=mode), dynamic=False)
            t, out = step_time(fn, x, args.iters, args.warmup, device)
        except Exception as exc:  # a variant that fails says what failed; the others still run
            traceback.print_exc()
            rows.append([batch, name, f"FAILED: {type(exc).__name__}: {str(exc)[:160]}", "", "", "", ""])
            continue
        ref = out if ref is None else ref
        times[name] = t
        peak = torch.cuda.max_memory_allocated(device) / MiB if cuda else float("nan")
        rows.append(
            [
                batch,
                name,
                f"{t * 1e3:.3f}",
                None,
                f"{peak:.0f}",
                f"{(out.float() - ref.float()).abs().max().item():.3g}",
                f"{time.perf_counter() - t0:.0f} s",
            ]
        )
        del fn, model
    compute = next(iter(times.values()), float("nan"))
    bound = max(compute, streamed / bw) if bw else compute
    for row in rows:
        if row[3] is None:
            row[3] = f"{float(row[2]) / 1e3 / bound:.3f}"
    rows.append(
        [
            batch,
            "bound max(compute, streamed / H2D)",
            f"{bound * 1e3:.3f}",
            "1.000",
            "",
            "",
            f"{streamed / MiB:.0f} MiB streamed" + (f" at {bw / 1e9:.1f} GB/s" if bw else ""),
        ]
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--streamed", type=int, default=2, help="layers streamed (the rest resident)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="smoke run: 4 layers, hidden 128, context 64")
    args = ap.parse_args(argv)
    if args.small:
        args.layers, args.hidden, args.heads, args.context, args.iters, args.warmup = 4, 128, 4, 64, 3, 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_decode: no CUDA device; use --device cpu --small for a smoke run")
        return 2
    bw = bandwidth(device, 512, True) if device.type == "cuda" else None
    rows = []
    for batch in args.batch:
        rows += run_batch(batch, args, device, bw)
    print(
        f"gpu_decode: {args.layers} layers, hidden {args.hidden}, {args.streamed} streamed, context {args.context}, "
        f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
    )
    print(tabulate(rows, headers=["batch", "variant", "median ms / step", "x bound", "peak MiB", "max |diff|", "note"]))
    print(f"target: graphpass -> inductor reduce-overhead within {TARGET} x the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
