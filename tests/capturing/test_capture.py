"""Tensor capture: clone nodes by a pass, the seed's API, isolation, on-disk layout."""

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

import graphpass
from graphpass import CaptureError, ModelCapture
from graphpass.capturing import TensorRegistry
from graphpass.models.corpus import build

from helpers import fresh_inputs


def step_dirs(root):
    return sorted(p.parent for p in Path(root).rglob("*_meta.json"))


def load_step(step_dir):
    step = step_dir.name
    meta = json.loads((step_dir / f"{step}_meta.json").read_text())
    tensors = {m: load_file(str(step_dir / m / "rank0.safetensors")) for m in meta["modules"]}
    return meta, tensors


def test_registry_api():
    reg = TensorRegistry()
    a, b = torch.ones(2), torch.zeros(3)
    reg.register_module_tensor("layers.0", a)
    reg.register_manual_tensor("scores", b)
    assert [n for n, _ in reg.get_all_tensors()] == ["layers.0", "scores"]
    reg.configure(enabled=False)
    reg.register_module_tensor("layers.1", a)
    assert len(reg) == 2
    reg.clear()
    assert reg.get_all_tensors() == []


@pytest.mark.parametrize("then", ["eager", "aot_eager"])
def test_module_outputs_captured_and_written(tmp_path, then):
    model, inputs = build("tiny_transformer")
    compiled = torch.compile(model, backend="graphpass", options={"then": then})
    capture = ModelCapture(compiled, modules=["layers.0-1", "lm_head"], capture_dir=tmp_path)
    capture.enable()
    ids = fresh_inputs(inputs)[0]
    with capture.step(is_prefill=True, positions=torch.arange(ids.shape[1]), req_ids=["r0", "r1"]):
        out = compiled(ids)
    (step,) = step_dirs(tmp_path)
    assert step.relative_to(tmp_path).as_posix() == "dp0/prefill_s8_0"
    meta, tensors = load_step(step)
    assert meta["modules"] == ["layers.0", "layers.1", "lm_head"]
    assert meta["req_ids"] == ["r0", "r1"] and meta["torch_version"] == torch.__version__
    assert meta["graphpass_version"] == graphpass.__version__
    torch.testing.assert_close(tensors["lm_head"]["output"], out, rtol=0, atol=0)
    # the layer output equals what eager computes
    with torch.no_grad():
        h = model.embed(ids)
        h0 = model.layers[0](h)
    torch.testing.assert_close(tensors["layers.0"]["output"], h0, rtol=0, atol=0)
    assert not list(tmp_path.rglob("*.tmp*"))  # atomic writes leave no temporaries


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return {"first": self.a(x), "pair": (self.b(x), torch.tanh(self.a(x)))}


class NestedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Nested()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        d = self.block(x)
        return self.head(d["first"] + d["pair"][0] * d["pair"][1])


def test_every_tensor_of_a_nested_output(tmp_path):
    model = NestedModel()
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    capture = ModelCapture(compiled, modules=["block"], capture_dir=tmp_path)
    capture.enable()
    x = torch.randn(3, 4)
    with capture.step(is_prefill=True, positions=torch.arange(3)):
        compiled(x)
    _, tensors = load_step(step_dirs(tmp_path)[0])
    ref = model.block(x)
    got = sorted((v for v in tensors["block"].values()), key=lambda t: t.sum().item())
    want = sorted([ref["first"], ref["pair"][0], ref["pair"][1]], key=lambda t: t.sum().item())
    assert len(got) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.detach(), rtol=0, atol=0)


