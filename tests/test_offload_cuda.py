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
    state = graphpass.offload(model, graphpass.OffloadConfig(
        device="cuda", storage=storage, disk_path=tmp_path if storage == "disk" else None))
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
