"""Plain-torch regressions for the conformance failures of issue 11 (bench/conformance.py rows that
failed a column), each the smallest model with the same root cause, so each runs in seconds.

- capture on jetmoe, longcat_flash, xmod: the decoder layer's forward breaks the graph (a
  ``.item()`` in the MoE routing, a Python loop over languages), so Dynamo calls the layer outside
  any graph and the capture pass, which only sees modules traced into a graph, had no node for its
  outputs: the step wrote nothing. The global forward hook now captures such a call eagerly.
- static on cpmant, recurrent_gemma, rwkv: the model's code turns the sequence length into a
  Python int (``for t in range(seq_len)``, ``list(range(seqlen))``), so Dynamo specializes it and
  compiles one exact-size graph per length, with or without graphpass (plain ``torch.compile``
  does the same): there is no symbolic length for graphpass to bucket. graphpass now says so,
  naming the source line that specialized it, instead of silently not bucketing.
- offload_disk on longcat_flash (NaN or a wrong logit, varying per run): the expert loop calls
  ``.item()``, a graph break inside a loop, so Dynamo skips that frame and runs it eagerly, reading
  the expert weights the model holds. With ``storage="disk"`` on a host device those were
  uninitialized stand-ins (only the scheduled loads read the file); ``storage="cpu"`` held the real
  host copies. The model now holds a private mapping of each tensor's file region.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn
from helpers import LoopExpertsStack
from safetensors.torch import load_file

import graphpass


class BreakingBlock(nn.Module):
    """A block whose forward breaks the graph in the middle (like jetmoe's MoE ``.item()``)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return (x + self.fc2(h), h.sum(-1))


class BreakingStack(nn.Module):
    def __init__(self, n: int = 2, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BreakingBlock(d) for _ in range(n))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return self.head(x)


def _eager_outputs(model, x, names):
    out = {}
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: out.setdefault(n, o)) for n in names]
    with torch.no_grad():
        ref = model(x)
    for h in hooks:
        h.remove()
    return ref, out


def test_capture_of_blocks_whose_forward_breaks_the_graph(tmp_path):
    torch.manual_seed(0)
    model = BreakingStack().eval()
    x = torch.randn(2, 3, 8)
    names = ["layers.0", "layers.1"]
    ref, eager = _eager_outputs(model, x, names)
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    cap = graphpass.ModelCapture(compiled, modules=names, capture_dir=tmp_path)
    cap.enable()
    for _ in range(2):  # the first call compiles, the second runs the compiled graphs
        with torch.no_grad(), cap.step(is_prefill=True, positions=torch.arange(3)):
            got = compiled(x)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    metas = sorted(tmp_path.rglob("*_meta.json"))
    assert len(metas) == 2, metas
    for meta in metas:
        assert sorted(json.loads(meta.read_text())["modules"]) == names
        for n in names:
            tensors = load_file(str(meta.parent / n / "rank0.safetensors"))
            assert sorted(tensors) == ["[0]", "[1]"], sorted(tensors)
            torch.testing.assert_close(tensors["[0]"], eager[n][0], rtol=0, atol=0)
            torch.testing.assert_close(tensors["[1]"], eager[n][1], rtol=0, atol=0)


def test_eager_capture_goes_to_the_model_that_ran(tmp_path):
    """Two instances of the class, each with its own ModelCapture: each block's values are filed under
    the capture whose model holds the block, once each, and a disabled capture gets nothing."""
    a, b = BreakingStack().eval(), BreakingStack().eval()
    ca, cb = (torch.compile(m, backend=graphpass.backend(then="aot_eager")) for m in (a, b))
    cap_a = graphpass.ModelCapture(ca, modules=["layers.1"], capture_dir=tmp_path / "a")
    cap_b = graphpass.ModelCapture(cb, modules=["layers.0"], capture_dir=tmp_path / "b")
    cap_a.enable()
    x = torch.randn(1, 2, 8)
    _, eager_a = _eager_outputs(a, x, ["layers.1"])
    with (
        torch.no_grad(),
        cap_a.step(is_prefill=True, positions=torch.arange(2)),
        cap_b.step(is_prefill=True, positions=torch.arange(2)),
    ):
        ca(x)
        cb(x)  # cap_b is disabled: nothing cloned for b
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors"))
    assert files == ["a/dp0/prefill_s2_0/layers.1/rank0.safetensors"], files
    got = load_file(str(tmp_path / files[0]))
    torch.testing.assert_close(got["[0]"], eager_a["layers.1"][0], rtol=0, atol=0)