class Inline(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        scores = torch.softmax(self.q(x) @ x.transpose(-1, -2), dim=-1)
        graphpass.capture_tensor("attn_scores", scores)
        return scores @ x


def test_inline_capture_tensor_under_compile(tmp_path):
    model = Inline()
    compiled = torch.compile(model, backend="graphpass", options={"then": "aot_eager"})
    capture = ModelCapture(compiled, modules=["q"], capture_dir=tmp_path)
    capture.enable()
    x = torch.randn(2, 5, 8)
    with capture.step(is_prefill=True, positions=torch.arange(5)):
        compiled(x)
    meta, tensors = load_step(step_dirs(tmp_path)[0])
    assert meta["modules"] == ["q", "attn_scores"]
    torch.testing.assert_close(
        tensors["attn_scores"]["0"], torch.softmax(model.q(x) @ x.transpose(-1, -2), -1).detach()
    )


def test_toggling_never_recompiles(tmp_path):
    from torch._dynamo.utils import counters

    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "aot_eager"})
    capture = ModelCapture(compiled, modules=["layers.1"], capture_dir=tmp_path)
    counters.clear()
    compiled(*inputs)  # plain run, capture disabled
    frames = counters["stats"]["unique_graphs"]
    for _i in range(3):
        capture.enable()
        with capture.step(is_prefill=True, positions=torch.arange(4)):
            compiled(*inputs)
        capture.disable()
        with capture.step(is_prefill=True, positions=torch.arange(4)):
            compiled(*inputs)
        compiled(*inputs)
    assert counters["stats"]["unique_graphs"] == frames == 1
    assert len(step_dirs(tmp_path)) == 3  # only the enabled steps wrote


def test_disabled_capture_clones_nothing(monkeypatch, tmp_path):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    capture = ModelCapture(compiled, modules=["layers.0-2"], capture_dir=tmp_path)
    compiled(*inputs)
    clones = []
    orig = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: clones.append(1) or orig(self, *a, **k))
    with capture.step(is_prefill=True, positions=torch.arange(4)):
        compiled(*inputs)  # disabled
    compiled(*inputs)  # not set up at all
    assert clones == []
    capture.enable()
    with capture.step(is_prefill=True, positions=torch.arange(4)):
        compiled(*inputs)
    assert len(clones) == 3


def test_created_after_first_call_raises(tmp_path):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    compiled(*inputs)
    with pytest.raises(CaptureError, match="before the first call"):
        ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path)


def test_bad_arguments_fail_at_creation(tmp_path):
    model, _ = build("mlp_stack")
    with pytest.raises(graphpass.PatternMatchError):
        ModelCapture(model, modules=["decoder.0"], capture_dir=tmp_path)
    with pytest.raises(graphpass.PatternError):
        ModelCapture(model, modules=["layers.3-1"], capture_dir=tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CaptureError, match="not writable"):
        ModelCapture(model, modules=["layers.0"], capture_dir=blocker / "sub")
    for bad in ("../escape", "/abs/path", "a/../../b"):
        with pytest.raises(CaptureError):
            ModelCapture(model, modules=["layers.0"], capture_dir=tmp_path, subdirectory=bad)


def test_manual_names_cannot_escape(tmp_path):
    class Evil(nn.Module):
        def forward(self, x):
            graphpass.capture_tensor("../../outside", x)
            return x + 1

    model = Evil()
    compiled = torch.compile(nn.Sequential(model, nn.Linear(2, 2)), backend="graphpass", options={"then": "eager"})
    capture = ModelCapture(compiled, modules=["1"], capture_dir=tmp_path / "caps")
    capture.enable()
    with pytest.raises(CaptureError, match="directory name"):
        with capture.step(is_prefill=True, positions=torch.arange(2)):
            compiled(torch.randn(3, 2))
        # the write raises in save: nothing must be left behind
    assert not (tmp_path / "outside").exists()
    assert not list((tmp_path / "caps").rglob("*.safetensors"))


