"""``graphpass compare REF VLLM_CAPTURES`` end to end: ``graphpass reference`` (transformers, eager, fp32,
greedy) against vLLM's CPU engine serving the same tiny Llama, aligned by request and position, the
engine's layers rebuilt (hidden + residual, fused qkv_proj / gate_up_proj split); then against vLLM
serving a copy whose layer 1 is perturbed, with tensor_parallel_size=2: layer 1 is the first divergence,
in the first engine step, and the captures are laid out per rank (rank0 / rank1, a meta per rank).

Two engine starts serve all of it (each is minutes on 2 cores). The agreeing run also runs
speculative decoding with a draft model (the same tiny Llama as its own draft, so every draft token is
accepted) whose modules are captured under ``draft/`` and compared with the reference too, under vLLM's
torch profiler: each decoder layer's trap is a ``graphpass.trap/<layer>`` range in the worker's trace."""

import json
import os

import pytest

pytest.importorskip("vllm.config")  # vLLM itself, not a folder named vllm on sys.path

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from graphpass.comparing import compare  # noqa: E402
from graphpass.cli import main  # noqa: E402

from vllm_serving import MAX_NEW_TOKENS, PROMPTS, TP2_ENV, reference_run, serve, write_tiny_llama  # noqa: E402

ENGINE_MODULES = [
    "model.layers.0",
    "model.layers.1",
    "model.layers.0.self_attn.qkv_proj",
    "model.layers.0.mlp.gate_up_proj",
]
REF_MODULES = (
    ["model.layers.0", "model.layers.1"]
    + [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    + ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
)
RTOL, ATOL = 1e-3, 1e-5  # fp32, compare's defaults


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    return reference_run(tiny_llama, tmp_path_factory.mktemp("reference"), PROMPTS, MAX_NEW_TOKENS, REF_MODULES)


def _serve(model, out, profile_dir=None, draft=None, llm_kwargs=None, env=None):
    caps = out / "caps"
    capture = {"modules": ENGINE_MODULES, "capture_dir": str(caps)}
    llm_kwargs = dict(llm_kwargs or {})
    if draft is not None:  # speculative decoding with a draft model, whose modules are captured too
        capture["draft_modules"] = ENGINE_MODULES
        llm_kwargs["speculative_config"] = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    settings = {"options": {"then": "eager"}, "tensor_capture": capture}
    return serve(model, out, settings, profile_dir=profile_dir, llm_kwargs=llm_kwargs, env=env), caps


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    """The tiny Llama served with capture, speculative decoding (itself as the draft model, captured) and
    vLLM's torch profiler: (result, captures, trace folder)."""
    out = tmp_path_factory.mktemp("served")
    result, caps = _serve(tiny_llama, out, profile_dir=out / "traces", draft=tiny_llama)
    return result, caps, out / "traces"


def _metas(root):
    """Rank 0's metas of the steps under ``root`` (``dp0`` inside), in execution order."""
    metas = [json.loads(p.read_text()) for p in (root / "dp0").glob("*/*_meta.json")]
    return sorted(metas, key=lambda m: m["step_index"])


def _first_step(caps):
    return "dp0/" + _metas(caps)[0]["step"]


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


def test_the_draft_models_modules_are_captured_per_draft_pass_and_match_the_reference(served, reference):
    result, caps, _ = served
    assert result["stats_after"][0]["draft_capture_enabled"]
    # target and draft: one graph each, compiled at warm-up; serving compiled nothing more
    assert result["stats_before"][0]["unique_graphs"] == result["stats_after"][0]["unique_graphs"] == 2
    drafts, targets = _metas(caps / "draft"), _metas(caps)
    assert drafts and all(m["step"].startswith(("prefill_s", "decode_b")) for m in drafts)
    for m in drafts:  # after each target step, the draft's first pass (pass 0), then one more (2 tokens)
        assert 0 <= m["target_step_index"] < len(targets) and m["draft_pass"] in (0, 1)
        assert set(m["modules"]) == set(ENGINE_MODULES) and len(m["token_request"]) == len(m["positions"])
    assert [m["draft_pass"] for m in drafts] == [0, 1] * (len(drafts) // 2)
    # the draft is the target's own checkpoint: wherever it ran the reference's tokens it computes the
    # reference's values; it also runs positions the reference never fed (its guesses past the last token)
    report = compare(reference, caps / "draft", rtol=RTOL, atol=ATOL)
    bad = [r for r in report.rows if not r.passed]
    assert all(r.missing == "ref" and r.module == "" for r in bad), str(report)
    compared = [r for r in report.rows if r.passed]
    assert {r.module for r in compared} == set(REF_MODULES) | {"<input_ids>"}
    assert max(r.max_abs for r in compared) < ATOL


@pytest.fixture(scope="module")
def perturbed_tp2(tiny_llama, tmp_path_factory):
    """A copy of the tiny Llama with layer 1 perturbed, served with tensor_parallel_size=2: (result, captures)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor_parallel_size=2 binds one core per rank: this machine has fewer than 2")
    out = tmp_path_factory.mktemp("perturbed-tp2")
    return _serve(
        _perturbed(tiny_llama, out / "model"), out / "served", llm_kwargs={"tensor_parallel_size": 2}, env=TP2_ENV
    )


def test_a_perturbed_layer_is_the_first_divergence_in_the_first_step(perturbed_tp2, reference, tmp_path, capsys):
    _, caps = perturbed_tp2
    report = compare(reference, caps, rtol=RTOL, atol=ATOL)
    bad = report.first_failure
    assert bad is not None and (bad.step, bad.module, bad.rank) == (_first_step(caps), "model.layers.1", 0), str(report)
    assert bad.missing is None
    # what runs before layer 1 in that step still matches, on both ranks (q/k/v and gate/up: each rank's shard)
    before = report.rows[: report.rows.index(bad)]
    assert all(r.passed for r in before) and {r.rank for r in before if r.module != "<input_ids>"} == {0, 1}
    assert main(["compare", str(reference), str(caps), "--json", str(tmp_path / "summary.json")]) == 1
    assert "first diverging module: model.layers.1 (step " + _first_step(caps) in capsys.readouterr().out


def test_tensor_parallel_captures_are_laid_out_per_rank(perturbed_tp2):
    result, caps = perturbed_tp2
    assert len(result["stats_after"]) == 2 and all(s["capture_enabled"] for s in result["stats_after"])
    assert result["tokens"] and all(len(t) == MAX_NEW_TOKENS for t in result["tokens"])
    metas = _metas(caps)
    assert metas
    for m in metas:
        step = caps / "dp0" / m["step"]
        rank1 = json.loads((step / f"{m['step']}_meta.rank1.json").read_text())
        assert (m["tp_rank"], rank1["tp_rank"], m["tp_size"], rank1["tp_size"]) == (0, 1, 2, 2)
        for field in ("req_ids", "positions", "token_request", "input_ids", "run"):
            assert rank1[field] == m[field]  # both ranks captured the same engine step
        n = len(m["positions"])
        files = {mod: [load_file(step / mod / f"rank{r}.safetensors") for r in (0, 1)] for mod in ENGINE_MODULES}
        # column-parallel: each rank its query head and the one kv head (replicated), its half of gate and up
        assert [t["[0]"].shape for t in files["model.layers.0.self_attn.qkv_proj"]] == [(n, 3 * 64)] * 2
        assert [t["[0]"].shape for t in files["model.layers.0.mlp.gate_up_proj"]] == [(n, 256)] * 2
        for layer in ("model.layers.0", "model.layers.1"):  # after the all-reduce: whole and equal on both ranks
            r0, r1 = files[layer]
            assert r0.keys() == r1.keys() == {"[0]", "[1]"}
            assert all(r0[k].shape == (n, 128) and torch.equal(r0[k], r1[k]) for k in r0)


def test_each_decoder_layer_is_a_trap_range_in_vllms_profiler_trace(served):
    traces = served[2]
    files = [f for f in traces.rglob("*.json") if f.is_file()]
    assert files, f"vLLM wrote no trace file into {traces}: {sorted(p.name for p in traces.rglob('*'))}"
    names = {e.get("name") for f in files for e in json.loads(f.read_text()).get("traceEvents", [])}
    ranges = sorted(n for n in names if isinstance(n, str) and n.startswith("graphpass.trap/"))
    assert ranges == ["graphpass.trap/model.layers.0", "graphpass.trap/model.layers.1"], ranges
