"""GPU check for offload (prepared for a lent H200): per-forward latency of a model whose layers
stream from pinned host memory, against the bound max(compute time, offloaded bytes / bandwidth),
for graphpass, accelerate ``cpu_offload`` and, where it imports, FlexTensor, on the same model.

    python bench/gpu_offload.py [--layers 16 --hidden 4096 --inter 16384] [--tokens auto] [--iters 10]
    python bench/gpu_offload.py --device cpu --small      # smoke test of the code path, no CUDA

Model: the stack of ``bench/offload_disk.py`` (LayerNorm, Linear hidden->inter, GELU,
Linear inter->hidden, residual; a small norm + head), bf16 on CUDA. Defaults: 16 layers of
256 MiB = 4 GiB streamed per forward. Measured, in one process:

1. pinned host-to-device bandwidth: ``--copy-mib`` pinned -> device copies timed with CUDA events
   (median of 5); the bound's transfer term is offloaded bytes / this bandwidth.
2. compute time: per-forward latency of the whole model resident on the GPU, ``torch.compile``
   with inductor (``dynamic=False``).
3. graphpass: ``graphpass.offload(storage="pinned", device="cuda", prefetch_distance=1,
   include ["layers.*"])``, ``torch.compile(backend="graphpass")`` (delegates to inductor).
4. accelerate ``cpu_offload(model, execution_device="cuda")``: eager (its hooks move each
   module's weights from pageable CPU memory in Python and graph-break under torch.compile).
5. FlexTensor (if ``import flextensor`` works): ``flextensor.offload(include ["layers.*"])`` with a
   per-unit ``torch.compile`` as ``compile_fn``; its discovery/profiling forwards run at the
   largest token count before timing.

Latency: wall time of one forward with ``torch.cuda.synchronize()`` after it, median of
``--iters`` after warm-up. ``--tokens auto`` measures at 256 tokens (transfer-bound) and at the
smallest power of two at which eager resident compute reaches the transfer time (the balanced
point, where overlap matters most). Target: graphpass within 1.15 x the bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
import traceback

import torch
from tabulate import tabulate

from offload_disk import HEAD, Stack  # same folder: sys.path[0] is bench/ when run as a script

MiB = 1 << 20
TARGET = 1.15
RES = "resident, inductor (= compute)"
GP = "graphpass offload -> inductor"
ACC = "accelerate cpu_offload (eager)"
FT = "flextensor (per-unit compile)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(fn, x, iters: int, warmup: int, device: torch.device) -> tuple[float, float, torch.Tensor]:
    """(median, min) seconds per forward, and the last output."""
    with torch.no_grad():
        for _ in range(warmup):
            out = fn(x)
        sync(device)
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            out = fn(x)
            sync(device)
            ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts), out


def pinned_bandwidth(nbytes: int, device: torch.device, reps: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return nbytes / statistics.median(times[1:])


def make_state_dict(args, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded random weights (generated on ``device``, fast on a GPU), kept on the CPU."""
    g = torch.Generator(device=device).manual_seed(0)
    h, n = args.hidden, args.inter

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype).cpu()

    sd = {}
    for i in range(args.layers):
        sd[f"layers.{i}.norm.weight"] = 1 + rnd(h, scale=0.1)
        sd[f"layers.{i}.norm.bias"] = rnd(h, scale=0.1)
        sd[f"layers.{i}.up.weight"] = rnd(n, h, scale=h**-0.5)
        sd[f"layers.{i}.up.bias"] = rnd(n, scale=0.1)
        sd[f"layers.{i}.down.weight"] = rnd(h, n, scale=0.5 * n**-0.5)
        sd[f"layers.{i}.down.bias"] = rnd(h, scale=0.1)
    sd["norm.weight"] = torch.ones(h, dtype=dtype)
    sd["norm.bias"] = torch.zeros(h, dtype=dtype)
    sd["head.weight"] = rnd(HEAD, h, scale=h**-0.5)
    sd["head.bias"] = torch.zeros(HEAD, dtype=dtype)
    return sd


