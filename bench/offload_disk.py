"""Disk offload on CPU: peak RSS and per-forward latency of a model whose weights stay in a
safetensors checkpoint, against the same model fully loaded and against accelerate's disk offload.

    python bench/offload_disk.py [--layers 16 --hidden 2048 --inter 8192] [--tokens-large auto]
                                 [--iters 10] [--rounds 2] [--workdir /tmp/graphpass-offload-disk] [--small]

Model: a stack of ``--layers`` attention-free decoder-like blocks (LayerNorm, Linear hidden->inter,
GELU, Linear inter->hidden, residual), fp32, then a small final norm and a 256-wide head; the
input is ``tokens x hidden`` activations (no embedding). Defaults: 16 layers of 128 MiB = 2 GiB.
The checkpoint is written once to ``--workdir/model.safetensors`` (tensor names = module FQNs)
and reused while its shape matches.

Each variant runs in a fresh process (``--variant NAME``) that starts from that checkpoint:

* ``no-offload``: meta model + ``load_state_dict(safetensors load_file, assign=True)``,
  ``torch.compile(backend="inductor")``.
* ``graphpass-disk``: meta model + ``graphpass.offload(storage="disk", include ["layers.*"],
  checkpoint=...)``, ``torch.compile(backend="graphpass")`` (delegates to inductor). Layer
  weights are read from the checkpoint per trap.
* ``accelerate-disk``: meta model + ``accelerate.dispatch_model`` with every layer on ``"disk"``
  and an offload index pointing into the checkpoint (what transformers does for a safetensors
  checkpoint with ``device_map`` ``"disk"``), execution device cpu. Eager: accelerate's hooks
  swap parameters in Python on every call and graph-break under torch.compile.
* ``accelerate-disk-dat`` (optional): ``accelerate.load_checkpoint_and_dispatch`` with an
  ``offload_folder``: weights copied once to accelerate's ``.dat`` memmaps, then read from them.

Each process compiles with ``dynamic=False``, warms up both shapes, then times ``--iters``
forwards at batch 1 (1 token) and at ``--tokens-large`` tokens, and reports the median and the
minimum. ``--rounds`` processes per variant run in alternation (A B C A B C); a variant's latency
is its best round, its peak RSS its highest. The CPU time other processes took during each timed
phase is printed: on a shared 2-core machine it inflates latencies. Peak RSS
is the kernel's high-water mark of the process (``VmHWM``: setup, compile and run); the
forward-phase peak is the high-water mark after a reset (``/proc/self/clear_refs``) just before
the timed phase. ``--tokens-large auto`` picks the smallest power of two (from 8) at which one
layer's eager compute time is at least ``--compute-over-read`` (2) x the read time per trap
(layer bytes / read bandwidth, measured with ``os.preadv`` on the checkpoint file) and at least
1.5 x its 1-token time (compute-bound: below that a layer's compute is itself one pass over its
weights in memory). ``--threads`` sets torch's threads in the variant processes (they inherit the environment:
``OMP_WAIT_POLICY`` etc., printed). The page cache is warm (the checkpoint was just written or
read), so "disk" reads come from memory: the forwards measure the read path, not the storage
device. Outputs are compared with the no-offload run's on the same inputs.

Each variant is also put against its own bound, max(compute, streamed bytes per forward / read
bandwidth): compute is the no-offload run's median at that batch; streamed bytes are what
``graphpass.memory_stats`` counted (graphpass) or every offloaded layer (accelerate); the read
bandwidth is that of the variant's read path, measured in the same run on the checkpoint: graphpass's
(``POSIX_FADV_WILLNEED``, a private mapping of each tensor's region, a fault per page, the unmap) and
a copy with ``os.preadv`` (accelerate's). Warm: before the variants. Cold (unless ``--no-cold``): after
them, on a few layers each dropped from the page cache with ``POSIX_FADV_DONTNEED`` (clean pages of
this file only; no root, ``/proc/sys/vm/drop_caches`` is not used), checked with ``mincore``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import json
import mmap
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = ("no-offload", "graphpass-disk", "accelerate-disk")
OPTIONAL = ("accelerate-disk-dat",)
HEAD = 256
MiB = 1 << 20
GiB = 1 << 30


class Block(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, inter)
        self.down = nn.Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, layers: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, inter) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, HEAD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


# ---------------------------------------------------------------------------------------------
# helpers


def proc_status() -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def layer_names(i: int) -> list[str]:
    return [f"layers.{i}.{m}.{p}" for m in ("norm", "up", "down") for p in ("weight", "bias")]


def inputs(args, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens))


def ckpt_path(args) -> Path:
    return Path(args.workdir) / "model.safetensors"


def ckpt_matches(args) -> bool:
    from safetensors import safe_open

    p = ckpt_path(args)
    if not p.is_file():
        return False
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:
        return False
    return meta.get("shape") == f"{args.layers}x{args.hidden}x{args.inter}"


def write_checkpoint(args) -> None:
    """Random weights (seeded), scaled so that the residual stream stays O(1) over all layers."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    h, n = args.hidden, args.inter
    sd: dict[str, torch.Tensor] = {}
    for i in range(args.layers):
        sd[f"layers.{i}.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        sd[f"layers.{i}.norm.bias"] = 0.1 * torch.randn(h, generator=g)
        sd[f"layers.{i}.up.weight"] = torch.randn(n, h, generator=g) * h**-0.5
        sd[f"layers.{i}.up.bias"] = 0.1 * torch.randn(n, generator=g)
        sd[f"layers.{i}.down.weight"] = torch.randn(h, n, generator=g) * (0.5 * n**-0.5)
        sd[f"layers.{i}.down.bias"] = 0.1 * torch.randn(h, generator=g)
    sd["norm.weight"] = torch.ones(h)
    sd["norm.bias"] = torch.zeros(h)
    sd["head.weight"] = torch.randn(HEAD, h, generator=g) * h**-0.5
    sd["head.bias"] = torch.zeros(HEAD)
    p = ckpt_path(args)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    save_file(sd, str(tmp), metadata={"format": "pt", "shape": f"{args.layers}x{args.hidden}x{args.inter}"})
    os.replace(tmp, p)


def layer_spans(args) -> list[list[tuple[int, int]]]:
    """Per layer, the (file offset, size) of each of its tensors in the checkpoint."""
    with open(ckpt_path(args), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    return [
        [
            (base + header[k]["data_offsets"][0], header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
            for k in layer_names(i)
        ]
        for i in range(args.layers)
    ]


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    return libc


def resident_fraction(fd: int, off: int, size: int) -> float:
    """Fraction of the file region's pages in the page cache (mincore over a mapping that is never touched)."""
    libc, page = _libc(), mmap.PAGESIZE
    start = off - off % page
    length = off - start + size
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    try:
        vec = ctypes.create_string_buffer((length + page - 1) // page)
        if libc.mincore(addr, length, vec) != 0:
            return float("nan")
        return sum(b & 1 for b in vec.raw) / len(vec.raw)
    finally:
        libc.munmap(addr, length)


def read_preadv(fd: int, layer: list, mv: memoryview) -> None:
    """A copy into a reused buffer (accelerate's reads, the ``storage="cpu"`` path)."""
    for off, size in layer:
        got = 0
        while got < size:
            got += os.preadv(fd, [mv[got:size]], off + got)


def read_mmap(fd: int, layer: list, libc) -> None:
    """graphpass's disk -> cpu path (``runtime.OffloadRuntime._map``): POSIX_FADV_WILLNEED, a private
    mapping of each tensor's region, its pages faulted in (one byte read per page, as the compute's
    first pass does), and the unmap. The bytes themselves are then read by the compute."""
    gran = mmap.ALLOCATIONGRANULARITY
    for off, size in layer:
        os.posix_fadvise(fd, off, size, os.POSIX_FADV_WILLNEED)
        start = off - off % gran
        length = off - start + size
        addr = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, start)
        region = (ctypes.c_char * length).from_address(addr)
        torch.frombuffer(region, dtype=torch.uint8)[:: mmap.PAGESIZE].sum()
        del region
        libc.munmap(addr, length)


def _read_paths(args) -> tuple[dict, list, int]:
    libc, spans = _libc(), layer_spans(args)
    mv = memoryview(torch.empty(max(s for _, s in spans[0]), dtype=torch.uint8).numpy())
    paths = {
        "preadv": lambda fd, layer: read_preadv(fd, layer, mv),
        "mmap": lambda fd, layer: read_mmap(fd, layer, libc),
    }
    return paths, spans, sum(s for _, s in spans[0])


def read_bandwidths(args) -> tuple[dict, int]:
    """Bytes/s of each read path with a WARM page cache ({"preadv"|"mmap": {"warm": bw}}, best of 2 passes
    over every layer: the checkpoint was just written or read) and the bytes of one layer."""
    paths, spans, layer_bytes = _read_paths(args)
    out, fd = {}, os.open(str(ckpt_path(args)), os.O_RDONLY)
    try:
        for name, read in paths.items():
            out[name] = {"warm": layer_bytes / min(_timed(read, fd, layer) for _ in range(2) for layer in spans)}
    finally:
        os.close(fd)
    return out, layer_bytes


def cold_bandwidths(args, bws: dict, layers: int = 4) -> str:
    """Adds "cold" (bytes/s or None) to each path of ``bws``, measured on ``layers`` layers per path, each
    dropped from the page cache first with POSIX_FADV_DONTNEED (clean pages of this file only, no root
    needed; /proc/sys/vm/drop_caches is not used) and checked with mincore; returns how. Run after the
    variants: pages read back in come in smaller page-cache folios than the written file's, which makes
    the mapped path fault more often."""
    paths, spans, layer_bytes = _read_paths(args)
    layers = max(1, min(layers, len(spans) // len(paths)))  # distinct layers per path
    resid, fd = [], os.open(str(ckpt_path(args)), os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages (a checkpoint just written) are not dropped
        for k, (name, read) in enumerate(paths.items()):
            times = []
            for layer in spans[k * layers : (k + 1) * layers]:
                page = mmap.PAGESIZE  # whole pages only are dropped: widen each region to its pages
                for off, size in layer:  # a layer's tensors need not be adjacent in the file
                    os.posix_fadvise(fd, off - off % page, size + off % page + page, os.POSIX_FADV_DONTNEED)
                resid.append(sum(resident_fraction(fd, off, size) * size for off, size in layer) / layer_bytes)
                times.append(_timed(read, fd, layer))
            bws[name]["cold"] = layer_bytes * len(times) / sum(times) if max(resid) < 0.05 else None
    finally:
        os.close(fd)
    return (
        f"POSIX_FADV_DONTNEED on each measured layer's region ({layers} layers per path), after which "
        f"{max(resid) * 100:.1f}% of it was still cached (mincore)"
        + ("" if max(resid) < 0.05 else ": not cold, no cold bandwidth reported")
    )


def _timed(read, fd: int, layer: list) -> float:
    t = time.perf_counter()
    read(fd, layer)
    return time.perf_counter() - t


def layer_compute_seconds(args, tokens: int, reps: int = 5) -> float:
    """Eager time of one block at ``tokens`` (min of ``reps``: the least disturbed by other processes)."""
    torch.manual_seed(0)
    blk = Block(args.hidden, args.inter).eval()
    x = torch.randn(tokens, args.hidden)
    with torch.no_grad():
        blk(x)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            blk(x)
            ts.append(time.perf_counter() - t)
    return min(ts)


# ---------------------------------------------------------------------------------------------
# one variant, in its own process


def build(args, variant: str):
    """(what to call, the model, how it runs) for one variant, built from the checkpoint."""
    ckpt = str(ckpt_path(args))
    if variant == "no-offload":
        from safetensors.torch import load_file

        with torch.device("meta"):
            model = Stack(args.layers, args.hidden, args.inter)
        model.load_state_dict(load_file(ckpt), assign=True)
        model.eval()
        return torch.compile(model, backend="inductor", dynamic=False), model, "inductor"
    if variant == "graphpass-disk":
        import graphpass

        with torch.device("meta"):
            model = Stack(args.layers, args.hidden, args.inter)
        model.eval().requires_grad_(False)  # storage="disk" is inference-only and refuses weights that require grad
        cfg = graphpass.OffloadConfig(
            include_patterns=["layers.*"],
            exclude_patterns=[],
            device="cpu",
            storage="disk",
            disk_path=None,
            prefetch_distance=args.prefetch,
            max_device_bytes=None,
        )
        graphpass.offload(model, cfg, checkpoint=ckpt)
        return torch.compile(model, backend="graphpass", dynamic=False), model, "graphpass -> inductor"
    if variant == "accelerate-disk":
        from accelerate import dispatch_model
        from safetensors import safe_open

        with torch.device("meta"):
            model = Stack(args.layers, args.hidden, args.inter)
        model.eval()
        device_map = {f"layers.{i}": "disk" for i in range(args.layers)} | {"norm": "cpu", "head": "cpu"}
        with safe_open(ckpt, framework="pt") as f:
            resident = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("layers.")}
        model.load_state_dict(resident, assign=True, strict=False)
        index = {
            k: {"safetensors_file": ckpt, "weight_name": k, "dtype": "float32"}
            for i in range(args.layers)
            for k in layer_names(i)
        }
        dispatch_model(model, device_map, main_device="cpu", offload_index=index)
        return model, model, "eager (accelerate hooks)"
    if variant == "accelerate-disk-dat":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch

        with init_empty_weights():
            model = Stack(args.layers, args.hidden, args.inter)
        model.eval()
        device_map = {f"layers.{i}": "disk" for i in range(args.layers)} | {"norm": "cpu", "head": "cpu"}
        model = load_checkpoint_and_dispatch(
            model, ckpt, device_map=device_map, offload_folder=str(Path(args.workdir) / "accelerate-offload")
        )
        return model, model, "eager (accelerate hooks, .dat memmaps)"
    raise SystemExit(f"unknown variant {variant!r}")


def stats_dict(s) -> dict:
    d = dataclasses.asdict(s) if dataclasses.is_dataclass(s) else dict(vars(s))
    if hasattr(s, "peak_resident_bytes"):
        d["peak_resident_bytes"] = s.peak_resident_bytes
    return d


def timed_forwards(fn, x: torch.Tensor, iters: int) -> list[float]:
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t)
    return ts


def run_variant(args) -> None:
    import psutil

    variant = args.variant
    t0 = time.perf_counter()
    fn, model, how = build(args, variant)
    setup_s = time.perf_counter() - t0
    x1, xn = inputs(args, 1), inputs(args, args.tokens_large)
    gp = None
    if variant == "graphpass-disk":
        import graphpass as gp
    with torch.no_grad():
        t0 = time.perf_counter()
        for x in (x1, xn):
            for _ in range(2):
                out = fn(x)
        warm_s = time.perf_counter() - t0
        outs = {"b1": fn(x1).clone(), "bN": fn(xn).clone()}
        torch.save(outs, Path(args.workdir) / f"out-{variant}.pt")
        del out, outs
        setup_status = proc_status()
        if gp is not None:
            gp.memory_stats(fn, reset=True)
        reset_ok = reset_peak_rss()
        me = psutil.Process()
        cpu0, own0, w0 = psutil.cpu_times(), me.cpu_times(), time.perf_counter()
        lat = {key: timed_forwards(fn, x, args.iters) for key, x in (("b1", x1), ("bN", xn))}
        cpu1, own1, wall = psutil.cpu_times(), me.cpu_times(), time.perf_counter() - w0
    run_status = proc_status()
    busy = lambda c: c.user + c.nice + c.system + getattr(c, "irq", 0) + getattr(c, "softirq", 0)  # noqa: E731
    own = (own1.user + own1.system) - (own0.user + own0.system)
    rec = {
        "variant": variant,
        "how": how,
        "setup_s": setup_s,
        "warmup_s": warm_s,
        "lat_b1": statistics.median(lat["b1"]),
        "lat_bN": statistics.median(lat["bN"]),
        "min_b1": min(lat["b1"]),
        "min_bN": min(lat["bN"]),
        "lat_b1_all": lat["b1"],
        "lat_bN_all": lat["bN"],
        "peak_rss": max(setup_status["VmHWM"], run_status["VmHWM"]),
        "peak_rss_forward": run_status["VmHWM"] if reset_ok else None,
        "rss_end": run_status["VmRSS"],
        "rss_anon_end": run_status.get("RssAnon"),
        "rss_file_end": run_status.get("RssFile"),
        "threads": torch.get_num_threads(),
        # CPU use during the timed phase, in cores: this process, and every other process
        "own_cores": own / wall,
        "other_cores": max(0.0, (busy(cpu1) - busy(cpu0)) - own) / wall,
    }
    if gp is not None:
        try:
            rec["memory_stats"] = stats_dict(gp.memory_stats(fn))
            rec["memory_stats"]["forwards"] = 2 * args.iters
        except Exception as exc:  # report, do not lose the timings
            rec["memory_stats_error"] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps(rec), flush=True)


# ---------------------------------------------------------------------------------------------
# parent


def child(args, variant: str, timeout: float) -> dict | None:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--variant",
        variant,
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--inter",
        str(args.inter),
        "--tokens-large",
        str(args.tokens_large),
        "--iters",
        str(args.iters),
        "--workdir",
        args.workdir,
        "--prefetch",
        str(args.prefetch),
        "--threads",
        str(args.threads),
    ]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"[{variant}] timed out after {timeout:.0f} s")
        return None
    wall = time.perf_counter() - t0
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[len("RESULT ") :])
            rec["wall_s"] = wall
            return rec
    print(f"[{variant}] failed (exit {p.returncode}); last output:")
    print("\n".join((p.stdout + p.stderr).splitlines()[-40:]))
    return None


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--tokens-large", default="auto", help="token count of the large batch, or 'auto'")
    ap.add_argument(
        "--compute-over-read",
        type=float,
        default=2.0,
        help="auto --tokens-large: smallest power of two with layer compute >= this x read time",
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each variant process (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per variant, run in alternation")
    ap.add_argument("--prefetch", type=int, default=1, help="graphpass prefetch_distance")
    ap.add_argument("--workdir", default="/tmp/graphpass-offload-disk")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + OPTIONAL)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per variant process")
    ap.add_argument(
        "--no-cold",
        dest="cold",
        action="store_false",
        help="skip the cold-page-cache bandwidth (POSIX_FADV_DONTNEED on the checkpoint, after the runs)",
    )
    ap.add_argument("--small", action="store_true", help="smoke run: 4 layers, hidden 256, inter 1024")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    ap.add_argument("--write", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.small:
        args.layers, args.hidden, args.inter = 4, 256, 1024
        if args.workdir == ap.get_default("workdir"):
            args.workdir += "-small"
    return args


def prepare(args) -> tuple[dict, int]:
    """Writes or reuses the checkpoint, measures the warm read bandwidths, prints the setup; returns
    the bandwidths and the bytes of one layer."""
    # the checkpoint is written in its own process so that this one stays small
    if ckpt_matches(args):
        print(f"checkpoint: reusing {ckpt_path(args)}")
    else:
        t0 = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--write",
                "--layers",
                str(args.layers),
                "--hidden",
                str(args.hidden),
                "--inter",
                str(args.inter),
                "--workdir",
                args.workdir,
            ],
            check=True,
        )
        print(f"checkpoint: wrote {ckpt_path(args)} in {time.perf_counter() - t0:.1f} s")
    size = ckpt_path(args).stat().st_size
    bws, layer_bytes = read_bandwidths(args)
    bw = bws["preadv"]["warm"]
    read_s = layer_bytes / bw
    print(
        f"model: {args.layers} layers x (LayerNorm, Linear {args.hidden}->{args.inter}, GELU, Linear "
        f"{args.inter}->{args.hidden}) fp32 + norm + head {args.hidden}->{HEAD}; checkpoint {size / MiB:.0f} MiB "
        f"({size / (1 << 30):.2f} GiB), {layer_bytes / MiB:.1f} MiB per layer (= per trap)"
    )
    print(
        f"read bandwidth, WARM page cache, best of {2 * args.layers} layers: os.preadv into a reused buffer (a copy: "
        f"accelerate's path) {bw / GiB:.2f} GiB/s -> read time per trap {read_s * 1e3:.2f} ms; graphpass's path "
        f"(WILLNEED + private mapping + a fault per page + unmap) {bws['mmap']['warm'] / GiB:.2f} GiB/s -> "
        f"{layer_bytes / bws['mmap']['warm'] * 1e3:.2f} ms"
    )
    print(
        "OpenMP / torch threads in the variant processes: "
        + ", ".join(
            f"{k}={os.environ.get(k, 'unset')}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
        )
        + f", --threads {args.threads or 'torch default'}"
    )
    return bws, layer_bytes


