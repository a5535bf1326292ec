"""``model.generate()`` on a graphpass-compiled transformers model with offload and capture on
(issue 11, item 6).

A tiny random-weight Llama (2 layers, hidden 64; no downloads) is offloaded
(``OffloadConfig(device="cpu", storage="cpu" | "disk")``), its ``forward`` compiled with
``graphpass.backend(then=aot_eager)`` (counted), two decoder layers captured with
``ModelCapture.auto_steps()``, and greedy ``generate()`` run with the dynamic cache and with
``cache_implementation="static"``. Checked against an un-offloaded eager twin with the same weights:

* the tokens are equal;
* every forward is one step: ``prefill_s8_0``, then ``decode_b1_0`` ... (the seed's layout), and the
  captured layer outputs equal the eager layers' (prefill, first and last decode step);
* transformers' own ``compile_config`` over the graphpass-compiled forward changes nothing, and
  alone (prefill uncompiled) is refused by an offloaded model;
* compilations (delegate compiles, one per graphpass graph): static cache ``STATIC_COMPILES`` for 8
  and for 32 new tokens (prefill + decode: independent of the token count); dynamic cache
  ``DYNAMIC_COMPILES`` (prefill, first decode, then one graph with a dynamic cache length for every
  later decode step), and a second, longer generate() compiles nothing more.

The unit tests of the step naming (``default_step_info``, ``step_info=``, failed forwards,
``remove()``) run on a plain module at the end.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file
from torch._dynamo.backends.registry import lookup_backend

import graphpass
from graphpass.capturing import StepInfo
from graphpass.capturing.auto_steps import default_step_info
from graphpass.capturing.ops import ACTIVE_CAPTURES
from graphpass.errors import CaptureError
from helpers import CountingBackend

PROMPT = 8
LAYERS = ["model.layers.0", "model.layers.1"]
STATIC_COMPILES = 2  # prefill graph + decode graph (the static cache keeps every decode shape)
DYNAMIC_COMPILES = 3  # prefill + first decode (static shapes) + one decode graph with a dynamic cache length


@pytest.fixture(scope="module")
def eager():
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
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def _kwargs(cache: str, new_tokens: int) -> dict:
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    return kw


def _eager_generate(model, ids, kw):
    """Eager tokens and, per captured layer, its output at every forward (call i = step i)."""
    outs = {name: [] for name in LAYERS}
    hooks = [
        model.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: outs[name].append(out.detach().clone())
        )
        for name in LAYERS
    ]
    try:
        with torch.no_grad():
            tokens = model.generate(ids, **kw)
    finally:
        for h in hooks:
            h.remove()
    return tokens, outs


class _Compiled:
    """A fresh offloaded twin of ``eager`` whose forward graphpass compiles, with a ModelCapture."""

    def __init__(self, eager, tmp: Path, storage: str = "cpu"):
        torch._dynamo.reset()  # a fresh compile per run (offload / ModelCapture refuse a compiled class)
        self.model = copy.deepcopy(eager)
        cfg = graphpass.OffloadConfig(
            device="cpu", storage=storage, disk_path=str(tmp / "weights") if storage == "disk" else None
        )
        self.state = graphpass.offload(self.model, cfg)
        self.counting = CountingBackend(inner=lookup_backend("aot_eager"))
        self.gp = graphpass.backend(then=self.counting)
        self.model.forward = torch.compile(self.model.forward, backend=self.gp)
        self.root = tmp / "captures"
        self.capture = graphpass.ModelCapture(self.model, modules=LAYERS, capture_dir=self.root)
        self.capture.enable()

    def generate(self, ids, kw):
        with torch.no_grad(), self.capture.auto_steps() as steps:
            tokens = self.model.generate(ids, **kw)
        return tokens, steps.steps

    def steps(self) -> list[str]:
        return sorted(p.name for p in (self.root / "dp0").iterdir())


def _expect_steps(run: _Compiled, first_prefill: int, first_decode: int, new_tokens: int) -> None:
    want = {f"prefill_s{PROMPT}_{first_prefill}"} | {f"decode_b1_{first_decode + i}" for i in range(new_tokens - 1)}
    assert want <= set(run.steps())
    meta = json.loads(
        (run.root / "dp0" / f"decode_b1_{first_decode}" / f"decode_b1_{first_decode}_meta.json").read_text()
    )
    assert (meta["phase"], meta["size"], meta["modules"]) == ("decode", 1, LAYERS)


def _expect_captures(run: _Compiled, outs: dict, first_decode: int = 0) -> None:
    """prefill, first and last decode step: each layer's captured output equals eager's."""
    last = len(outs[LAYERS[0]]) - 1
    for step, call in (
        (f"prefill_s{PROMPT}_0", 0),
        (f"decode_b1_{first_decode}", 1),
        (f"decode_b1_{first_decode + last - 1}", last),
    ):
        for name in LAYERS:
            got = load_file(str(run.root / "dp0" / step / name / "rank0.safetensors"))["output"]
            torch.testing.assert_close(got, outs[name][call], rtol=1e-5, atol=1e-6, msg=f"{step} {name}")


def test_generate_static_cache_tokens_captures_and_constant_compiles(eager, ids, tmp_path):
    compiles = {}
    for new_tokens in (8, 32):
        kw = _kwargs("static", new_tokens)
        want, outs = _eager_generate(eager, ids, kw)
        run = _Compiled(eager, tmp_path / str(new_tokens))
        got, steps = run.generate(ids, kw)
        assert torch.equal(got, want), (got[0, PROMPT:].tolist(), want[0, PROMPT:].tolist())
        assert steps == new_tokens == len(run.steps())
        _expect_steps(run, 0, 0, new_tokens)
        _expect_captures(run, outs)
        assert graphpass.memory_stats(run.model).loads_issued > 0
        compiles[new_tokens] = run.counting.calls
        assert len(run.gp.graphs) == run.counting.calls
    assert compiles == {8: STATIC_COMPILES, 32: STATIC_COMPILES}


def test_generate_dynamic_cache_tokens_captures_and_bounded_compiles(eager, ids, tmp_path):
    run = _Compiled(eager, tmp_path)
    kw8 = _kwargs("dynamic", 8)
    want, outs = _eager_generate(eager, ids, kw8)
    got, steps = run.generate(ids, kw8)
    assert torch.equal(got, want) and steps == 8
    _expect_steps(run, 0, 0, 8)
    _expect_captures(run, outs)
    assert run.counting.calls == DYNAMIC_COMPILES
    # a second, longer generate() with the same compiled forward: no new compilation; its steps
    # continue the numbering (k counts this ModelCapture's steps of each phase)
    kw32 = _kwargs("dynamic", 32)
    want, outs = _eager_generate(eager, ids, kw32)
    got, steps = run.generate(ids, kw32)
    assert torch.equal(got, want) and steps == 32
    _expect_steps(run, 1, 7, 32)
    assert run.counting.calls == DYNAMIC_COMPILES
    for name in LAYERS:
        got = load_file(str(run.root / "dp0" / "decode_b1_37" / name / "rank0.safetensors"))["output"]
        torch.testing.assert_close(got, outs[name][31], rtol=1e-5, atol=1e-6)


def test_generate_disk_offload_static_cache(eager, ids, tmp_path):
    kw = _kwargs("static", 8)
    want, outs = _eager_generate(eager, ids, kw)
    run = _Compiled(eager, tmp_path, storage="disk")
    got, steps = run.generate(ids, kw)
    assert torch.equal(got, want) and steps == 8
    _expect_captures(run, outs)
    assert run.counting.calls == STATIC_COMPILES
    assert graphpass.memory_stats(run.model).loads_issued > 0


def test_generate_under_transformers_compile_config(eager, ids, tmp_path):
    """transformers' own compile of ``__call__`` for the decode steps (``compile_config``, forced on
    CPU with ``_compile_all_devices``) over the graphpass-compiled forward: same tokens, the same
    graphpass graphs, every step captured. Its compile alone runs the prefill uncompiled, which an
    offloaded model refuses (docs/capture.md)."""
    import transformers

    kw = _kwargs("static", 8)
    want, outs = _eager_generate(eager, ids, kw)
    run = _Compiled(eager, tmp_path / "over")
    config = transformers.CompileConfig(backend="aot_eager")
    config._compile_all_devices = True
    got, steps = run.generate(ids, dict(kw, compile_config=config))
    assert torch.equal(got, want) and steps == 8
    _expect_captures(run, outs)
    assert run.counting.calls == STATIC_COMPILES
    run = _Compiled(eager, tmp_path / "alone")
    del run.model.forward  # the class's forward again: only transformers compiles
    config = transformers.CompileConfig(backend=run.gp)
    config._compile_all_devices = True
    with pytest.raises(graphpass.OffloadError, match="outside a graph graphpass scheduled"):
        run.generate(ids, dict(kw, compile_config=config))


# ---------------------------------------------------------------------------------- step naming


@pytest.mark.parametrize(
    "args, kwargs, want",
    [
        ((), {"input_ids": torch.zeros(2, 5, dtype=torch.long)}, (True, 5)),
        ((), {"input_ids": torch.zeros(3, 1, dtype=torch.long)}, (False, 3)),
        ((), {"inputs_embeds": torch.zeros(2, 1, 16)}, (False, 2)),
        ((torch.zeros(7, dtype=torch.long),), {}, (True, 7)),  # 1-D: one sequence
        ((torch.zeros(4, 1, dtype=torch.long),), {"position_ids": torch.full((4, 1), 9)}, (False, 4)),
        # one-token prompts start their sequences: prefill of 1
        ((), {"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache_position": torch.tensor([0])}, (True, 1)),
        ((), {"input_ids": torch.zeros(2, 1, dtype=torch.long), "position_ids": torch.zeros(2, 1)}, (True, 1)),
        ((), {"input_ids": torch.zeros(1, 1, dtype=torch.long), "cache_position": torch.tensor([6])}, (False, 1)),
    ],
)
def test_default_step_info(args, kwargs, want):
    info = default_step_info(args, kwargs)
    assert (info.is_prefill, info.size) == want


def test_default_step_info_without_an_input_tensor_says_what_to_pass():
    with pytest.raises(CaptureError, match="step_info"):
        default_step_info((), {"n": 3})


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, input_ids, pick=None):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        if pick is not None:  # out of range: fails at run time, inside the compiled graph, after the layers ran
            h = h[:, pick]
        return h


def _tiny(tmp_path, wrap: str = "forward"):
    """``forward``: ``model.forward`` compiled, ModelCapture(model); ``wrapper``: ModelCapture given
    the ``torch.compile(model)`` wrapper; ``inner``: ModelCapture(model), calls to the wrapper."""
    torch.manual_seed(0)
    model = _Tiny().eval()
    counting = CountingBackend(inner=lookup_backend("aot_eager"))
    if wrap == "forward":
        model.forward = torch.compile(model.forward, backend=graphpass.backend(then=counting))
        called = model
    else:
        called = torch.compile(model, backend=graphpass.backend(then=counting))
    cap = graphpass.ModelCapture(
        model if wrap == "inner" else called, modules=["layers.0", "layers.1"], capture_dir=tmp_path
    )
    cap.enable()
    return model, called, cap, counting


@pytest.mark.parametrize("wrap", ["forward", "wrapper", "inner"])
def test_auto_steps_names_each_forward_and_values_equal_eager(tmp_path, wrap):
    model, called, cap, counting = _tiny(tmp_path, wrap)
    xs = [torch.randint(0, 32, shape) for shape in ((2, 5), (2, 1), (2, 1), (3, 4))]
    with torch.no_grad(), cap.auto_steps() as steps:
        assert steps.module is (model if wrap == "inner" else called)
        for x in xs:
            called(x)
    assert steps.steps == 4
    assert sorted(p.name for p in (tmp_path / "dp0").iterdir()) == [
        "decode_b2_0",
        "decode_b2_1",
        "prefill_s4_1",
        "prefill_s5_0",
    ]
    with torch.no_grad():
        want = model.layers[0](model.emb(xs[1]))  # the Linear's output (relu follows it in the parent)
    got = load_file(str(tmp_path / "dp0" / "decode_b2_0" / "layers.0" / "rank0.safetensors"))["output"]
    torch.testing.assert_close(got, want)
    compiles = counting.calls
    assert compiles == 3  # as without capture: (2, 5); (2, 1); then one graph with dynamic sizes
    with torch.no_grad():  # after the with-block the hooks are gone: nothing captured, nothing recompiled
        called(xs[1])
        called(xs[0])
    assert len(list((tmp_path / "dp0").iterdir())) == 4 and counting.calls == compiles


def test_auto_steps_failed_forward_writes_nothing_and_closes_the_step(tmp_path):
    _, called, cap, _ = _tiny(tmp_path)
    x = torch.randint(0, 32, (1, 3))
    with torch.no_grad(), cap.auto_steps() as steps:
        with pytest.raises((IndexError, RuntimeError), match="out of bounds|out of range"):
            called(x, pick=torch.tensor([9]))
        assert ACTIVE_CAPTURES.get() == () and steps.steps == 0
        called(x, pick=torch.tensor([2]))
    assert sorted(p.name for p in (tmp_path / "dp0").iterdir()) == ["prefill_s3_0"]
    assert steps.steps == 1


def test_auto_steps_custom_step_info_and_remove(tmp_path):
    _, called, cap, _ = _tiny(tmp_path)

    def info(args, kwargs):  # every other call, filed as a decode of the request ids given
        x = args[0]
        return None if x.shape[1] == 2 else StepInfo(False, x.shape[0], req_ids=["a", "b"][: x.shape[0]])

    steps = cap.auto_steps(step_info=info)
    with torch.no_grad():
        called(torch.randint(0, 32, (2, 3)))
        called(torch.randint(0, 32, (2, 2)))  # not captured
        steps.remove()
        called(torch.randint(0, 32, (2, 3)))  # hooks removed
    assert sorted(p.name for p in (tmp_path / "dp0").iterdir()) == ["decode_b2_0"]
    meta = json.loads((tmp_path / "dp0" / "decode_b2_0" / "decode_b2_0_meta.json").read_text())
    assert meta["req_ids"] == ["a", "b"] and steps.steps == 1


def test_auto_steps_warns_once_when_a_step_captured_nothing(tmp_path):
    """A forward that ran outside a graphpass graph (here: eagerly) has no capture nodes: said, once."""
    model = _Tiny().eval()
    cap = graphpass.ModelCapture(model, modules=["layers.0"], capture_dir=tmp_path)
    cap.enable()
    with (
        torch.no_grad(),
        cap.auto_steps() as steps,
        pytest.warns(UserWarning, match="captured no module output") as rec,
    ):
        model(torch.randint(0, 32, (1, 4)))
        model(torch.randint(0, 32, (1, 1)))
    assert len([w for w in rec if "auto_steps" in str(w.message)]) == 1 and steps.steps == 0
    assert not (tmp_path / "dp0").exists()
