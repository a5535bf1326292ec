"""``graphpass compare REF VLLM_CAPTURES`` end to end: ``graphpass reference`` (transformers, eager, fp32,
greedy) against vLLM's CPU engine serving the same tiny Llama, aligned by request and position, the
engine's layers rebuilt (hidden + residual, fused qkv_proj / gate_up_proj split); then against vLLM
serving a copy whose layer 1 is perturbed: layer 1 is the first divergence, in the first engine step.
The agreeing run also runs under vLLM's torch profiler (one engine start for both): each decoder layer's
trap is a ``graphpass.trap/<layer>`` range in the worker's trace file."""

import json

import pytest

pytest.importorskip("vllm.config")  # vLLM itself, not a folder named vllm on sys.path

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from graphpass.capturing import compare  # noqa: E402
from graphpass.cli import main  # noqa: E402

from vllm_serving import MAX_NEW_TOKENS, PROMPTS, serve, write_tiny_llama  # noqa: E402

ENGINE_MODULES = ["model.layers.0", "model.layers.1", "model.layers.0.self_attn.qkv_proj",
                  "model.layers.0.mlp.gate_up_proj"]
REF_MODULES = ["model.layers.0", "model.layers.1"] + [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"] + [
    "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
RTOL, ATOL = 1e-3, 1e-5  # fp32, compare's defaults


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    (out / "prompts.json").write_text(json.dumps(PROMPTS))
    assert main(["reference", str(tiny_llama), "--prompts", str(out / "prompts.json"), "--max-new-tokens",
                 str(MAX_NEW_TOKENS), "--modules", *REF_MODULES, "--out", str(out / "ref")]) == 0
    return out / "ref"


def _serve(model, out, profile_dir=None):
    caps = out / "caps"
    settings = {"options": {"then": "eager"}, "tensor_capture": {"modules": ENGINE_MODULES, "capture_dir": str(caps)}}
    return serve(model, out, settings, profile_dir=profile_dir), caps


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """The tiny Llama served with capture, under vLLM's torch profiler: (result, captures, trace folder)."""
    out = tmp_path_factory.mktemp("served")
    result, caps = _serve(tiny_llama, out, profile_dir=out / "traces")
    return result, caps, out / "traces"


def _first_step(caps):
    metas = [json.loads(p.read_text()) for p in (caps / "dp0").glob("*/*_meta.json")]
    return "dp0/" + min(metas, key=lambda m: m["step_index"])["step"]


def test_vllm_matches_the_reference_at_every_token_of_every_rebuilt_module(served, reference):
    result, caps, _ = served
    assert result["tokens"] == json.loads((reference / "tokens.json").read_text())
    report = compare(reference, caps, rtol=RTOL, atol=ATOL)
    assert report.passed, str(report)
    modules = {r.module for r in report.rows}
    assert modules == set(REF_MODULES) | {"<input_ids>"}
    assert all(r.missing is None for r in report.rows)
    worst = max(r.max_abs for r in report.rows)
    print(f"vLLM vs transformers: {len(report.rows)} rows, max abs difference {worst:.3g}")
    assert worst < ATOL


def _perturbed(model_dir, out):
    import shutil

    shutil.copytree(model_dir, out)
    path = out / "model.safetensors"
    weights = load_file(str(path))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name] + 0.05 * torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(1))
    save_file(weights, str(path), metadata={"format": "pt"})
    return out


def test_a_perturbed_layer_is_the_first_divergence_in_the_first_step(tiny_llama, reference, tmp_path, capsys):
    _, caps = _serve(_perturbed(tiny_llama, tmp_path / "perturbed"), tmp_path / "served")
    report = compare(reference, caps, rtol=RTOL, atol=ATOL)
    bad = report.first_failure
    assert bad is not None and (bad.step, bad.module) == (_first_step(caps), "model.layers.1"), str(report)
    assert bad.missing is None
    # what runs before layer 1 in that step still matches
    assert all(r.passed for r in report.rows[:report.rows.index(bad)])
    assert main(["compare", str(reference), str(caps), "--json", str(tmp_path / "summary.json")]) == 1
    assert "first diverging module: model.layers.1 (step " + _first_step(caps) in capsys.readouterr().out


def test_each_decoder_layer_is_a_trap_range_in_vllms_profiler_trace(served):
    traces = served[2]
    files = [f for f in traces.rglob("*.json") if f.is_file()]
    assert files, f"vLLM wrote no trace file into {traces}: {sorted(p.name for p in traces.rglob('*'))}"
    names = {e.get("name") for f in files for e in json.loads(f.read_text()).get("traceEvents", [])}
    ranges = sorted(n for n in names if isinstance(n, str) and n.startswith("graphpass.trap/"))
    assert ranges == ["graphpass.trap/model.layers.0", "graphpass.trap/model.layers.1"], ranges