def choose_tokens(args, read_s: float) -> None:
    """Sets ``args.tokens_large`` (``auto``: see the module docstring) and prints the compute probe."""
    from tabulate import tabulate

    probe = []
    c1 = layer_compute_seconds(args, 1)
    probe.append([1, f"{c1 * 1e3:.2f}", f"{c1 / read_s:.2f}", f"{c1 / c1:.2f}"])
    if args.tokens_large == "auto":
        # smallest power of two whose compute is >= k x the read time and compute-bound (>= 1.5 x the
        # 1-token time: below that a layer's compute is itself a pass over its weights in memory)
        chosen = None
        t = 8
        while t <= 1024:
            c = layer_compute_seconds(args, t)
            probe.append([t, f"{c * 1e3:.2f}", f"{c / read_s:.2f}", f"{c / c1:.2f}"])
            if c >= args.compute_over_read * read_s and c >= 1.5 * c1:
                chosen = t
                break
            t *= 2
        args.tokens_large = chosen or 1024
    else:
        args.tokens_large = int(args.tokens_large)
        c = layer_compute_seconds(args, args.tokens_large)
        probe.append([args.tokens_large, f"{c * 1e3:.2f}", f"{c / read_s:.2f}", f"{c / c1:.2f}"])
    print(f"eager compute per layer ({torch.get_num_threads()} threads) vs read time per trap:")
    print(tabulate(probe, headers=["tokens", "compute ms/layer", "compute / read", "compute / 1-token compute"]))
    print(
        f"batch 1 = 1 token; large batch = {args.tokens_large} tokens; {args.iters} timed forwards each "
        f"(median), after warm-up; each variant in a fresh process, {args.rounds} round(s) A B C A B C ...; "
        f"a variant's latency is its best round's median (and min), its peak RSS the highest round's\n"
    )


