"""How compile cost grows with the model: graphpass's own pass time, and graphpass's compile time
against plain inductor, for decoder stacks of several depths (issue 13, item 4).

    python bench/compile_scaling.py                       # 8, 32 and 96 layers
    python bench/compile_scaling.py --layers 8 16 --json out.json

Model: ``graphpass.models.transformer.TinyTransformer`` (RMSNorm, attention, RMSNorm, MLP per
decoder layer), small (hidden 64, MLP 128, 4 heads, vocab 256) so inductor compiles it in
tolerable time on a CPU; fp32, batch 2 x 16 tokens, training mode. Per depth, two cold compiles,
each in a fresh process with an empty inductor cache directory and
``TORCHINDUCTOR_COMPILE_THREADS=1`` (all the work in the process that is timed):

- inductor: ``torch.compile(model, backend="inductor")``, the same model with every weight resident;
- graphpass: ``graphpass.offload(include ["layers.*"], device cpu, storage cpu, prefetch 1)``,
  traps on the repeated blocks (the default), a ``ModelCapture`` of every layer and ``lm_head``
  attached (its capture nodes are in the graph; writing stays off), then
  ``torch.compile(model, backend=graphpass.backend(then="inductor"))``.

Timed: ``torch.compile(...)`` and the first training step (forward, loss, backward), where Dynamo,
AOTAutograd and inductor compile the forward and the backward. "graphpass passes" is graphpass's
own work inside that: the Dynamo-level pipeline (``CompiledGraph.pass_seconds``, per pass from the
``graphpass.passes.<name>`` DEBUG records the runner writes) plus the aten-level
``pin_backward_loads`` inside inductor's backward compile (timed here by wrapping the function in
the worker process). "nodes" are the Dynamo graph after the pipeline and the backward graph the
post-grad pass sees. Targets: the passes grow at most linearly in the node count (µs per node
stays flat), and they stay under 2 % of inductor's compile time at 96 layers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

LAYERS = (8, 32, 96)
TARGET_SHARE = 0.02


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class _PassTimes(logging.Handler):
    """Collects the runner's per-pass DEBUG records: ``(name, ms, graph, changed, what)``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.ms: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[1], float):
            self.ms[args[0]] = self.ms.get(args[0], 0.0) + args[1]


def _watch_pin(out: dict) -> None:
    """Time ``pin_backward_loads`` (called by name from ``PinBackwardLoads.__call__``) and count
    the nodes of the graphs it sees; this worker process only."""
    from graphpass.passes import pin_backward_loads as mod

    inner = mod.pin_backward_loads

    def timed(graph):
        out["bw_nodes"] = out.get("bw_nodes", 0) + len(graph.nodes)
        t0 = time.perf_counter()
        try:
            return inner(graph)
        finally:
            out["pin_ms"] = out.get("pin_ms", 0.0) + (time.perf_counter() - t0) * 1e3

    mod.pin_backward_loads = timed


def build(layers: int, hidden: int):
    import torch

    from graphpass.models.transformer import TinyTransformer, TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab=256, hidden=hidden, heads=4, layers=layers, mlp=2 * hidden, max_seq=64)
    model = TinyTransformer(cfg).train()
    return model, model.example_inputs(batch=2, seq=16)


def _graphpass_model(model, layers: int, capture_dir: str, out: dict):
    import torch

    import graphpass

    graphpass.offload(
        model, graphpass.OffloadConfig(include_patterns=["layers.*"], device="cpu", storage="cpu", prefetch_distance=1)
    )
    handler = _PassTimes()
    log = logging.getLogger("graphpass.passes")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    out["pass_handler"] = handler
    _watch_pin(out)
    gp = graphpass.backend(then="inductor")
    compiled = torch.compile(model, backend=gp)
    out["capture"] = graphpass.ModelCapture(
        compiled, modules=[f"layers.0-{layers - 1}", "lm_head"], capture_dir=capture_dir
    )
    return compiled, gp


