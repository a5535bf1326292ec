"""``compare`` across engines (graphpass.capturing.compare_engines, engine_families) on synthetic capture
folders: a reference in transformers' layout (one request per step, ``[1, tokens, ...]``, modules
q_proj/k_proj/v_proj, gate_proj/up_proj, layer output one tensor) against an engine run in vLLM's
(requests flattened into shared steps, ``[tokens, ...]``, the layer's ``(hidden, residual)``, fused
qkv_proj / gate_up_proj, linears returning ``(out, bias)``). No vLLM needed; the end-to-end test with
vLLM is tests/in_vllm/test_compare_engines_vllm.py."""

import json
import zlib

import pytest
import torch
from safetensors.torch import save_file

from graphpass.capturing import CompareError, compare
from graphpass.capturing.engine_families import (Family, FamilyRegistry, ModelShape, RebuildError, rebuild_llama)
from graphpass.cli import main
from graphpass.errors import ConfigError

H, HEADS, KV, HEAD_DIM, INTER = 8, 2, 1, 4, 6
MODEL = {"model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM,
         "intermediate_size": INTER, "tp_size": 1}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
GENERATED = [[10, 11, 12, 13], [20, 21, 22, 23]]
LAYERS = ["model.layers.0", "model.layers.1"]
SIZES = {"q_proj": HEADS * HEAD_DIM, "k_proj": KV * HEAD_DIM, "v_proj": KV * HEAD_DIM, "gate_proj": INTER,
         "up_proj": INTER}
REF_MODULES = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
               "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", *LAYERS]
ENGINE_MODULES = ["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj", *LAYERS]


def truth(module: str, req: int, pos: int) -> torch.Tensor:
    """The module's output (transformers' terms) at a request's position: the same in both runs."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{module}|{req}|{pos}".encode()))
    return torch.randn(SIZES.get(module.rpartition(".")[2], H), generator=g)


def token(req: int, pos: int) -> int:
    return (PROMPTS[req] + GENERATED[req])[pos]


def write_step(root, name, index, req_ids, rows, engine, tensors):
    """A step folder as the writer lays it out: meta (req_ids, positions, token_request, engine, model,
    input_ids) and one rank0.safetensors per module. ``rows``: (request index into req_ids, req, pos);
    (-1, None, None) is a padding row."""
    step = root / "dp0" / name
    step.mkdir(parents=True)
    meta = {"step": name, "step_index": index, "phase": "prefill" if name.startswith("prefill") else "decode",
            "modules": list(tensors), "req_ids": req_ids, "positions": [p if p is not None else 0 for _, _, p in rows],
            "token_request": [i for i, _, _ in rows], "engine": engine, "model": MODEL,
            "input_ids": [token(r, p) if r is not None else 0 for _, r, p in rows],
            "tensors": {m: [{"key": k, "shape": list(t.shape), "dtype": "float32"} for k, t in keys.items()]
                        for m, keys in tensors.items()}}
    for module, keys in tensors.items():
        (step / module).mkdir()
        save_file({k: t.contiguous() for k, t in keys.items()}, str(step / module / "rank0.safetensors"))
    (step / f"{name}_meta.json").write_text(json.dumps(meta))


def write_reference(root, drop_last_decode=False):
    """transformers' layout: each request alone, a prefill step then a decode step per token but the last."""
    index, k = 0, {"prefill": 0, "decode": 0}
    for req, prompt in enumerate(PROMPTS):
        spans = [range(len(prompt))] + [range(p, p + 1) for p in range(len(prompt), len(prompt) + 3)]
        if drop_last_decode and req == 1:
            spans = spans[:-1]
        for span in spans:
            phase = "prefill" if span.start == 0 else "decode"
            name = f"prefill_s{len(span)}_{k[phase]}" if phase == "prefill" else f"decode_b1_{k[phase]}"
            k[phase] += 1
            tensors = {m: {"output": torch.stack([truth(m, req, p) for p in span])[None]} for m in REF_MODULES}
            write_step(root, name, index, [str(req)], [(0, req, p) for p in span], "transformers", tensors)
            index += 1
    return root


def engine_tensors(rows, modules=ENGINE_MODULES, perturb=None):
    """vLLM's modules for ``rows``: (hidden, residual) per layer, fused projections, (out, bias) linears."""
    def t(m, r, p):
        v = truth(m, r, p)
        return v + 1e-2 if perturb and perturb(m, r, p) else v

    real = [(r, p) for _, r, p in rows if r is not None]
    pad = len(rows) - len(real)
    out = {}
    for m in modules:
        if m.endswith("qkv_proj"):
            pre = m.rpartition(".")[0]
            v = torch.stack([torch.cat([t(f"{pre}.{n}", r, p) for n in ("q_proj", "k_proj", "v_proj")]) for r, p in real])
            out[m] = {"[0]": v}
        elif m.endswith("gate_up_proj"):
            pre = m.rpartition(".")[0]
            out[m] = {"[0]": torch.stack([torch.cat([t(f"{pre}.{n}", r, p) for n in ("gate_proj", "up_proj")])
                                          for r, p in real])}
        else:  # a decoder layer: hidden + residual is transformers' output
            whole = torch.stack([t(m, r, p) for r, p in real])
            residual = torch.randn(whole.shape, generator=torch.Generator().manual_seed(len(real)))
            out[m] = {"[0]": whole - residual, "[1]": residual}
        out[m] = {k: torch.cat([v, torch.full((pad, *v.shape[1:]), 7.0)]) for k, v in out[m].items()}
    return out