def run_rounds(args) -> dict[str, list]:
    """Every variant in a fresh process, ``--rounds`` times in alternation; the records per variant."""
    runs: dict[str, list] = {}
    for rnd in range(args.rounds):
        for v in args.variants:
            rec = child(args, v, args.timeout)
            if rec is None:
                continue
            runs.setdefault(v, []).append(rec)
            print(
                f"[{v}, round {rnd + 1}] {rec['how']}: setup {rec['setup_s']:.1f} s, compile+warm-up {rec['warmup_s']:.1f} s, "
                f"process {rec['wall_s']:.1f} s; per-forward ms b1 {fmt_ms(rec['lat_b1_all'])}; "
                f"b{args.tokens_large} {fmt_ms(rec['lat_bN_all'])}; CPU in the timed phase: this process "
                f"{rec['own_cores']:.2f} cores, other processes {rec['other_cores']:.2f} cores",
                flush=True,
            )
            if "memory_stats" in rec:
                m = rec["memory_stats"]
                n = m.pop("forwards")
                print(
                    f"[{v}] graphpass.memory_stats over the {n} timed forwards: {m}; per forward: "
                    f"{m.get('bytes_loaded', 0) / n / MiB:.0f} MiB loaded, {m.get('loads_issued', 0) / n:.0f} loads, "
                    f"{m.get('wait_seconds', 0) / n * 1e3:.1f} ms waiting for loads"
                )
            if "memory_stats_error" in rec:
                print(f"[{v}] graphpass.memory_stats failed: {rec['memory_stats_error']}")
    return runs


