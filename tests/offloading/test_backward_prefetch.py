"""Training offload: the backward re-loads start ``prefetch_distance`` traps ahead in backward order
(``graphpass.passes.pin_backward_loads``), each pinned after the compute where the backward reaches
the trap it is issued at; the golden file shows the backward schedule."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import graphpass
from graphpass.golden import check_exact
from graphpass.models.corpus import build
from graphpass.offloading.ops import LOAD_START, LOAD_WAIT
from graphpass.passes.pin_backward_loads import pin_backward_loads

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "offload_schedule"


def _op(node) -> str:
    t = node.target
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def render_backward(graph: torch.fx.Graph) -> str:
    """The backward's loads in order: where each starts (after which op), what each wait lists."""
    lines = []
    for n in graph.nodes:
        if n.target is LOAD_START:
            after = ", ".join(_op(a) for a in n.args[3]) or "-"
            lines.append(f"load_start {n.args[1]}  (after {after})")
        elif n.target is LOAD_WAIT:
            ahead = ", ".join(a.args[1] for a in n.args[4]) or "-"
            lines.append(f"load_wait  {n.args[2]}  (prefetched: {ahead})")
        elif (
            n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "aten"
            and n.target.overloadpacket.__name__ in ("mm", "addmm")
        ):
            lines.append(f"  {_op(n)}")
    return "\n".join(lines) + "\n"


def _compile_backward(prefetch: int):
    """Offload mlp_stack, compile with AOTAutograd (min-cut partition, as inductor), pin the backward."""
    torch.manual_seed(0)
    model, inputs = build("mlp_stack")
    ref = copy.deepcopy(model)
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu", prefetch_distance=prefetch))
    seen = {}

    def bw(gm, example_inputs):
        seen["pinned"] = pin_backward_loads(gm.graph)
        gm.graph.lint()
        gm.recompile()
        seen["graph"] = gm.graph
        return make_boxed_func(gm.forward)

    delegate = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=bw,
        partition_fn=min_cut_rematerialization_partition,
    )
    compiled = torch.compile(model, backend=graphpass.backend(then=delegate))
    return model, ref, inputs, compiled, seen


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_backward_loads_are_prefetched_in_backward_order(prefetch):
    model, ref, inputs, compiled, seen = _compile_backward(prefetch)
    compiled(*inputs).square().sum().backward()
    ref(*inputs).square().sum().backward()
    grads = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n].grad, p.grad, rtol=1e-5, atol=1e-6)
    graph = seen["graph"]
    starts = [n for n in graph.nodes if n.target is LOAD_START]
    waits = [n for n in graph.nodes if n.target is LOAD_WAIT]
    assert seen["pinned"] == len(starts) == len(waits) == 3
    order = {n: i for i, n in enumerate(graph.nodes)}
    wait_of = {w.args[2]: w for w in waits}
    start_of = {s.args[1]: s for s in starts}
    backward = [w.args[2] for w in sorted(waits, key=order.__getitem__)]
    assert backward == ["layers.2", "layers.1", "layers.0"]
    for i, label in enumerate(backward):
        issued_at = backward[max(i - prefetch, 0)]
        # the start comes right before the wait of the trap it is issued at (prefetch traps ahead)
        assert order[start_of[label]] < order[wait_of[issued_at]]
        if i - prefetch > 0:
            assert order[start_of[label]] > order[wait_of[backward[i - prefetch - 1]]]
        if prefetch and i + prefetch < len(backward):
            assert wait_of[label].args[4] == [start_of[backward[i + prefetch]]]


def test_backward_schedule_golden():
    model, ref, inputs, compiled, seen = _compile_backward(1)
    compiled(*inputs).square().sum().backward()
    skipped = check_exact(GOLDEN / "backward_mlp_stack.txt", render_backward(seen["graph"]))
    if skipped:
        pytest.skip(skipped)


def test_pin_backward_loads_runs_under_the_pass_contract(monkeypatch, caplog):
    """Inductor's hook (``PinBackwardLoads()(graph)``) runs the pass through the runner like every
    pass: it is logged with its pass name, and an unexpected exception becomes a PassError naming it."""
    import logging

    from graphpass.errors import PassError
    from graphpass.passes import pin_backward_loads as module
    from graphpass.passes.base import GraphPass

    model, ref, inputs, compiled, seen = _compile_backward(1)
    compiled(*inputs).square().sum().backward()
    hook = module.PinBackwardLoads()
    assert isinstance(hook, GraphPass)
    graph = copy.deepcopy(seen["graph"].owning_module).graph
    with caplog.at_level(logging.DEBUG, logger="graphpass.passes.pin_backward_loads"):
        assert hook(graph) is True  # placed again (the runner then lints and recompiles the graph's module)
    assert any("pin_backward_loads" in r.getMessage() and "a post-grad graph" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(module, "pin_backward_loads", lambda g: {}["boom"])
    with pytest.raises(PassError, match=r"pass 'pin_backward_loads' on a post-grad graph: KeyError"):
        hook(graph)
