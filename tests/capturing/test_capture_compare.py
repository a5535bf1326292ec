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
    assert (
        out.strip().splitlines()[-2].startswith("first diverging module: layers.2")
        or "first diverging module: layers.2" in out
    )
    summary = json.loads((tmp_path / "test" / "compare_summary.json").read_text())
    assert summary["first_failure"]["module"] == "layers.2"


def _greedy_run(model, ids, root):
    """A greedy generate() of ``model`` (forward compiled with graphpass), every forward one step."""
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=graphpass.backend(then="eager"))
    cap = graphpass.ModelCapture(model, modules=["model.layers.0", "model.layers.1"], capture_dir=root)
    cap.enable()
    with torch.no_grad(), cap.auto_steps():
        return model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_first_divergence_of_a_greedy_generate_is_in_the_prefill(tmp_path):
    """Issue 22, item 2: layer 1 perturbed, so the first token differs and every decode step
    diverges from layer 0 on. Steps sorted by their counter before their phase put decode_b1_0
    first and named its model.layers.0; the first divergence in execution order is the prefill's
    model.layers.1 (the writer's step_index gives the order)."""
    import copy

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    ref_model = transformers.LlamaForCausalLM(cfg).eval()
    test_model = copy.deepcopy(ref_model)
    with torch.no_grad():
        test_model.model.layers[1].mlp.down_proj.weight.mul_(-8.0)
    ids = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    ref_tokens = _greedy_run(ref_model, ids, tmp_path / "ref")
    test_tokens = _greedy_run(test_model, ids, tmp_path / "test")
    assert ref_tokens[0, 8] != test_tokens[0, 8]  # the first new token differs: decode inputs differ
    report = graphpass.compare(tmp_path / "ref", tmp_path / "test")
    steps = list(dict.fromkeys(r.step for r in report.rows))
    assert steps == ["dp0/prefill_s8_0", "dp0/decode_b1_0", "dp0/decode_b1_1", "dp0/decode_b1_2"]
    first = report.first_failure
    assert (first.step, first.module) == ("dp0/prefill_s8_0", "model.layers.1")
    outputs = [(r.step, r.module, r.status) for r in report.rows if r.key == "output"]  # (not the KV cache)
    assert outputs[:3] == [
        ("dp0/prefill_s8_0", "model.layers.0", "pass"),
        ("dp0/prefill_s8_0", "model.layers.1", "FAIL"),
        ("dp0/decode_b1_0", "model.layers.0", "FAIL"),
    ]
    assert not report.notes  # every step has its step_index: no fallback order