def merge_rounds(runs: dict) -> dict:
    """Per variant: the best round's latencies, the highest round's peak RSS and other processes' CPU."""
    results = {}
    for v, recs in runs.items():
        r = dict(recs[0])
        for k in ("lat_b1", "lat_bN", "min_b1", "min_bN"):
            r[k] = min(x[k] for x in recs)
        for k in ("peak_rss", "peak_rss_forward", "other_cores"):
            vals = [x[k] for x in recs if x.get(k) is not None]
            r[k] = max(vals) if vals else None
        results[v] = r
    return results


def print_results(args, results: dict) -> None:
    from tabulate import tabulate

    base = results.get("no-offload")
    ref = torch.load(Path(args.workdir) / "out-no-offload.pt") if base else None
    bn = f"b{args.tokens_large}"

    def ratio(v, key):
        return f"{v[key] / base[key]:.3f}" if base and v.get(key) else "-"

    rows = []
    for v, r in results.items():
        diff = "-"
        if ref is not None and v != "no-offload":
            o = torch.load(Path(args.workdir) / f"out-{v}.pt")
            d = max((o[k] - ref[k]).abs().max().item() for k in ("b1", "bN"))
            scale = max(ref[k].abs().max().item() for k in ("b1", "bN"))
            diff = f"{d:.2e} ({d / scale:.1e} rel)"
            r["diff_ok"] = d <= 1e-3 * max(1.0, scale)
        rows.append(
            [
                v,
                r["how"],
                f"{r['peak_rss'] / MiB:.0f}",
                ratio(r, "peak_rss"),
                f"{r['peak_rss_forward'] / MiB:.0f}" if r.get("peak_rss_forward") else "-",
                f"{r['lat_b1'] * 1e3:.1f} / {r['min_b1'] * 1e3:.1f}",
                f"{ratio(r, 'lat_b1')} / {ratio(r, 'min_b1')}",
                f"{r['lat_bN'] * 1e3:.1f} / {r['min_bN'] * 1e3:.1f}",
                f"{ratio(r, 'lat_bN')} / {ratio(r, 'min_bN')}",
                diff,
            ]
        )
    print(
        tabulate(
            rows,
            headers=[
                "variant",
                "runs as",
                "peak RSS MiB",
                "RSS ratio",
                "fwd-phase peak MiB",
                "b1 ms med / min",
                "b1 ratio med / min",
                f"{bn} ms med / min",
                f"{bn} ratio med / min",
                "max |diff| vs no-offload",
            ],
        )
    )
    print(
        "(ratios vs no-offload; peak RSS = VmHWM of the whole process incl. setup and compile; "
        "page cache warm, so disk reads come from memory; accelerate runs eager)"
    )