@torch.library.custom_op("gptest_capture::fail_if", mutates_args=())
def fail_if(x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """Raises at run time when ``flag`` is set: a forward that fails after captures were taken."""
    if flag.item():
        raise ValueError("boom")
    return x.clone()


@fail_if.register_fake
def _(x, flag):
    return torch.empty_like(x)


def test_forward_that_raises_writes_nothing_and_restores(tmp_path):
    from graphpass.capturing.ops import ACTIVE_CAPTURES

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.out = nn.Linear(4, 4)

        def forward(self, x, flag):
            return self.out(torch.ops.gptest_capture.fail_if(self.lin(x), flag))

    model = Boom()
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    capture = ModelCapture(compiled, modules=["lin", "out"], capture_dir=tmp_path)
    capture.enable()
    outer = ModelCapture(compiled, modules=["out"], capture_dir=tmp_path / "outer")
    outer.enable()
    outer.setup_tensor_capture()
    before = ACTIVE_CAPTURES.get()
    with pytest.raises(ValueError, match="boom"):
        with capture.step(is_prefill=True, positions=torch.arange(4)):
            compiled(torch.randn(2, 4), torch.tensor(1))
    assert ACTIVE_CAPTURES.get() == before  # the outer capture is active again
    assert step_dirs(tmp_path) == [] and not list(tmp_path.rglob("*.safetensors"))
    with capture.step(is_prefill=True, positions=torch.arange(4)):
        compiled(torch.randn(2, 4), torch.tensor(0))
    (step,) = step_dirs(tmp_path)
    assert load_step(step)[0]["modules"] == ["lin", "out"]
    outer.save_tensor_captures(positions=torch.arange(4))
    assert ACTIVE_CAPTURES.get() == ()


def test_three_models_two_threads_isolated(tmp_path):
    """Target, draft and vision captures each write only their own tensors, concurrently."""
    target, t_in = build("mlp_stack", seed=1)
    draft, d_in = build("mlp_stack", seed=2)
    vision, v_in = build("moe", seed=3)
    runs = {}
    for name, model, sub in (("target", target, None), ("draft", draft, "draft"), ("vision", vision, "vision")):
        compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
        cap = ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path, subdirectory=sub)
        cap.enable()
        runs[name] = (compiled, cap)
    errors = []

    def worker(names, inputs, steps):
        try:
            for _ in range(steps):
                for name, x in zip(names, inputs):
                    compiled, cap = runs[name]
                    with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"][: x[0].shape[0]]):
                        compiled(*x)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    th = [
        threading.Thread(target=worker, args=(["target", "vision"], [t_in, v_in], 4)),
        threading.Thread(target=worker, args=(["draft"], [d_in], 4)),
    ]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert not errors
    target_steps = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "dp0").glob("*"))
    assert target_steps == [f"dp0/decode_b4_{k}" for k in range(4)]
    assert len(list((tmp_path / "draft" / "dp0").glob("*"))) == 4
    assert len(list((tmp_path / "vision" / "dp0").glob("*"))) == 4
    _, t0 = load_step(tmp_path / "dp0" / "decode_b4_0")
    _, d0 = load_step(tmp_path / "draft" / "dp0" / "decode_b4_0")
    with torch.no_grad():
        torch.testing.assert_close(t0["layers.0"]["output"], target.layers[0](target.proj_in(t_in[0])))
        torch.testing.assert_close(d0["layers.0"]["output"], draft.layers[0](draft.proj_in(d_in[0])))
    assert len(t0["layers.0"]) == 1 and len(d0["layers.0"]) == 1  # no tensor of another model leaked in


def test_capture_filter_and_visual_routing(tmp_path):
    class MM(nn.Module):
        def __init__(self):
            super().__init__()
            self.visual = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            x = self.visual(x)
            for layer in self.layers:
                x = layer(x)
            return x

    model = MM()
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    cap = ModelCapture(
        compiled, modules=["visual.0", "layers.0-1"], capture_dir=tmp_path, capture_filter=["visual.0", "layers.1"]
    )
    cap.enable()
    with cap.step(is_prefill=True, positions=torch.arange(3)):
        compiled(torch.randn(2, 3, 4))
    assert (tmp_path / "vision" / "dp0" / "prefill_s3_0" / "visual.0" / "rank0.safetensors").exists()
    meta, _ = load_step(tmp_path / "dp0" / "prefill_s3_0")
    assert meta["modules"] == ["layers.1"]


