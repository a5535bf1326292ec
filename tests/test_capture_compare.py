"""The debugging walk-through: capture a reference and a compiled run, compare, find layer 2."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass
from graphpass.cli import main


@torch.library.custom_op("gptest::mlp_kernel", mutates_args=())
def mlp_kernel(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, bug: float) -> torch.Tensor:
    """A stand-in fused kernel; ``bug`` != 0 makes it wrong, like a miscompiled kernel would be."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.t() + bug


@mlp_kernel.register_fake
def _(x, w13, w2, bug):
    return x.new_empty(*x.shape[:-1], w2.shape[0])


class KernelLayer(nn.Module):
    def __init__(self, hidden, bug=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.w13 = nn.Parameter(torch.randn(2 * hidden, hidden) * 0.1)
        self.w2 = nn.Parameter(torch.randn(hidden, hidden) * 0.1)
        self.bug = bug

    def forward(self, x):
        return x + torch.ops.gptest.mlp_kernel(self.norm(x), self.w13, self.w2, self.bug)


class KernelModel(nn.Module):
    def __init__(self, hidden=16, depth=4, buggy_layer=None):
        super().__init__()
        self.layers = nn.ModuleList(KernelLayer(hidden, 1e-2 if i == buggy_layer else 0.0) for i in range(depth))
        self.head = nn.Linear(hidden, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.inductor
def test_compare_names_the_perturbed_layer(tmp_path, capsys):
    torch.manual_seed(0)
    ref_model = KernelModel()
    test_model = KernelModel(buggy_layer=2)
    test_model.load_state_dict(ref_model.state_dict())
    x = torch.randn(2, 6, 16)
    for name, model, then in (("ref", ref_model, "eager"), ("test", test_model, "inductor")):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="graphpass", options={"then": then})
        cap = graphpass.ModelCapture(compiled, modules=["layers.0-3", "head"], capture_dir=tmp_path / name)
        cap.enable()
        with cap.step(is_prefill=True, positions=torch.arange(6), req_ids=["r0", "r1"]), torch.no_grad():
            compiled(x)
    report = graphpass.compare(tmp_path / "ref", tmp_path / "test", rtol=1e-3, atol=1e-5)
    assert not report.passed
    assert report.first_failure.module == "layers.2"
    statuses = {(r.module, r.status) for r in report.rows}
    assert ("layers.0", "pass") in statuses and ("layers.1", "pass") in statuses
    assert ("layers.3", "FAIL") in statuses and ("head", "FAIL") in statuses
    assert report.first_failure.max_abs == pytest.approx(1e-2, rel=1e-3)
    assert main(["compare", str(tmp_path / "ref"), str(tmp_path / "test"), "--rtol", "1e-3", "--atol", "1e-5"]) == 1
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-2].startswith("first diverging module: layers.2") or "first diverging module: layers.2" in out
    summary = json.loads((tmp_path / "test" / "compare_summary.json").read_text())
    assert summary["first_failure"]["module"] == "layers.2"
