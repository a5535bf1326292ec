"""Capture files name each tensor by its pytree key path in the module's output, in output order."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

import graphpass
from graphpass import ModelCapture
from graphpass.capturing.writer import file_keys
from graphpass.cli import main


class Pair(nn.Module):
    """Returns its outputs in the reverse of the order it computes them."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        first = self.a(x)
        second = self.b(first)
        return second, first


class Dicty(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Linear(8, 8)

    def forward(self, x):
        h = self.p(x)
        return {"z": h * 2, "a": (h + 1, h - 1)}


class Net(nn.Module):
    def __init__(self, scale_b=1.0):
        super().__init__()
        self.pair = Pair()
        self.dicty = Dicty()
        self.scale_b = scale_b

    def forward(self, x):
        second, first = self.pair(x)
        d = self.dicty(first)
        return second.sum() * self.scale_b + d["z"].sum() + d["a"][1].sum()


def _capture(model, x, root, modules, then="eager", **kwargs):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphpass", options={"then": then})
    cap = ModelCapture(compiled, modules=modules, capture_dir=root)
    cap.enable()
    with cap.step(is_prefill=True, positions=torch.arange(x.shape[1])), torch.no_grad():
        compiled(x, **kwargs)
    (meta_path,) = Path(root).rglob("*_meta.json")
    return meta_path.parent, json.loads(meta_path.read_text())


def _file(step, module):
    with safe_open(str(step / module / "rank0.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("then", ["eager", "aot_eager"])
def test_tuple_and_dict_outputs_named_by_key_path_in_output_order(tmp_path, then):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(2, 3, 8)
    step, meta = _capture(model, x, tmp_path, ["pair", "dicty"], then)
    assert [e["key"] for e in meta["tensors"]["pair"]] == ["[0]", "[1]"]
    assert [e["key"] for e in meta["tensors"]["dicty"]] == ["['z']", "['a'][0]", "['a'][1]"]
    pair, dicty = _file(step, "pair"), _file(step, "dicty")
    assert sorted(pair) == ["[0]", "[1]"] and sorted(dicty) == sorted(["['z']", "['a'][0]", "['a'][1]"])
    with torch.no_grad():
        second, first = model.pair(x)
        d = model.dicty(first)
    torch.testing.assert_close(pair["[0]"], second, rtol=0, atol=0)  # returned first, computed last
    torch.testing.assert_close(pair["[1]"], first, rtol=0, atol=0)
    torch.testing.assert_close(dicty["['z']"], d["z"], rtol=0, atol=0)
    torch.testing.assert_close(dicty["['a'][1]"], d["a"][1], rtol=0, atol=0)


def test_compare_prints_the_key_paths(tmp_path, capsys):
    torch.manual_seed(0)
    ref, x = Net(), torch.randn(2, 3, 8)
    test = Net()
    test.load_state_dict(ref.state_dict())
    with torch.no_grad():
        test.pair.b.bias += 0.5  # only the pair's output [0] changes; [1] and dicty stay equal
    _capture(ref, x, tmp_path / "ref", ["pair", "dicty"])
    _capture(test, x, tmp_path / "test", ["pair", "dicty"])
    assert main(["compare", str(tmp_path / "ref"), str(tmp_path / "test")]) == 1
    out = capsys.readouterr().out
    rows = {tuple(line.split()[1:5]) for line in out.splitlines() if line.startswith("dp0/")}
    assert ("pair", "0", "[0]", "FAIL") in rows and ("pair", "0", "[1]", "pass") in rows
    assert ("dicty", "0", "['a'][0]", "pass") in rows
    assert "first diverging module: pair (step dp0/prefill_s3_0, rank 0, key [0])" in out
    report = graphpass.compare(tmp_path / "ref", tmp_path / "test")
    assert [r.key for r in report.rows] == ["[0]", "[1]", "['z']", "['a'][0]", "['a'][1]"]  # output order


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return GPT2Model(cfg).eval()


class Head(nn.Module):
    """A GPT-2 body (returns a ModelOutput) under a head, so the body is a selectable submodule."""

    def __init__(self):
        super().__init__()
        self.gpt = _tiny_gpt2()
        self.lm = nn.Linear(16, 64)

    def forward(self, ids):
        return self.lm(self.gpt(ids, use_cache=True).last_hidden_state)


def test_gpt2_block_and_model_output_names(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, ids = Head(), torch.randint(0, 64, (1, 5))
    step, meta = _capture(model, ids, tmp_path, ["gpt", "gpt.h.0", "lm"])
    with torch.no_grad():
        out = model.gpt(ids, use_cache=False)
    gpt = _file(step, "gpt")
    assert [e["key"] for e in meta["tensors"]["gpt"]] == [".last_hidden_state"]
    torch.testing.assert_close(gpt[".last_hidden_state"], out.last_hidden_state, rtol=1e-5, atol=1e-6)
    # the block returns the hidden state, one tensor (the cache it updates is not returned)
    assert [e["key"] for e in meta["tensors"]["gpt.h.0"]] == ["output"]
    seen = []
    handle = model.gpt.h[0].register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad():
        model(ids)
    handle.remove()
    torch.testing.assert_close(_file(step, "gpt.h.0")["output"], seen[0], rtol=1e-5, atol=1e-6)
    assert [e["key"] for e in meta["tensors"]["lm"]] == ["output"]


def test_file_keys_repeats_others_and_inline_values():
    t = [torch.full((1,), float(i)) for i in range(6)]  # file_keys reads only the keys
    got = file_keys([(t[0], "[0]"), (t[1], ""), (t[2], "[1]"), (t[3], "[0]"), (t[4], None), (t[5], "")])
    assert [k for k, _ in got] == ["[0]", "[1]", "[0]#1", "other[0]", "other[1]", "0"]
    assert [i for _, i in got] == [0, 2, 3, 1, 5, 4]  # each key's value: its index in the entries


def test_compare_notes_a_capture_from_before_key_paths(tmp_path):
    from safetensors.torch import save_file

    for side, key in (("ref", "0"), ("test", "output")):
        step = tmp_path / side / "dp0" / "prefill_s2_0"
        (step / "m").mkdir(parents=True)
        save_file({key: torch.ones(2)}, str(step / "m" / "rank0.safetensors"))
        meta = {"modules": ["m"], "tensors": {"m": [{"key": key, "dtype": "float32", "shape": [2]}]}}
        (step / "prefill_s2_0_meta.json").write_text(json.dumps(meta))
    report = graphpass.compare(tmp_path / "ref", tmp_path / "test")
    assert not report.passed
    assert any("ref names its tensors 0, 1, ..." in n for n in report.notes), report.notes


def test_the_global_hook_lives_only_while_a_model_capture_does(tmp_path):
    import gc

    from graphpass.capturing import model_capture

    gc.collect()
    assert not model_capture._GLOBAL_HOOK and not model_capture._MARKED_CLASSES
    cap = ModelCapture(Net(), modules=["pair"], capture_dir=tmp_path)
    assert model_capture._MARKED_CLASSES == {Pair: 1}
    (handle,) = model_capture._GLOBAL_HOOK
    assert handle.id in torch.nn.modules.module._global_forward_hooks
    del cap
    gc.collect()
    assert not model_capture._GLOBAL_HOOK and not model_capture._MARKED_CLASSES
    assert handle.id not in torch.nn.modules.module._global_forward_hooks


def test_gpt2_block_hidden_state_comes_first(tmp_path):
    """Issue 14 item 4's example: the block's file held 0, 1, 2 with the hidden state last (the key
    and value it writes into the returned cache ran first); now the returned hidden state is
    ``output``, first, and the cache entries follow as ``other[i]``."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, ids = _tiny_gpt2(), torch.randint(0, 64, (1, 5))
    seen = []
    handle = model.h[0].register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad():
        model(ids, use_cache=True)
    handle.remove()
    step, meta = _capture(model, ids, tmp_path, ["h.0"], use_cache=True)
    assert [e["key"] for e in meta["tensors"]["h.0"]] == ["output", "other[0]", "other[1]"]
    assert meta["tensors"]["h.0"][1]["shape"] == [1, 2, 5, 8]  # (batch, heads, seq, head dim): a cache entry
    torch.testing.assert_close(_file(step, "h.0")["output"], seen[0], rtol=1e-5, atol=1e-6)


def test_a_model_capture_dying_inside_another_compile_leaves_the_hook_until_a_safe_point(tmp_path):
    """The marking hook was removed by the last ModelCapture's finalizer, whenever the collector ran
    it: inside another model's compile, Dynamo then failed building guards on the global hook dict
    (KeyError). Now it stays through the compile and goes at the next safe point."""
    import gc

    from graphpass.capturing import model_capture
    from graphpass.models.corpus import build

    holder = [ModelCapture(Net(), modules=["pair"], capture_dir=tmp_path / "a")]
    seen = {}

    def delegate(gm, example_inputs):
        holder.clear()
        gc.collect()  # the last ModelCapture dies here, inside the compile
        seen["hooks"], seen["marked"] = len(model_capture._GLOBAL_HOOK), dict(model_capture._MARKED_CLASSES)
        return gm.forward

    model, inputs = build("tiny_transformer")
    out = torch.compile(model, backend=graphpass.backend(then=delegate))(*inputs)
    assert torch.equal(out, model(*inputs))
    assert seen == {"hooks": 1, "marked": {}}  # unmarked, but the hook is not pulled from under Dynamo
    model_capture.sweep_marking_hook()  # what the next ModelCapture or step does
    assert not model_capture._GLOBAL_HOOK