def print_checks(args, results: dict) -> None:
    from tabulate import tabulate

    base = results.get("no-offload")
    bn = f"b{args.tokens_large}"
    gp, acc = results.get("graphpass-disk"), results.get("accelerate-disk")
    checks = []

    def verdict(ok):
        return "PASS" if ok else "FAIL"

    if gp and base:
        r = gp["peak_rss"] / base["peak_rss"]
        checks.append(["graphpass peak RSS <= 0.40 x no-offload", f"{r:.3f}", "", verdict(r <= 0.40)])
        r, rm = gp["lat_bN"] / base["lat_bN"], gp["min_bN"] / base["min_bN"]
        checks.append([f"graphpass latency {bn} <= 1.25 x no-offload", f"{r:.3f}", f"{rm:.3f}", verdict(r <= 1.25)])
    if gp and acc:
        for key, label in (("b1", "b1"), ("bN", bn)):
            r, rm = gp[f"lat_{key}"] / acc[f"lat_{key}"], gp[f"min_{key}"] / acc[f"min_{key}"]
            checks.append([f"graphpass latency {label} < accelerate-disk", f"{r:.3f}", f"{rm:.3f}", verdict(r < 1.0)])
    if gp and "diff_ok" in gp:
        checks.append(
            ["graphpass output matches no-offload (|diff| <= 1e-3 x max|out|)", "", "", verdict(gp["diff_ok"])]
        )
    if checks:
        print()
        print(tabulate(checks, headers=["target", "ratio (median)", "ratio (min)", "verdict (median)"]))
    busy = {v: r["other_cores"] for v, r in results.items() if r["other_cores"] > 0.2}
    if busy:
        print(
            "\nWARNING: other processes used CPU during the timed phase (cores, most in any round): "
            + ", ".join(f"{v} {c:.2f}" for v, c in busy.items())
            + "; latencies of those variants are inflated"
        )
    missing = [v for v in args.variants if v not in results]
    if missing:
        print(f"\nno result for: {', '.join(missing)}")


