"""graphpass's own compile work grows linearly with the model (issue 13, item 4; the timings are
``bench/compile_scaling.py``'s). Measured without a clock: the number of Python function calls
(builtins included, as ``cProfile`` counts them) each pass makes, per graph node, on a training
step of the same decoder stack at two depths. Linear work keeps calls per node flat as the depth
quadruples; a per-layer (or per-load) scan of the whole graph makes its part of them grow as the depth."""

from __future__ import annotations

import cProfile

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import graphpass
from graphpass import pipeline
from graphpass.models.transformer import TinyTransformer, TransformerConfig
from graphpass.passes.pin_backward_loads import pin_backward_loads

SMALL, LARGE = 4, 16
# calls per node may grow this much from SMALL to LARGE layers (counts, so no timing noise; a
# quadratic step makes its share of them grow about 4x)
GROWTH = 1.1


def _calls(fn, *args):
    """(fn's result, the function calls it made: Python and builtin, deterministic)."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        result = fn(*args)
    finally:
        prof.disable()
    return result, sum(entry.callcount for entry in prof.getstats())


def _compile_step(layers: int, tmp_path, monkeypatch) -> dict:
    """Calls per pass and node counts for one training step of an offloaded, trapped and captured
    ``TinyTransformer`` with ``layers`` layers (AOTAutograd min-cut partition, as inductor)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(vocab=32, hidden=16, heads=2, layers=layers, mlp=32, max_seq=16))
    graphpass.offload(model, graphpass.OffloadConfig(include_patterns=["layers.*"], device="cpu", storage="cpu"))
    out: dict = {"calls": {}}
    run_pass = pipeline.run_pass

    def counted(p, ctx):
        changed, out["calls"][p.name] = _calls(run_pass, p, ctx)
        out["nodes"] = len(ctx.gm.graph.nodes)
        return changed

    def backward(gm, _):
        out["backward_nodes"] = len(gm.graph.nodes)
        out["pinned"], out["calls"]["pin_backward_loads"] = _calls(pin_backward_loads, gm.graph)
        gm.recompile()
        return make_boxed_func(gm.forward)

    monkeypatch.setattr(pipeline, "run_pass", counted)
    delegate = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=backward,
        partition_fn=min_cut_rematerialization_partition,
    )
    out["backend"] = graphpass.backend(then=delegate)
    compiled = torch.compile(model, backend=out["backend"])
    # kept referenced: the backend finds a ModelCapture through a weak reference
    out["capture"] = graphpass.ModelCapture(
        compiled, modules=[f"layers.0-{layers - 1}", "lm_head"], capture_dir=str(tmp_path)
    )
    compiled(*model.example_inputs(batch=1, seq=4)).square().mean().backward()
    monkeypatch.setattr(pipeline, "run_pass", run_pass)
    assert out["pinned"] == layers  # one backward re-load per trap
    assert any("capture nodes" in line for g in out["backend"].graphs for line in g.log)
    return out


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        return {n: _compile_step(n, tmp_path_factory.mktemp(f"cap{n}"), mp) for n in (SMALL, LARGE)}


@pytest.mark.parametrize(
    "name",
    [
        p.name
        for p in pipeline.PIPELINE
        if p.name
        in (
            "analyze_ownership",
            "assign_traps",
            "insert_trap_boundaries",
            "insert_offload_schedule",
            "insert_capture_nodes",
        )
    ],
)
def test_pipeline_pass_calls_grow_linearly(steps, name):
    small, large = steps[SMALL], steps[LARGE]
    per_node = [s["calls"][name] / s["nodes"] for s in (small, large)]
    assert per_node[1] <= GROWTH * per_node[0], f"{name}: {per_node[0]:.1f} -> {per_node[1]:.1f} calls per node"


def test_pin_backward_loads_calls_grow_linearly(steps):
    small, large = steps[SMALL], steps[LARGE]
    per_node = [s["calls"]["pin_backward_loads"] / s["backward_nodes"] for s in (small, large)]
    assert large["backward_nodes"] > 3 * small["backward_nodes"]
    assert per_node[1] <= GROWTH * per_node[0], f"{per_node[0]:.1f} -> {per_node[1]:.1f} calls per node"


def test_repeated_blocks_calls_grow_linearly():
    """The default traps' container search (``fx_utils.repeated_blocks``) on a synthetic stack."""
    from graphpass.fx_utils import repeated_blocks

    def per_layer(n: int) -> float:
        paths = [f"layers.{i}.{m}" for i in range(n) for m in ("attn", "mlp")] + ["embed", "lm_head"]
        weights = [(64, [f"layers.{i}.{m}"]) for i in range(n) for m in ("attn", "mlp")] + [(64, ["embed", "lm_head"])]
        (best, children), calls = _calls(repeated_blocks, paths, weights)
        assert best == "layers" and len(children) == n
        return calls / n

    small, large = per_layer(8), per_layer(64)
    assert large <= GROWTH * small, f"{small:.1f} -> {large:.1f} calls per layer"