def write_engine(root, modules=ENGINE_MODULES, perturb=None, pad_decode=False):
    """vLLM's layout: both requests in every step, flattened; internal request ids with a suffix."""
    ids = ["0-a1b2", "1-c3d4"]
    steps = [("prefill_s8_0", [(0, 0, p) for p in range(5)] + [(1, 1, p) for p in range(3)])]
    for d in range(3):
        rows = [(0, 0, 5 + d), (1, 1, 3 + d)]
        steps.append((f"decode_b2_{d}", rows + ([(-1, None, None)] if pad_decode else [])))
    for index, (name, rows) in enumerate(steps):
        write_step(root, name, index, ids, rows, "vllm", engine_tensors(rows, modules, perturb))
    return root


@pytest.fixture
def ref(tmp_path):
    return write_reference(tmp_path / "ref")


def test_agreeing_runs_match_every_token_of_every_rebuilt_module(ref, tmp_path):
    report = compare(ref, write_engine(tmp_path / "vllm"), rtol=1e-5, atol=1e-6)
    assert report.passed, str(report)
    assert any("across engines: vllm against transformers" in n for n in report.notes)
    # per engine step: the tokens, then each transformers module (q/k/v and gate/up split from the fused ones)
    first = [(r.module, r.key) for r in report.rows if r.step == "dp0/prefill_s8_0"]
    assert first == [("<input_ids>", "input_ids")] + [(m, "output") for m in REF_MODULES]
    assert len(report.rows) == 4 * (1 + len(REF_MODULES))
    assert all(r.max_abs < 1e-5 for r in report.rows)


def test_padding_rows_of_the_engine_are_not_compared(ref, tmp_path):
    assert compare(ref, write_engine(tmp_path / "vllm", pad_decode=True), rtol=1e-5, atol=1e-6).passed


@pytest.mark.parametrize("module, req, pos, step", [
    ("model.layers.1", 1, 4, "dp0/decode_b2_1"),                       # request 1's second decode token
    ("model.layers.0.self_attn.k_proj", 0, 2, "dp0/prefill_s8_0"),     # inside the fused qkv_proj
    ("model.layers.0.mlp.up_proj", 0, 6, "dp0/decode_b2_1"),           # inside the fused gate_up_proj
])
def test_a_perturbed_module_is_the_first_divergence_in_the_first_step_it_diverges(ref, tmp_path, module, req, pos, step):
    perturb = lambda m, r, p: m == module and r == req and p >= pos  # noqa: E731
    report = compare(ref, write_engine(tmp_path / "vllm", perturb=perturb), rtol=1e-5, atol=1e-6)
    bad = report.first_failure
    assert (bad.step, bad.module, bad.key) == (step, module, "output"), str(report)
    assert bad.missing is None and bad.max_abs == pytest.approx(1e-2, rel=1e-3)
    assert "first diverging module: " + module in report.summary_line()
    assert {r.module for r in report.rows if not r.passed} == {module}


def test_tokens_the_engine_fed_are_checked_against_the_reference(ref, tmp_path):
    test = write_engine(tmp_path / "vllm")
    meta_path = test / "dp0" / "decode_b2_0" / "decode_b2_0_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["input_ids"][1] += 1  # request 1's first generated token differs
    meta_path.write_text(json.dumps(meta))
    bad = compare(ref, test, rtol=1e-5, atol=1e-6).first_failure
    assert (bad.step, bad.module, bad.key) == ("dp0/decode_b2_0", "<input_ids>", "input_ids")
    assert "1 of 2 elements differ" in bad.note


def test_tokens_missing_on_either_side_are_fail_rows_never_all_match(tmp_path):
    ref = write_reference(tmp_path / "ref", drop_last_decode=True)
    report = compare(ref, write_engine(tmp_path / "vllm"), rtol=1e-5, atol=1e-6)
    assert not report.passed
    lost = [r for r in report.rows if r.missing == "ref"]
    assert [(r.step, r.note) for r in lost] == [("dp0/decode_b2_2", "1 token(s) missing in ref: request 1 positions 5")]
    # the token both hold in that step is still compared
    assert any(r.step == "dp0/decode_b2_2" and r.module == "model.layers.1" and r.passed for r in report.rows)
    # and the other way: a reference token no engine step holds
    test = write_engine(tmp_path / "vllm2")
    for f in (test / "dp0" / "decode_b2_2").iterdir():
        if f.is_dir():
            for g in f.iterdir():
                g.unlink()
            f.rmdir()
        else:
            f.unlink()
    (test / "dp0" / "decode_b2_2").rmdir()
    report = compare(write_reference(tmp_path / "ref2"), test, rtol=1e-5, atol=1e-6)
    assert [(r.step, r.missing, r.note) for r in report.rows if not r.passed] == [
        ("dp0/decode_b1_2", "test", "1 token(s) of ref missing in test: request 0 positions 7"),
        ("dp0/decode_b1_5", "test", "1 token(s) of ref missing in test: request 1 positions 5")]