@pytest.mark.inductor
def test_captured_values_are_the_compiled_runs(tmp_path):
    model, inputs = build("tiny_transformer")
    compiled = torch.compile(model, backend="graphpass")  # inductor
    cap = ModelCapture(compiled, modules=["layers.0-1", "norm"], capture_dir=tmp_path)
    cap.enable()
    ids = fresh_inputs(inputs)[0]
    with cap.step(is_prefill=True, positions=torch.arange(ids.shape[1])):
        out = compiled(ids)
    _, tensors = load_step(step_dirs(tmp_path)[0])
    with torch.no_grad():
        h = model.layers[1](model.layers[0](model.embed(ids)))
    torch.testing.assert_close(tensors["layers.1"]["output"], h, rtol=1e-4, atol=1e-5)  # inductor's values
    torch.testing.assert_close(model.lm_head(tensors["norm"]["output"]), out, rtol=1e-4, atol=1e-5)


def test_strict_delegate_captures_same_files(strict_backend, tmp_path):
    from graphpass.backends import NeuronDelegate

    model, inputs = build("mlp_stack")
    x = fresh_inputs(inputs)
    results = {}
    for name, then in (
        ("eager", "eager"),
        ("strict", NeuronDelegate(registered_name="strict_aten_standin", module=None)),
    ):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=graphpass.backend(then=then))
        cap = ModelCapture(compiled, modules=["layers.0-2", "head"], capture_dir=tmp_path / name)
        cap.enable()
        with cap.step(is_prefill=True, positions=torch.arange(4)):
            compiled(*x)
        results[name] = load_step(step_dirs(tmp_path / name)[0])
    assert (
        results["eager"][0]["modules"]
        == results["strict"][0]["modules"]
        == ["layers.0", "layers.1", "layers.2", "head"]
    )
    for m, ts in results["eager"][1].items():
        for k, t in ts.items():
            torch.testing.assert_close(results["strict"][1][m][k], t, rtol=0, atol=0)
    for gm in strict_backend.graphs:
        assert not any("graphpass" in str(n.target) for n in gm.graph.nodes)


def test_setup_save_and_clear_hook(tmp_path):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    capture = ModelCapture(compiled, modules=["layers.2"], capture_dir=tmp_path)
    handle = capture.register_clear_hook(compiled)
    capture.enable()
    capture.setup_tensor_capture()
    compiled(*inputs)
    compiled(*inputs)  # the hook cleared the first forward's tensors
    assert [n for n, _ in capture.registry.get_all_tensors()] == ["layers.2"]
    written = capture.save_tensor_captures(
        positions=torch.arange(4).view(1, 4), is_prefill=False, req_ids=["a", "b", "c"]
    )
    assert [p.relative_to(tmp_path).as_posix() for p in written] == ["dp0/decode_b3_0"]
    handle.remove()


