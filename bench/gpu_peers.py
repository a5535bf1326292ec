"""Peers on the same model (issue 13 item 3): graphpass offload beside diffusers group offloading and
FlexTensor 0.5.0 on one diffusers transformer, same precision, batch and inputs, in one process.

    python bench/gpu_peers.py                          # H200: Flux-style transformer, 3.0 GiB bf16
    python bench/gpu_peers.py --device cpu --small     # smoke test of the code path, no CUDA

Model: ``diffusers.FluxTransformer2DModel`` from a config with seeded random weights (no download):
by default 2 double-stream + 6 single-stream blocks at Flux width (24 heads x 128 = 3072, joint
attention dim 4096), 2.97 GiB of bf16 weights of which 2.85 GiB are in the blocks (648 MiB per
double block, 270 MiB per single block); batch 1, a 1024x1024 image (4096 latent tokens) and 512
text tokens. Moving the blocks' weights (~55 ms at ~55 GB/s) takes longer than the compute
(estimated ~25 ms on an H200), so the offload runtime decides the latency.

Variants (each in try/except: a peer that fails prints what failed and the script goes on):

* ``resident``: the whole model on the device, ``torch.compile(backend="inductor")``: compute
  reference for latency and for ``max |diff|``;
* ``graphpass``: ``graphpass.offload(storage="pinned", prefetch_distance=1)`` of the blocks,
  ``torch.compile(backend=graphpass.backend(then="inductor", traps=<the blocks>))``;
* ``diffusers group``: ``model.enable_group_offload(onload_device, offload_device="cpu",
  offload_type="block_level", num_blocks_per_group=N, use_stream=True)``, eager (its documented
  path), and ``diffusers group + compile``: the same then ``model.compile()`` (diffusers made group
  offloading compatible with ``torch.compile`` in PR 11605; its test raises Dynamo's cache limit);
* ``flextensor``: ``flextensor.offload(model, OffloadConfig(include_patterns=<the blocks>))`` then
  the discovery/profiling forwards (README quickstart, eager) and ``flextensor + compile_fn``: the
  same with ``compile_fn=torch.compile`` per offloaded unit (the compiled path of ``offload()``).
  FlexTensor's beartype runtime checks are off (``DISABLE_BEARTYPE=1`` unless set otherwise).
  Equal memory: ``max_gpu_mem_fraction`` = graphpass's measured peak / device memory and
  ``num_blocks=min_blocks=2`` (its docs suggest 2 for diffusers-like models); if that run fails,
  once more without a budget (the README's own call), reported as ``... no budget``.

Order: resident, graphpass, diffusers eager, flextensor eager, diffusers + compile, flextensor +
compile_fn; a variant not started within ``--time-budget`` seconds (default 85, for a 120 s
``timeout``) is skipped, and on SIGTERM the variant in progress is reported as killed, the table of
what finished is printed and the exit status is 124.

Each variant: warm-up forwards (compilation, a peer's discovery/profiling), then ``--iters`` timed
forwards, each between a synchronize and CUDA events (perf_counter on CPU); median reported. Peak
device memory is ``torch.cuda.max_memory_allocated`` over the timed forwards (reset after warm-up),
``alloc before`` what was allocated when the variant started (should be ~0: the previous variant
freed). Target: graphpass at or below the fastest peer's latency at equal device memory.
When the fastest peer is faster than graphpass with more device memory, graphpass runs again with
``max_device_bytes`` set so that its peak matches that peer's (a share of the blocks resident): the
comparison at equal memory.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import signal
import statistics
import sys
import time
import traceback

import torch
from tabulate import tabulate

MiB = 1 << 20
BLOCKS = [r"transformer_blocks\.\d+", r"single_transformer_blocks\.\d+"]  # graphpass: regex, fullmatch
FT_BLOCKS = ["transformer_blocks.*", "single_transformer_blocks.*"]  # flextensor: '*' is one segment
CONTAINERS = ("transformer_blocks", "single_transformer_blocks")
RES, GP = "resident, inductor", "graphpass pinned p1 -> inductor"
DG, DGC = "diffusers group offload (stream, eager)", "diffusers group offload (stream) + compile"
FT, FTC = "flextensor (eager, quickstart)", "flextensor + compile_fn"
GPE = "graphpass at the fastest peer's peak (max_device_bytes)"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny model (smoke run of the code path)")
    ap.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    ap.add_argument("--single-layers", type=int, default=6, help="single-stream blocks")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--image", type=int, default=1024, help="image side in pixels: (image/16)^2 latent tokens")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dg-blocks", type=int, default=1, help="diffusers num_blocks_per_group (1: lowest memory)")
    ap.add_argument(
        "--ft-mem-fraction",
        default="auto",
        help="flextensor max_gpu_mem_fraction: 'auto' (graphpass peak / device memory), 'none', or a number",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=85.0,
        help="seconds from the start; a variant not started by then is skipped (one started runs on)",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["resident", "graphpass", "diffusers", "diffusers-compile", "flextensor", "flextensor-compile"],
    )
    args = ap.parse_args()
    if args.small:
        args.layers, args.single_layers, args.heads, args.image, args.text_tokens = 1, 2, 2, 128, 16
        args.iters = min(args.iters, 5)
    return args


def flux_config(args) -> dict:
    small = args.small
    head_dim = 32 if small else 128
    return dict(
        patch_size=1,
        in_channels=64,
        num_layers=args.layers,
        num_single_layers=args.single_layers,
        attention_head_dim=head_dim,
        num_attention_heads=args.heads,
        joint_attention_dim=64 if small else 4096,
        pooled_projection_dim=32 if small else 768,
        guidance_embeds=True,
        axes_dims_rope=(8, 12, 12) if small else (16, 56, 56),
    )


def build(cfg: dict, sd: dict[str, torch.Tensor]):
    """A model on the CPU sharing ``sd``'s tensors (no copy)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**cfg)
    model.load_state_dict(sd, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on meta: {left[:5]}")
    return model.eval().requires_grad_(False)


def make_state_dict(cfg: dict, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded random weights (made on ``device``, fast on a GPU), kept on the CPU. Matrices ~
    N(0, 1/(3 fan_in)) like nn.Linear's default init; 1-D weights (norms) ~1; biases small."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        shapes = {n: (t.shape, t.dtype) for n, t in FluxTransformer2DModel(**cfg).state_dict().items()}
    g = torch.Generator(device=device).manual_seed(0)
    sd = {}
    for name, (shape, _) in shapes.items():
        t = torch.randn(shape, generator=g, device=device)
        if len(shape) >= 2:
            t = t * (3 * shape[1:].numel()) ** -0.5
        elif name.endswith("weight"):
            t = 1 + 0.05 * t
        else:
            t = 0.02 * t
        sd[name] = t.to(dtype).cpu()
    return sd


def make_inputs(cfg: dict, args, device: torch.device, dtype: torch.dtype) -> dict:
    side = args.image // 16
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    inp = dict(
        hidden_states=torch.randn(1, side * side, cfg["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(1, args.text_tokens, cfg["joint_attention_dim"], generator=g),
        pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
    )
    inp = {k: v.to(device=device, dtype=dtype) for k, v in inp.items()}
    inp["img_ids"] = img_ids.reshape(-1, 3).to(device=device, dtype=dtype)
    inp["txt_ids"] = torch.zeros(args.text_tokens, 3, device=device, dtype=dtype)
    return inp


def forward(fn, inputs: dict) -> torch.Tensor:
    return fn(**inputs, return_dict=False)[0]


def time_forwards(fn, inputs: dict, iters: int, warmup: int, device: torch.device) -> dict:
    """Warm-up (timed as a whole), then ``iters`` forwards each between a synchronize and CUDA
    events; peak device memory over the timed forwards."""
    cuda = device.type == "cuda"
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(warmup):
            out = forward(fn, inputs)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        warm_s = time.perf_counter() - t0
        ts = []
        for _ in range(iters):
            if cuda:
                torch.cuda.synchronize(device)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = forward(fn, inputs)
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                out = forward(fn, inputs)
                ts.append((time.perf_counter() - t) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return dict(ms=statistics.median(ts), min_ms=min(ts), peak=peak, warm_s=warm_s, out=out.float().cpu())


def free(device: torch.device) -> None:
    torch._dynamo.reset()  # compiled code holds the models; graphpass.offload refuses a compiled class
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class OutOfTime(BaseException):
    """SIGTERM (``timeout``): stop the variant in progress, still print the table."""


def on_sigterm(signum, frame) -> None:
    raise OutOfTime()


class Runner:
    """Runs the variants one after another, each in try/except, within the time budget."""

    def __init__(self, args, cfg, sd, inputs, device):
        self.args, self.cfg, self.sd, self.inputs, self.device = args, cfg, sd, inputs, device
        self.cuda = device.type == "cuda"
        self.results: dict[str, dict] = {}
        self.notes: dict[str, str] = {}
        self.sections: list[list] = []
        self.t_start = time.perf_counter()

    def attempt(self, name: str, body) -> None:
        elapsed = time.perf_counter() - self.t_start
        if elapsed > self.args.time_budget:
            self.notes[name] = f"skipped: {elapsed:.0f} s of the {self.args.time_budget:.0f} s budget spent"
            print(f"[{name}] {self.notes[name]}", flush=True)
            return
        before = torch.cuda.memory_allocated(self.device) if self.cuda else None
        t0 = time.perf_counter()
        try:
            res = body()
            res["before"] = before
            self.results[name] = res
            print(
                f"[{name}] median {res['ms']:.2f} ms, warm-up {res['warm_s']:.1f} s"
                + (f", peak {res['peak'] / MiB:.0f} MiB" if res["peak"] is not None else ""),
                flush=True,
            )
        except OutOfTime:
            self.notes[name] = f"killed by SIGTERM (out of time) {time.perf_counter() - t0:.0f} s into this variant"
            raise
        except Exception as exc:  # a peer failing must not lose the others
            msg = str(exc).strip().splitlines()
            frames = traceback.extract_tb(exc.__traceback__)
            last = ([f for f in frames if "/torch/" not in f.filename] or frames)[-1]  # the caller into torch
            where = f"{'/'.join(last.filename.split('/')[-2:])}:{last.lineno} in {last.name}"
            self.notes[name] = f"FAILED: {type(exc).__name__}: {msg[0][:300] if msg else ''} (raised at {where})"
            print(f"[{name}] FAILED:", flush=True)
            traceback.print_exc(file=sys.stdout)
        finally:
            free(self.device)
        self.sections.append([name, f"{time.perf_counter() - t0:.1f}"])

    def time(self, fn) -> dict:
        return time_forwards(fn, self.inputs, self.args.iters, self.args.warmup, self.device)

    # ---- the variants
    def resident(self) -> dict:
        model = build(self.cfg, self.sd).to(self.device)
        return self.time(torch.compile(model, backend="inductor", dynamic=False))

    def graphpass(self, budget: int | None = None) -> dict:
        import graphpass

        torch._dynamo.reset()  # offload() refuses a class Dynamo holds compiled code for
        model = build(self.cfg, self.sd)
        cfg = graphpass.OffloadConfig(
            include_patterns=BLOCKS,
            device=str(self.device),
            storage="pinned" if self.cuda else "cpu",
            prefetch_distance=1,
            max_device_bytes=budget,
        )
        state = graphpass.offload(model, cfg)
        print(f"[graphpass] {state}" + (f", max_device_bytes {budget / MiB:.0f} MiB" if budget else ""))
        compiled = torch.compile(model, backend=graphpass.backend(then="inductor", traps=BLOCKS), dynamic=False)
        res = self.time(compiled)
        stats = graphpass.memory_stats(compiled)
        print(f"[graphpass] memory_stats: {stats}")
        res["offloaded_peak"] = stats.peak_resident_bytes
        return res

    def equal_memory_budget(self) -> int | None:
        """``max_device_bytes`` that brings graphpass's peak to the fastest peer's (when the peer's is
        higher): the peer's peak less what graphpass holds beside its offloaded tensors."""
        gp = self.results.get(GP)
        peers = [self.results[n] for n in (DG, FT, FT + " no budget") if n in self.results]
        if not self.cuda or gp is None or not peers:
            return None
        fastest = min(peers, key=lambda p: p["ms"])
        if fastest["ms"] >= gp["ms"] or fastest["peak"] <= gp["peak"]:
            return None
        return int(fastest["peak"] - (gp["peak"] - gp["offloaded_peak"]))

    def diffusers(self, compile_: bool) -> dict:
        model = build(self.cfg, self.sd)
        # use_stream needs an accelerator: diffusers raises ValueError for onload_device cpu
        model.enable_group_offload(
            onload_device=self.device,
            offload_device="cpu",
            offload_type="block_level",
            num_blocks_per_group=self.args.dg_blocks,
            use_stream=self.cuda,
        )
        if compile_:
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 1000)
            model.compile()
        return self.time(model)

    def ft_fraction(self, choice: str) -> float | None:
        if choice == "none":
            return None
        if choice != "auto":
            return float(choice)
        gp = self.results.get(GP)
        if not self.cuda or gp is None:
            return None
        return min(1.0, gp["peak"] / torch.cuda.get_device_properties(self.device).total_memory)

    def flextensor(self, compile_: bool, fraction: str) -> dict:
        import flextensor as ft

        model = build(self.cfg, self.sd)
        for name, child in model.named_children():
            if name not in CONTAINERS:
                child.to(self.device)  # flextensor streams the included blocks; the rest is placed by the user
        frac = self.ft_fraction(fraction)
        # pinned_memory (default True) raises without CUDA; on a CPU smoke run try the pageable path
        cfg = ft.OffloadConfig(
            include_patterns=FT_BLOCKS,
            gpu_device=self.device.index or 0,
            pinned_memory=self.cuda,
            max_gpu_mem_fraction=frac,
            num_blocks=2,
            min_blocks=2,
        )
        print(f"[flextensor] max_gpu_mem_fraction={frac}, num_blocks=2", flush=True)
        try:
            fn = ft.offload(model, cfg, compile_fn=(lambda m: torch.compile(m, dynamic=False)) if compile_ else None)
            om = ft.get_offload_manager()
            n = om.iters_before_inference
            t0 = time.perf_counter()
            with torch.no_grad():
                for _ in range(n):
                    forward(fn, self.inputs)
            print(f"[flextensor] {n} discovery/profiling forwards: {time.perf_counter() - t0:.1f} s", flush=True)
            res = self.time(fn)
            try:
                print(f"[flextensor] gpu memory usage: {ft.get_gpu_memory_usage()}")
            except Exception as exc:
                print(f"[flextensor] get_gpu_memory_usage: {type(exc).__name__}: {exc}")
            return res
        finally:
            try:
                ft.release(preserve_model=False)
            except Exception as exc:
                print(f"[flextensor] release: {type(exc).__name__}: {exc}")


def run_all(r: Runner) -> None:
    """Most telling first: a variant not started within ``--time-budget`` is skipped."""
    v = r.args.variants
    if "resident" in v:
        r.attempt(RES, r.resident)
    if "graphpass" in v:
        r.attempt(GP, r.graphpass)
    if "diffusers" in v:
        r.attempt(DG, lambda: r.diffusers(False))
    ft_ok = True
    try:
        importlib.import_module("flextensor")
    except Exception as exc:
        ft_ok = False
        for key, name in (("flextensor", FT), ("flextensor-compile", FTC)):
            if key in v:
                r.notes[name] = f"not available: import flextensor: {type(exc).__name__}: {exc}"
                print(f"[{name}] {r.notes[name]}")
    if ft_ok and "flextensor" in v:
        r.attempt(FT, lambda: r.flextensor(False, r.args.ft_mem_fraction))
        if FT in r.notes and r.args.ft_mem_fraction != "none" and r.cuda:
            # the budget closest to graphpass's peak failed: the README quickstart has no budget
            r.attempt(FT + " no budget", lambda: r.flextensor(False, "none"))
    budget = r.equal_memory_budget() if "graphpass" in v else None
    if budget is not None:  # a faster peer that used more memory: graphpass given the same memory
        r.attempt(GPE, lambda: r.graphpass(budget))
    if "diffusers-compile" in v:
        r.attempt(DGC, lambda: r.diffusers(True))
    if ft_ok and "flextensor-compile" in v:
        r.attempt(FTC, lambda: r.flextensor(True, r.args.ft_mem_fraction))


def report(r: Runner) -> None:
    ref = r.results.get(RES)
    gp = r.results.get(GP)
    rows = []
    for name, res in r.results.items():
        diff = "-" if ref is None or name == RES else f"{(res['out'] - ref['out']).abs().max().item():.2e}"
        peak = res["peak"]
        rows.append(
            [
                name,
                f"{res['ms']:.2f}",
                f"{res['min_ms']:.2f}",
                f"{res['ms'] / gp['ms']:.2f}" if gp else "-",
                f"{peak / MiB:.0f}" if peak is not None else "n/a",
                f"{peak / gp['peak']:.2f}" if peak is not None and gp and gp["peak"] else "-",
                f"{res['before'] / MiB:.0f}" if res["before"] is not None else "n/a",
                diff,
            ]
        )
    print()
    print(
        tabulate(
            rows,
            headers=[
                "variant",
                "median ms",
                "min ms",
                "ms / graphpass",
                "peak device MiB",
                "peak / graphpass peak",
                "alloc before MiB",
                "max |diff| vs resident",
            ],
        )
    )
    if r.notes:
        print()
        print(tabulate(list(r.notes.items()), headers=["variant not measured", "what happened"]))
    print()
    print(tabulate(r.sections, headers=["section", "seconds (build, compile, warm-up, timing)"]))
    peers = {n: x for n, x in r.results.items() if n not in (RES, GP, GPE)}
    if gp and peers:
        best = min(peers, key=lambda n: peers[n]["ms"])
        for name in (GP, GPE):
            mine = r.results.get(name)
            if mine is not None:
                ok = mine["ms"] <= peers[best]["ms"]
                print(
                    f"\ntarget: {name} {mine['ms']:.2f} ms <= fastest peer {best} {peers[best]['ms']:.2f} ms: "
                    f"{'PASS' if ok else 'FAIL'} (ratio {mine['ms'] / peers[best]['ms']:.3f}, peak "
                    f"{mine['peak'] / max(1, peers[best]['peak'] or 1):.2f} x the peer's)"
                    if r.cuda
                    else ""
                )
    if not r.cuda:
        print("(device cpu: a smoke run of the code path; latency and memory targets are about the GPU)")


def main() -> None:
    args = parse_args()
    # flextensor wraps its whole package in beartype runtime checks unless this is set: off, so the
    # peer runs without checking overhead (DISABLE_BEARTYPE=0 in the environment keeps them)
    os.environ.setdefault("DISABLE_BEARTYPE", "1")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_peers.py --device cuda needs a CUDA device (use --device cpu --small for a smoke run)")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    t0 = time.perf_counter()
    cfg = flux_config(args)
    sd = make_state_dict(cfg, device, dtype)
    total = sum(t.nbytes for t in sd.values())
    blocks = sum(t.nbytes for k, t in sd.items() if k.split(".")[0] in CONTAINERS)
    inputs = make_inputs(cfg, args, device, dtype)
    print(
        f"model: FluxTransformer2DModel {cfg}\n  {total / MiB:.0f} MiB {str(dtype).replace('torch.', '')} weights, "
        f"{blocks / MiB:.0f} MiB in the {args.layers + args.single_layers} blocks (streamed); batch 1, "
        f"{(args.image // 16) ** 2} image + {args.text_tokens} text tokens; made in {time.perf_counter() - t0:.1f} s"
    )
    if cuda:
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    for mod in ("diffusers", "flextensor", "graphpass"):
        try:
            print(
                f"  {mod} {__import__(mod).__version__}"
                + (f" (DISABLE_BEARTYPE={os.environ['DISABLE_BEARTYPE']})" if mod == "flextensor" else "")
            )
        except Exception as exc:
            print(f"  {mod}: {type(exc).__name__}: {exc}")
    print(
        f"{args.iters} timed forwards (median) after {args.warmup} warm-up; time budget {args.time_budget:.0f} s\n",
        flush=True,
    )
    if not cuda:
        print(
            "device cpu: graphpass uses storage='cpu' and diffusers use_stream=False (diffusers raises ValueError "
            "for use_stream with a cpu onload device); the names below keep their GPU labels"
        )
    r = Runner(args, cfg, sd, inputs, device)
    signal.signal(signal.SIGTERM, on_sigterm)
    killed = False
    try:
        run_all(r)
    except OutOfTime:
        killed = True
        print("\nSIGTERM: out of time; the table holds what finished", flush=True)
    report(r)
    print(f"total {time.perf_counter() - t0:.1f} s")
    if killed:
        sys.exit(124)


if __name__ == "__main__":
    main()
