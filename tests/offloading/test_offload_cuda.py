"""Offload on a CUDA device: pinned / cpu / disk tiers, the side stream, staging buffers.

Skipped without CUDA (this project's CI has none); ``bench/gpu_check.sh`` runs it on a lent GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

import graphpass
from graphpass.models.corpus import build

from helpers import fresh_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def frozen(name):
    model, inputs = build(name)
    model.eval().requires_grad_(False)
    return model, inputs


@pytest.mark.parametrize("storage", ["pinned", "cpu", "disk"])
@pytest.mark.parametrize("then", ["aot_eager", "inductor"])
def test_tiers_on_cuda(storage, then, tmp_path):
    model, inputs = frozen("tiny_transformer")
    ref = copy.deepcopy(model).cuda()
    state = graphpass.offload(
        model,
        graphpass.OffloadConfig(device="cuda", storage=storage, disk_path=tmp_path if storage == "disk" else None),
    )
    for rec in state.records:
        assert rec.host.device.type == "cpu"
        if storage == "pinned":
            assert rec.host.is_pinned()
    assert all(p.device.type == "cuda" for n, p in model.named_parameters())
    assert all(p.stride() == (0,) * p.dim() for n, p in model.named_parameters() if n.startswith("layers."))
    compiled = torch.compile(model, backend=graphpass.backend(then=then))
    x = [t.cuda() for t in fresh_inputs(inputs)]
    with torch.no_grad():
        out = compiled(*x)
        out = compiled(*x)
        expected = ref(*x)
    torch.cuda.synchronize()
    if then == "aot_eager":
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    stats = graphpass.memory_stats(compiled)
    one = sum(r.nbytes for r in state.records if r.unit == "layers.0")
    assert stats.peak_streamed_bytes <= 2 * one
    assert stats.streamed_bytes_now == 0


@pytest.mark.parametrize("storage", ["pinned", "cpu"])
def test_training_on_cuda(storage):
    """Forward and backward load on the device; gradients accumulate on the host copies."""
    torch.manual_seed(0)
    model, inputs = build("mlp_stack")
    ref = copy.deepcopy(model).cuda()
    state = graphpass.offload(model, graphpass.OffloadConfig(device="cuda", storage=storage))
    compiled = torch.compile(model, backend=graphpass.backend(then="inductor"))
    x = [t.cuda() for t in fresh_inputs(inputs)]
    compiled(*x).square().sum().backward()
    ref(*x).square().sum().backward()
    torch.cuda.synchronize()
    host = {r.name: r.host for r in state.records}
    params = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        got = host[n].grad if n in host else params[n].grad
        torch.testing.assert_close(got.cuda(), p.grad, rtol=1e-4, atol=1e-5)
    stats = graphpass.memory_stats(compiled)
    assert stats.groups_loaded >= 6 and stats.streamed_bytes_now == 0  # the backward loaded again


def test_quant_linear_inner_fields_on_cuda():
    model, inputs = frozen("quant_linear")
    ref, _ = frozen("quant_linear")
    ref = ref.cuda()
    for m in ref.modules():  # .cuda() does not move inner tensor fields
        w = getattr(m, "weight", None)
        if w is not None and hasattr(w, "scale"):
            w.scale = w.scale.cuda()
    graphpass.offload(model, graphpass.OffloadConfig(device="cuda", storage="pinned"))
    assert model.layers[0].up.weight.scale.device.type == "cuda"  # a stand-in on the device
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    x = [t.cuda() for t in fresh_inputs(inputs)]
    with torch.no_grad():
        assert torch.equal(compiled(*x), ref(*x))


@pytest.mark.parametrize("storage", ["pinned", "disk"])
@pytest.mark.parametrize("then", ["aot_eager", "inductor"])
def test_wrapper_subclass_weights_stream_their_inner_tensors_on_cuda(storage, then, tmp_path):
    """A tensor subclass weight (torch's TwoTensor, as torchao's Int8Tensor) streams as its inner
    tensors: the model holds the wrapper around device stand-ins, the loads rebuild it."""
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU()) for _ in range(3)]
    ).eval()
    for block in model:
        w = block[0].weight.detach()
        block[0].weight = torch.nn.Parameter(TwoTensor(w.clone(), w.clone()), requires_grad=False)
    model.requires_grad_(False)
    ref = copy.deepcopy(model).cuda()
    state = graphpass.offload(
        model,
        graphpass.OffloadConfig(
            include_patterns=["1", "2"],
            device="cuda",
            storage=storage,
            disk_path=tmp_path if storage == "disk" else None,
        ),
    )
    assert {r.name for r in state.records} >= {"1.0.weight.a", "1.0.weight.b", "2.0.weight.a"}
    assert model[1][0].weight.a.device.type == "cuda" and model[1][0].weight.a.stride() == (0, 0)
    x = torch.randn(4, 32, device="cuda")
    with torch.no_grad():
        got = torch.compile(model, backend=graphpass.backend(then=then))(x)
        expected = ref(x)
    torch.cuda.synchronize()
    torch.testing.assert_close(
        got, expected, rtol=1e-4 if then == "inductor" else 0, atol=1e-4 if then == "inductor" else 0
    )


# --------------------------------------------------------------------------------------------
# Offload under CUDA graphs: most layers resident, the rest streamed by loads recorded in the graph
# --------------------------------------------------------------------------------------------

_CUDA_GRAPH_BACKENDS = {
    "reduce-overhead": dict(then="inductor", mode="reduce-overhead"),
}


def _mostly_resident(layers: int = 8):
    """A transformer of ``layers`` blocks offloaded with a budget that keeps all but two resident."""
    from graphpass.models.corpus import TinyTransformer, TransformerConfig

    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(vocab=64, hidden=64, heads=2, layers=layers, mlp=128))
    model.eval().requires_grad_(False)
    ref = copy.deepcopy(model).cuda()
    one = sum(t.numel() * t.element_size() for t in model.layers[0].state_dict().values())
    state = graphpass.offload(
        model, graphpass.OffloadConfig(device="cuda", storage="pinned", max_device_bytes=layers * one)
    )
    assert {r.unit for r in state.records} == {f"layers.{layers - 2}", f"layers.{layers - 1}"}
    return model, ref, state


@pytest.mark.parametrize("how", sorted(_CUDA_GRAPH_BACKENDS))
def test_offload_under_cuda_graphs_replays_equal_eager(how):
    """Loads recorded into the CUDA graph: replays (no Python load runs) equal eager for fresh inputs
    every step, and a host copy updated between replays is what the next replay computes with."""
    model, ref, state = _mostly_resident()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend=graphpass.backend(**_CUDA_GRAPH_BACKENDS[how]))
    tol = dict(rtol=1e-4, atol=1e-4)  # inductor's kernels against eager's
    lengths = [16] * 9

    def step(seq, seed):
        ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(seed)).cuda()
        with torch.no_grad():
            out = compiled(ids).clone()
            torch.testing.assert_close(out, ref(ids), **tol)

    for i, seq in enumerate(lengths[:3]):  # warm-up and recording
        step(seq, i)
    loaded = graphpass.memory_stats(compiled).groups_loaded
    for i, seq in enumerate(lengths[3:]):
        step(seq, 100 + i)
    assert (
        graphpass.memory_stats(compiled).groups_loaded == loaded
    )  # every replay ran the recorded loads, none through Python
    assert not torch._dynamo.utils.counters["inductor"].get("cudagraph_skips")
    rec = next(r for r in state.records if r.host.dim() == 2)
    with torch.no_grad():  # the optimizer's view: the host copy is the parameter
        rec.host.add_(0.5)
        ref.get_parameter(rec.name).add_(0.5)
    for i in range(3):
        step(16, 200 + i)


def test_offload_under_cuda_graphs_keeps_loads_in_fixed_slots():
    """The recorded loads copy into the runtime's reserved slots: device memory does not grow over replays."""
    model, ref, state = _mostly_resident()
    compiled = torch.compile(model, backend=graphpass.backend(then="inductor", mode="reduce-overhead"))
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    with torch.no_grad():
        for _ in range(3):
            compiled(ids)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(20):
            compiled(ids)
        torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    slots = state.facts.graph_slots
    assert len(slots) == 1 and len(slots[-1].storages) == state.config.prefetch_distance + 1


@pytest.mark.parametrize("case", ["pageable storage", "then=cudagraphs", "static-shape buckets"])
def test_offload_under_cuda_graphs_refuses_what_cannot_replay_before_running(case):
    model, inputs = frozen("tiny_transformer")
    storage = "cpu" if case == "pageable storage" else "pinned"
    graphpass.offload(model, graphpass.OffloadConfig(device="cuda", storage=storage))
    opts = {
        "pageable storage": dict(then="inductor", mode="reduce-overhead"),
        "then=cudagraphs": dict(then="cudagraphs"),
        "static-shape buckets": dict(
            then="inductor", mode="reduce-overhead", static_shapes={"dims": {"ids": 1}, "buckets": [8, 16]}
        ),
    }[case]
    compiled = torch.compile(model, backend=graphpass.backend(**opts))
    match = {
        "pageable storage": "storage='pinned'",
        "then=cudagraphs": "mode='reduce-overhead'",
        "static-shape buckets": "drop static_shapes",
    }[case]
    with pytest.raises(Exception, match=match), torch.no_grad():
        compiled(*[t.cuda() for t in fresh_inputs(inputs)])