def test_step_named_after_the_bucket_with_static_shapes(tmp_path):
    model, _ = build("tiny_transformer")
    gp = graphpass.backend(then="eager", static_shapes={"dims": {"ids": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp, dynamic=True)
    cap = ModelCapture(compiled, modules=["layers.1"], capture_dir=tmp_path)
    cap.enable()
    ids = torch.randint(0, 64, (2, 5))
    with cap.step(is_prefill=True, positions=torch.arange(5)), torch.no_grad():
        out = compiled(ids)
    assert out.shape == (2, 5, 64)
    (step,) = step_dirs(tmp_path)
    assert step.name == "prefill_s8_0"
    meta, tensors = load_step(step)
    assert meta["bucket"] == 8 and tensors["layers.1"]["output"].shape == (2, 8, 32)  # the padded bucket's values


# ------------------------------------------------------------------ regression: outputs written by an out= op
# vLLM's layers allocate their output (torch.empty) and let a custom op write it (``Tensor(a!) out``); the
# capture node used to go right after the allocation, so it cloned the uninitialized buffer.

_LIB = torch.library.Library("graphpass_test_out", "DEF")
_LIB.define("scale_into(Tensor(a!) out, Tensor x, float s) -> ()")


def _scale_into(out, x, s):
    out.copy_(x * s)


_LIB.impl("scale_into", _scale_into, "CompositeExplicitAutograd")
_LIB.impl("scale_into", lambda out, x, s: None, "Meta")
# vLLM's CPU all-reduce (``torch.ops._C.shm_allreduce(handle, data)``): an in-place write into the *second*
# argument after the output was computed; the stand-in sums two equal "ranks": data += data
_LIB.define("all_reduce_into(int handle, Tensor(a!) data) -> ()")


def _all_reduce_into(handle, data):
    data.add_(data.clone())


_LIB.impl("all_reduce_into", _all_reduce_into, "CompositeExplicitAutograd")
_LIB.impl("all_reduce_into", lambda handle, data: None, "Meta")


class _OutVariant(nn.Module):
    def __init__(self, reduce=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.reduce = reduce

    def forward(self, x):
        residual = x + 1  # computed before the output buffer: the later leaf is the allocation
        h = self.lin(x)
        out = torch.empty_like(h)
        torch.ops.graphpass_test_out.scale_into(out, h, 3.0)  # the op packet, as vLLM calls it
        if self.reduce:  # a row-parallel layer's all-reduce, in place, with the tensor as second argument
            torch.ops.graphpass_test_out.all_reduce_into(0, out)
        return out, residual


class _OutVariantModel(nn.Module):
    def __init__(self, reduce=False):
        super().__init__()
        self.layers = nn.ModuleList(_OutVariant(reduce) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            h, r = layer(x)
            x = h + r
        return x


@pytest.mark.parametrize("reduce", [False, True], ids=["out-op", "then-all-reduce-in-place"])
@pytest.mark.parametrize("then", ["eager", "aot_eager"])
def test_an_output_written_by_an_out_variant_op_is_captured_after_the_write(tmp_path, then, reduce):
    """Also after a later in-place write whose schema names the tensor as a later argument (vLLM's CPU
    all-reduce at tensor_parallel_size=2: its capture used to hold each rank's partial sum)."""
    torch.manual_seed(0)
    model = _OutVariantModel(reduce)
    compiled = torch.compile(model, backend="graphpass", options={"then": then})
    capture = ModelCapture(compiled, modules=["layers.0", "layers.1"], capture_dir=tmp_path)
    capture.enable()
    x = torch.randn(3, 4)
    with torch.no_grad(), capture.step(is_prefill=True, positions=torch.arange(3)):
        compiled(x)
    (step,) = step_dirs(tmp_path)
    _, tensors = load_step(step)
    with torch.no_grad():
        h0, r0 = model.layers[0](x)
        h1, r1 = model.layers[1](h0 + r0)
    torch.testing.assert_close(tensors["layers.0"]["[0]"], h0, rtol=0, atol=0)
    torch.testing.assert_close(tensors["layers.0"]["[1]"], r0, rtol=0, atol=0)
    torch.testing.assert_close(tensors["layers.1"]["[0]"], h1, rtol=0, atol=0)


def test_extra_meta_is_written_and_cannot_replace_graphpass_fields(tmp_path):
    model = _OutVariantModel()
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    capture = ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path)
    capture.enable()
    x = torch.randn(3, 4)
    with pytest.raises(graphpass.ConfigError, match="extra_meta"):
        with torch.no_grad(), capture.step(positions=torch.arange(3), extra_meta={"req_ids": ["x"]}):
            compiled(x)
    assert not step_dirs(tmp_path)
    with (
        torch.no_grad(),
        capture.step(positions=torch.arange(3), req_ids=["r"], extra_meta={"token_request": [0, 0, 0]}),
    ):
        compiled(x)
    (step,) = step_dirs(tmp_path)
    meta, _ = load_step(step)
    assert meta["token_request"] == [0, 0, 0] and meta["req_ids"] == ["r"]