class Scan(nn.Module):
    """A recurrence over time written as a Python loop (recurrent_gemma's ``_rnn_scan``, rwkv's CPU path)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.cell = nn.Linear(d, d)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        h = torch.zeros_like(x[:, 0])
        outs = []
        for t in range(x.shape[1]):  # the length becomes a Python int: Dynamo specializes it
            h = torch.tanh(self.cell(h) + x[:, t])
            outs.append(h)
        return torch.stack(outs, 1)


def test_static_shapes_says_when_dynamo_specialized_the_length():
    model = Scan().eval()
    gp = graphpass.backend(then="aot_eager", static_shapes={"dims": {"input_ids": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (5, 7, 12):
            ids = torch.randint(0, 32, (1, n), generator=torch.Generator().manual_seed(n))
            torch.testing.assert_close(compiled(input_ids=ids), model(input_ids=ids), rtol=0, atol=0)
    said = [str(w.message) for w in caught if "Dynamo specialized" in str(w.message)]
    assert said, [str(w.message) for w in caught]
    assert "not bucketing input_ids dim 1" in said[0] and "for t in range(x.shape[1])" in said[0], said[0]
    assert "test_conformance_regressions.py" in said[0], said[0]
    assert not any(getattr(g, "runner", None) for g in gp.graphs)  # nothing padded: no symbolic length


class AttnBlock(nn.Module):
    """Returns (hidden, attention weights) like bloom's block; the caller reads only the hidden state,
    and the hidden state derives from the weights."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        attn = torch.softmax(q @ k.transpose(-1, -2), -1)
        return (x + attn @ v, attn)


class AttnStack(nn.Module):
    def __init__(self, n: int = 2, d: int = 8) -> None:
        super().__init__()
        self.h = nn.ModuleList(AttnBlock(d) for _ in range(n))

    def forward(self, x):
        for block in self.h:
            x = block(x)[0]
        return x


def test_capture_of_an_output_leaf_nothing_outside_reads(tmp_path):
    torch.manual_seed(0)
    model = AttnStack().eval()
    x = torch.randn(1, 5, 8)
    _, eager = _eager_outputs(model, x, ["h.0"])
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    cap = graphpass.ModelCapture(compiled, modules=["h.0"], capture_dir=tmp_path)
    cap.enable()
    with torch.no_grad(), cap.step(is_prefill=True, positions=torch.arange(5)):
        compiled(x)
    got = load_file(str(next(tmp_path.rglob("h.0/rank0.safetensors"))))
    assert tuple(got["[1]"].shape) == tuple(eager["h.0"][1].shape), {k: tuple(v.shape) for k, v in got.items()}
    torch.testing.assert_close(got["[1]"], eager["h.0"][1], rtol=0, atol=0)


def test_disk_offload_of_weights_a_skipped_frame_reads_eagerly(tmp_path):
    """longcat_flash's offload_disk NaN: with storage="disk" on a host device the model held an
    uninitialized stand-in for each streamed tensor, which only the scheduled loads replace; the
    expert loop Dynamo runs eagerly read it directly. It now holds a mapping of the file region."""
    torch.manual_seed(0)
    model = LoopExpertsStack().eval()
    x = torch.randn(1, 6, 8)
    with torch.no_grad():
        ref = model(x)
    state = graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=str(tmp_path)))
    assert {r.name for r in state.records} >= {"layers.0.experts", "layers.1.experts"}
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    with (
        torch.no_grad(),
        pytest.warns(
            UserWarning,
            match=r"module 'layers.0' \(LoopExperts\).*Dynamo skipped its forward"
            r".*not streamed \(results are right",
        ),
    ):
        got = compiled(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert graphpass.memory_stats(compiled).loads_issued > 0  # the routers still stream through the graphs


def test_device_stand_ins_read_by_a_skipped_frame_are_refused():
    """On an accelerator the model holds one-element stand-ins: the expert loop Dynamo runs eagerly
    would compute with them (a wrong result, silently). Refused when the next graph of the model
    compiles (the router's), naming the module, Dynamo's record and what to do."""
    from graphpass.offloading.install import device_stand_ins_on_host

    torch.manual_seed(0)
    model = LoopExpertsStack().eval()
    with device_stand_ins_on_host():
        graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu"))
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    with (
        torch.no_grad(),
        pytest.raises(
            graphpass.OffloadError,
            match=r"module 'layers.0' \(LoopExperts\) holds tensors graphpass.offload\(\) "
            r"streams, and Dynamo skipped its forward.*reads the device stand-ins.*"
            r"exclude_patterns=\['layers.0'\]",
        ),
    ):
        compiled(torch.randn(1, 6, 8))