def build(args, sd: dict[str, torch.Tensor]) -> Stack:
    """A CPU model sharing ``sd``'s tensors (no copy)."""
    with torch.device("meta"):
        model = Stack(args.layers, args.hidden, args.inter)
    model.load_state_dict(sd, assign=True)
    return model.eval().requires_grad_(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=16384)
    ap.add_argument("--tokens", nargs="+", default=["auto"], help="token counts, or 'auto'")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=1, help="graphpass prefetch_distance")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth test copy")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["graphpass", "accelerate", "flextensor"],
        choices=["graphpass", "accelerate", "flextensor"],
    )
    ap.add_argument("--small", action="store_true", help="smoke run: 4 layers, hidden 256, inter 1024, tokens 1 and 16")
    args = ap.parse_args()
    if args.small:
        args.layers, args.hidden, args.inter = 4, 256, 1024
        if args.tokens == ["auto"]:
            args.tokens = ["1", "16"]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_offload.py --device cuda needs a CUDA device (use --device cpu --small for a smoke run)")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)

    import graphpass

    # ---- weights (one CPU copy, shared by every variant's model)
    t0 = time.perf_counter()
    sd = make_state_dict(args, device, dtype)
    layer_keys = [k for k in sd if k.startswith("layers.")]
    offloaded = sum(sd[k].numel() * sd[k].element_size() for k in layer_keys)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    print(
        f"model: {args.layers} layers x (LayerNorm, Linear {args.hidden}->{args.inter}, GELU, Linear "
        f"{args.inter}->{args.hidden}) {str(dtype).replace('torch.', '')} + norm + head; {total / MiB:.0f} MiB, "
        f"offloaded (layers.*) {offloaded / MiB:.0f} MiB = {offloaded / args.layers / MiB:.1f} MiB per trap; "
        f"weights made in {time.perf_counter() - t0:.1f} s"
    )
    if cuda:
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")

    # ---- 1. bandwidth
    if cuda:
        bw = pinned_bandwidth(args.copy_mib * MiB, device)
        transfer_s = offloaded / bw
        print(
            f"pinned host->device bandwidth ({args.copy_mib} MiB copies, median of 5): {bw / 1e9:.1f} GB/s "
            f"({bw / (1 << 30):.1f} GiB/s) -> offloaded bytes / bandwidth = {transfer_s * 1e3:.2f} ms per forward"
        )
    else:
        bw, transfer_s = None, 0.0
        print("device cpu: no host->device transfer; the bound is the compute time (smoke run of the code path)")

    # ---- 2. compute time: the whole model resident, inductor
    resident = build(args, sd).to(device)  # new device tensors; sd stays on the CPU
    if args.tokens == ["auto"]:
        probe, chosen = [], None
        t = 512
        while t <= 65536:
            x = torch.randn(t, args.hidden, device=device, dtype=dtype)
            med, _, _ = time_forward(resident, x, 3, 1, device)
            probe.append([t, f"{med * 1e3:.2f}", f"{med / transfer_s:.2f}" if transfer_s else "-"])
            if med >= transfer_s:
                chosen = t
                break
            t *= 2
        tokens = [256, chosen or 65536]
        print("eager resident forward vs transfer time (choosing the balanced token count):")
        print(tabulate(probe, headers=["tokens", "eager ms/forward", "compute / transfer"]))
    else:
        tokens = [int(t) for t in args.tokens]
    inputs = {
        t: torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(t), dtype=torch.float32)
        .to(dtype)
        .to(device)
        for t in tokens
    }
    print(f"token counts: {tokens}; {args.iters} timed forwards each (median), after {args.warmup} warm-up\n")

    lat: dict[str, dict[int, tuple[float, float]]] = {}
    outs: dict[str, dict[int, torch.Tensor]] = {}
    mem: dict[str, int] = {}
    notes: dict[str, str] = {}

    def measure(name: str, fn) -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        lat[name], outs[name] = {}, {}
        for t in tokens:
            med, mn, out = time_forward(fn, inputs[t], args.iters, args.warmup, device)
            lat[name][t] = (med, mn)
            outs[name][t] = out.float().cpu()
        if cuda:
            mem[name] = torch.cuda.max_memory_allocated(device)
        print(
            f"[{name}] {time.perf_counter() - t0:.1f} s (with any compile not done before): "
            + ", ".join(f"{t} tokens {lat[name][t][0] * 1e3:.2f} ms" for t in tokens),
            flush=True,
        )

    def attempt(name: str, body) -> None:
        try:
            body()
        except Exception as exc:  # one variant failing must not lose the others
            notes[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"[{name}] FAILED:")
            traceback.print_exc(file=sys.stdout)
        finally:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()

    def run_resident():
        measure(RES, torch.compile(resident, backend="inductor", dynamic=False))  # noqa: F821 (bound above; the del below)

    attempt(RES, run_resident)
    del resident
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    # ---- 3. graphpass
    gp_stats = {}

    def run_graphpass():
        torch._dynamo.reset()  # the resident run compiled Stack.forward: offload() refuses a compiled class
        model = build(args, sd)
        cfg = graphpass.OffloadConfig(
            include_patterns=["layers.*"],
            exclude_patterns=[],
            device=str(device),
            storage="pinned" if cuda else "cpu",
            prefetch_distance=args.prefetch,
            max_device_bytes=None,
        )
        state = graphpass.offload(model, cfg)
        print(f"[graphpass] {state}")
        compiled = torch.compile(model, backend="graphpass", dynamic=False)
        with torch.no_grad():
            for t in tokens:  # compile every shape, then count one timed phase per shape
                compiled(inputs[t])
        graphpass.memory_stats(compiled, reset=True)
        measure(GP, compiled)
        s = graphpass.memory_stats(compiled)
        gp_stats.update(dataclasses.asdict(s), peak_resident_bytes=s.peak_resident_bytes)
        n = len(tokens) * (args.iters + args.warmup)
        print(f"[graphpass] memory_stats over {n} forwards: {s}")
        print(
            f"[graphpass] per forward: {s.bytes_loaded / n / MiB:.0f} MiB loaded, {s.loads_issued / n:.0f} loads, "
            f"{s.wait_seconds / n * 1e3:.2f} ms waiting for loads; peak streamed on device "
            f"{s.peak_streamed_bytes / MiB:.0f} MiB"
        )

    if "graphpass" in args.variants:
        attempt(GP, run_graphpass)

    # ---- 4. accelerate cpu_offload
    def run_accelerate():
        from accelerate import cpu_offload

        model = build(args, sd)
        cpu_offload(model, execution_device=device)
        measure(ACC, model)

    if "accelerate" in args.variants:
        try:
            import accelerate  # noqa: F401

            attempt(ACC, run_accelerate)
        except ImportError:
            notes[ACC] = "not available (import accelerate failed)"
            print("[accelerate] not available")

    # ---- 5. FlexTensor
    def run_flextensor():
        import flextensor as ft

        model = build(args, sd)
        model.norm.to(device)
        model.head.to(device)
        cfg = ft.OffloadConfig(include_patterns=["layers.*"], gpu_device=device.index or 0, profiling_iters=3)
        proxy = ft.offload(model, cfg, compile_fn=lambda m: torch.compile(m, fullgraph=True))
        om = ft.get_offload_manager()
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(om.iters_before_inference):
                proxy(inputs[max(tokens)])
        print(
            f"[flextensor] {om.iters_before_inference} discovery/profiling forwards at {max(tokens)} tokens: "
            f"{time.perf_counter() - t0:.1f} s"
        )
        measure(FT, proxy)
        try:
            print(f"[flextensor] gpu memory usage: {ft.get_gpu_memory_usage()}")
        except Exception as exc:
            print(f"[flextensor] get_gpu_memory_usage: {type(exc).__name__}: {exc}")
        ft.release(preserve_model=False)

    if "flextensor" in args.variants:
        if not cuda:
            notes[FT] = "skipped (needs CUDA)"
            print("[flextensor] skipped: needs CUDA")
        else:
            try:
                import flextensor  # noqa: F401

                attempt(FT, run_flextensor)
            except ImportError as exc:
                notes[FT] = f"not available ({exc})"
                print(f"[flextensor] not available: {exc}")

    # ---- table
    comp_name = RES
    compute = lat.get(comp_name, {})
    print()
    rows = []
    for t in tokens:
        c = compute.get(t, (None, None))[0]
        bound = max(c, transfer_s) if c is not None else None
        for name in lat:
            med, mn = lat[name][t]
            diff = "-"
            if name != comp_name and comp_name in outs:
                diff = f"{(outs[name][t] - outs[comp_name][t]).abs().max().item():.2e}"
            rows.append(
                [
                    t,
                    name,
                    f"{med * 1e3:.2f}",
                    f"{mn * 1e3:.2f}",
                    f"{bound * 1e3:.2f}" if bound else "-",
                    f"{med / bound:.3f}" if bound else "-",
                    f"{mem[name] / MiB:.0f}" if name in mem else "-",
                    diff,
                ]
            )
        for name, note in notes.items():
            if name not in lat:
                rows.append([t, name, note, "", "", "", "", ""])
    print(
        tabulate(
            rows,
            headers=[
                "tokens",
                "variant",
                "median ms",
                "min ms",
                "bound ms",
                "median / bound",
                "peak device MiB",
                "max |diff| vs resident",
            ],
        )
    )
    print(
        f"bound = max(compute = resident inductor latency, offloaded {offloaded / MiB:.0f} MiB / "
        + (f"{bw / 1e9:.1f} GB/s = {transfer_s * 1e3:.2f} ms)" if bw else "n/a on cpu)")
    )
    if GP in lat and compute:
        checks = []
        for t in tokens:
            bound = max(compute[t][0], transfer_s)
            r = lat[GP][t][0] / bound
            checks.append([t, f"graphpass median <= {TARGET} x bound", f"{r:.3f}", "PASS" if r <= TARGET else "FAIL"])
            for other in (ACC, FT):
                if other in lat:
                    checks.append([t, f"graphpass / {other}", f"{lat[GP][t][0] / lat[other][t][0]:.3f}", ""])
        print()
        print(tabulate(checks, headers=["tokens", "target", "ratio", "verdict"]))
        if not cuda:
            print("(device cpu: a smoke run of the code path; the target is about the GPU)")


if __name__ == "__main__":
    main()