def main() -> None:
    args = parse_args()
    if args.write:
        write_checkpoint(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.variant:
        args.tokens_large = int(args.tokens_large)
        run_variant(args)
        return
    bws, layer_bytes = prepare(args)
    choose_tokens(args, layer_bytes / bws["preadv"]["warm"])
    runs = run_rounds(args)
    print()
    try:
        cold_how = cold_bandwidths(args, bws) if args.cold else "not measured (--no-cold)"
    except Exception as exc:  # keep the runs' results
        cold_how = f"not measured: {type(exc).__name__}: {exc}"
    results = merge_rounds(runs)
    print_results(args, results)
    print_bounds(args, results, bws, layer_bytes, cold_how)
    print_checks(args, results)


def print_bounds(args, results: dict, bws: dict, layer_bytes: int, cold_how: str) -> None:
    from tabulate import tabulate

    rows = bound_rows(args, results, bws, layer_bytes)
    if not rows:
        return
    bn = f"b{args.tokens_large}"
    print(
        "\nagainst the bound max(compute, streamed bytes / read bandwidth); compute = no-offload's median in this "
        "run; read bandwidth of the variant's path measured in this run: WARM "
        + ", ".join(f"{k} {v['warm'] / GiB:.2f} GiB/s" for k, v in bws.items())
        + "; COLD "
        + ", ".join(f"{k} {v['cold'] / GiB:.2f} GiB/s" for k, v in bws.items() if v.get("cold"))
        + f" ({cold_how})"
    )
    print(
        tabulate(
            rows,
            headers=[
                "variant",
                "streamed MiB/fwd",
                "read path",
                "b1 ms med",
                "b1 bound warm",
                "b1 med / bound",
                "b1 bound cold",
                f"{bn} ms med",
                f"{bn} bound warm",
                f"{bn} med / bound",
                f"{bn} bound cold",
            ],
        )
    )
    print(
        "(the forwards ran with a warm page cache: med / bound is against the warm bound; the cold bound is "
        "what a cold cache would allow)"
    )


def bound_rows(args, results: dict, bws: dict, layer_bytes: int) -> list:
    """Per variant and batch: streamed bytes per forward, the bound max(compute, streamed / read bandwidth)
    with the warm (and cold) bandwidth of the variant's read path, and median / warm bound. compute = the
    no-offload run's median at that batch (the same model with its weights in memory, this run)."""
    base = results.get("no-offload")
    if base is None:
        return []
    rows = []
    for v, r in results.items():
        if v == "no-offload":
            nbytes, path = 0, "-"
        elif "memory_stats" in r:  # graphpass: what it counted
            m = r["memory_stats"]
            nbytes, path = m.get("bytes_loaded", 0) / (2 * args.iters), "mmap"  # over both batches
        else:  # accelerate: every offloaded layer, copied per call
            nbytes, path = args.layers * layer_bytes, "preadv"
        bw = bws.get(path, {})
        row = [v, f"{nbytes / MiB:.0f}", path]
        for key in ("b1", "bN"):
            compute = base[f"lat_{key}"]
            warm = max(compute, nbytes / bw["warm"]) if nbytes else compute
            cold = max(compute, nbytes / bw["cold"]) if nbytes and bw.get("cold") else None
            row += [
                f"{r[f'lat_{key}'] * 1e3:.1f}",
                f"{warm * 1e3:.1f}",
                f"{r[f'lat_{key}'] / warm:.3f}",
                f"{cold * 1e3:.1f}" if cold else ("=" if not nbytes else "-"),
            ]
        rows.append(row)
    return rows


def fmt_ms(ts) -> str:
    return "[" + ", ".join(f"{t * 1e3:.0f}" for t in ts) + "]"


if __name__ == "__main__":
    main()