def worker(layers: int, variant: str, hidden: int) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, (ids,) = build(layers, hidden)
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="gp-scaling-capture-") as capture_dir:
        t0, c0 = time.perf_counter(), _cpu()
        if variant == "inductor":
            compiled, gp = torch.compile(model, backend="inductor"), None
        else:
            compiled, gp = _graphpass_model(model, layers, capture_dir, out)
        compiled(ids).float().square().mean().backward()
        compile_s, cpu_s = time.perf_counter() - t0, _cpu() - c0
    res = {"layers": layers, "variant": variant, "compile_s": compile_s, "cpu_s": cpu_s}
    if gp is not None:
        res.update(
            pipeline_ms=sum(g.pass_seconds for g in gp.graphs) * 1e3,
            per_pass_ms=out["pass_handler"].ms,
            graphs=len(gp.graphs),
            fw_nodes=sum(len(g.gm.graph.nodes) for g in gp.graphs),
            pin_ms=out.get("pin_ms", 0.0),
            bw_nodes=out.get("bw_nodes", 0),
        )
    return res


def _run(layers: int, variant: str, hidden: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gp-bench-cache-") as cache:
        env = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=cache,
            TRITON_CACHE_DIR=os.path.join(cache, "triton"),
            TORCHINDUCTOR_COMPILE_THREADS="1",
        )
        out = subprocess.run(
            [sys.executable, __file__, "--worker", str(layers), variant, "--hidden", str(hidden)],
            env=env,
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"worker {layers} layers {variant} failed ({out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(ind: dict, gpr: dict) -> list:
    passes_ms = gpr["pipeline_ms"] + gpr["pin_ms"]
    nodes = gpr["fw_nodes"] + gpr["bw_nodes"]
    share = passes_ms / 1e3 / ind["compile_s"]
    return [
        gpr["layers"],
        gpr["fw_nodes"],
        gpr["bw_nodes"],
        f"{gpr['pipeline_ms']:.1f}",
        f"{gpr['pin_ms']:.1f}",
        f"{passes_ms:.1f}",
        f"{passes_ms * 1e3 / nodes:.1f}",
        f"{ind['compile_s']:.1f}",
        f"{gpr['compile_s']:.1f}",
        f"{gpr['compile_s'] / ind['compile_s']:.3f}",
        f"{gpr['cpu_s'] / ind['cpu_s']:.3f}",
        f"{share * 100:.2f} %",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="+", type=int, default=list(LAYERS))
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--worker", nargs=2, metavar=("LAYERS", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.worker[1], args.hidden)))
        return

    import torch
    from tabulate import tabulate

    results, rows = [], []
    for layers in args.layers:
        ind, gpr = _run(layers, "inductor", args.hidden), _run(layers, "graphpass", args.hidden)
        results += [ind, gpr]
        print(
            f"  {layers:3d} layers: inductor {ind['compile_s']:.1f} s, graphpass {gpr['compile_s']:.1f} s; "
            f"passes {json.dumps({k: round(v, 1) for k, v in gpr['per_pass_ms'].items()})} ms, "
            f"pin_backward_loads {gpr['pin_ms']:.1f} ms",
            file=sys.stderr,
        )
        rows.append(_row(ind, gpr))
    print(
        f"compile_scaling: TinyTransformer hidden {args.hidden}, training step (forward + backward), "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    print(
        tabulate(
            rows,
            headers=[
                "layers",
                "Dynamo nodes",
                "backward nodes",
                "pipeline ms",
                "pin_backward_loads ms",
                "graphpass passes ms",
                "µs / node",
                "compile inductor s",
                "compile graphpass s",
                "ratio",
                "CPU ratio",
                "passes / inductor",
            ],
        )
    )
    last = rows[-1]
    print(
        f"target: passes under {TARGET_SHARE * 100:.0f} % of inductor's compile at {last[0]} layers -> "
        f"{'met' if float(last[-1].rstrip(' %')) < TARGET_SHARE * 100 else 'NOT met'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