def test_a_module_one_side_lacks_is_a_fail_row_naming_the_side(ref, tmp_path):
    test = write_engine(tmp_path / "vllm", modules=[m for m in ENGINE_MODULES if "gate_up" not in m])
    report = compare(ref, test, rtol=1e-5, atol=1e-6)
    lost = {(r.module, r.missing) for r in report.rows if not r.passed}
    assert lost == {("model.layers.0.mlp.gate_proj", "test"), ("model.layers.0.mlp.up_proj", "test")}
    assert "module missing in test" in report.first_failure.note


def test_a_fused_projection_that_does_not_split_is_a_fail_row(ref, tmp_path):
    test = write_engine(tmp_path / "vllm")
    path = test / "dp0" / "prefill_s8_0" / "model.layers.0.self_attn.qkv_proj" / "rank0.safetensors"
    save_file({"[0]": torch.zeros(8, 15)}, str(path))
    bad = compare(ref, test, rtol=1e-5, atol=1e-6).first_failure
    assert bad.step == "dp0/prefill_s8_0" and bad.module == "model.layers.0.self_attn.qkv_proj"
    assert "last dim 15 is not 8 + 4 + 4 (q_proj, k_proj, v_proj)" in bad.note


def test_rebuild_llama_splits_by_heads_kv_heads_and_tensor_parallel_rank():
    shape = ModelShape.from_meta(MODEL)
    x = torch.arange(16.0)[None]
    out = rebuild_llama("model.layers.3.self_attn.qkv_proj", {"[0]": x, "[1]": torch.zeros(1)}, shape)
    assert {m: t["output"].shape[-1] for m, t in out.items()} == {
        "model.layers.3.self_attn.q_proj": 8, "model.layers.3.self_attn.k_proj": 4, "model.layers.3.self_attn.v_proj": 4}
    tp2 = ModelShape.from_meta({**MODEL, "num_key_value_heads": 2, "tp_size": 2})
    out = rebuild_llama("m.layers.0.self_attn.qkv_proj", {"[0]": torch.zeros(1, 4 + 4 + 4)}, tp2)
    assert [t["output"].shape[-1] for t in out.values()] == [4, 4, 4]
    layer = rebuild_llama("model.layers.3", {"[0]": torch.ones(2, 3), "[1]": torch.full((2, 3), 2.0)}, shape)
    assert torch.equal(layer["model.layers.3"]["output"], torch.full((2, 3), 3.0))
    assert rebuild_llama("model.norm", {"[0]": x, "[1]": x + 1}, shape)["model.norm"]["output"] is x
    with pytest.raises(RebuildError, match="lacks intermediate_size"):
        rebuild_llama("model.layers.0.mlp.gate_up_proj", {"[0]": x}, ModelShape("llama"))


def test_an_unregistered_family_is_refused_and_a_registered_one_is_used(ref, tmp_path):
    empty = FamilyRegistry()
    with pytest.raises(ConfigError, match="'model_type'.*no registered family"):
        compare(ref, write_engine(tmp_path / "vllm"), families=empty)
    calls = []

    def rebuild(module, tensors, shape):
        calls.append(module)
        return rebuild_llama(module, tensors, shape)

    empty.register(Family("my-llama", ("llama",), rebuild))
    assert compare(ref, tmp_path / "vllm", rtol=1e-5, atol=1e-6, families=empty).passed
    assert set(calls) == set(ENGINE_MODULES)
    with pytest.raises(ConfigError, match="already registered"):
        empty.register(Family("other", ("llama",), rebuild))
    with pytest.raises(ConfigError, match="Family.model_types"):
        Family("bad", "llama", rebuild)


def test_the_engine_run_as_ref_is_refused(ref, tmp_path):
    with pytest.raises(CompareError, match="give the transformers reference"):
        compare(write_engine(tmp_path / "vllm"), ref)


def test_cli_compare_across_engines(ref, tmp_path, capsys):
    test = write_engine(tmp_path / "vllm")
    assert main(["compare", str(ref), str(test), "--rtol", "1e-5", "--atol", "1e-6"]) == 0
    out = capsys.readouterr().out
    assert "all 32 tensors match" in out and "across engines" in out
    bad = write_engine(tmp_path / "bad", perturb=lambda m, r, p: m == "model.layers.1")
    assert main(["compare", str(ref), str(bad)]) == 1
    assert "first diverging module: model.layers.1 (step dp0/prefill_s8_0" in capsys.readouterr().out
