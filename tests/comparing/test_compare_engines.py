"""``compare`` across engines (graphpass.capturing.compare_engines, engine_families) on synthetic capture
folders: a reference in transformers' layout (one request per step, ``[1, tokens, ...]``, modules
q_proj/k_proj/v_proj, gate_proj/up_proj, layer output one tensor) against an engine run in vLLM's
(requests flattened into shared steps, ``[tokens, ...]``, the layer's ``(hidden, residual)``, fused
qkv_proj / gate_up_proj, linears returning ``(out, bias)``). No vLLM needed; the end-to-end test with
vLLM is tests/in_vllm/test_compare_engines_vllm.py."""

import dataclasses
import json
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphpass.comparing import CompareError, compare
from graphpass.comparing.engine_families import Family, FamilyRegistry, ModelShape, RebuildError, rebuild_llama
from graphpass.cli import main
from graphpass.errors import ConfigError

H, HEADS, KV, HEAD_DIM, INTER = 8, 2, 1, 4, 6
MODEL = {
    "model_type": "llama",
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": HEAD_DIM,
    "intermediate_size": INTER,
    "tp_size": 1,
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
GENERATED = [[10, 11, 12, 13], [20, 21, 22, 23]]
LAYERS = ["model.layers.0", "model.layers.1"]
SIZES = {
    "q_proj": HEADS * HEAD_DIM,
    "k_proj": KV * HEAD_DIM,
    "v_proj": KV * HEAD_DIM,
    "gate_proj": INTER,
    "up_proj": INTER,
}
REF_MODULES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.up_proj",
    *LAYERS,
]
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
    meta = {
        "step": name,
        "step_index": index,
        "phase": "prefill" if name.startswith("prefill") else "decode",
        "modules": list(tensors),
        "req_ids": req_ids,
        "positions": [p if p is not None else 0 for _, _, p in rows],
        "token_request": [i for i, _, _ in rows],
        "engine": engine,
        "model": MODEL,
        "input_ids": [token(r, p) if r is not None else 0 for _, r, p in rows],
        "tensors": {
            m: [{"key": k, "shape": list(t.shape), "dtype": "float32"} for k, t in keys.items()]
            for m, keys in tensors.items()
        },
    }
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
            v = torch.stack(
                [torch.cat([t(f"{pre}.{n}", r, p) for n in ("q_proj", "k_proj", "v_proj")]) for r, p in real]
            )
            out[m] = {"[0]": v}
        elif m.endswith("gate_up_proj"):
            pre = m.rpartition(".")[0]
            out[m] = {
                "[0]": torch.stack(
                    [torch.cat([t(f"{pre}.{n}", r, p) for n in ("gate_proj", "up_proj")]) for r, p in real]
                )
            }
        else:  # a decoder layer: hidden + residual is transformers' output
            whole = torch.stack([t(m, r, p) for r, p in real])
            residual = torch.randn(whole.shape, generator=torch.Generator().manual_seed(len(real)))
            out[m] = {"[0]": whole - residual, "[1]": residual}
        out[m] = {k: torch.cat([v, torch.full((pad, *v.shape[1:]), 7.0)]) for k, v in out[m].items()}
    return out


def write_engine(root, modules=ENGINE_MODULES, perturb=None, pad_decode=False, engine="vllm"):
    """vLLM's layout: both requests in every step, flattened; internal request ids with a suffix (another
    ``engine``'s: the caller's ids as they are)."""
    ids = ["0-a1b2", "1-c3d4"] if engine == "vllm" else ["0", "1"]
    steps = [("prefill_s8_0", [(0, 0, p) for p in range(5)] + [(1, 1, p) for p in range(3)])]
    for d in range(3):
        rows = [(0, 0, 5 + d), (1, 1, 3 + d)]
        steps.append((f"decode_b2_{d}", rows + ([(-1, None, None)] if pad_decode else [])))
    for index, (name, rows) in enumerate(steps):
        write_step(root, name, index, ids, rows, engine, engine_tensors(rows, modules, perturb))
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


@pytest.mark.parametrize(
    "module, req, pos, step",
    [
        ("model.layers.1", 1, 4, "dp0/decode_b2_1"),  # request 1's second decode token
        ("model.layers.0.self_attn.k_proj", 0, 2, "dp0/prefill_s8_0"),  # inside the fused qkv_proj
        ("model.layers.0.mlp.up_proj", 0, 6, "dp0/decode_b2_1"),  # inside the fused gate_up_proj
    ],
)
def test_a_perturbed_module_is_the_first_divergence_in_the_first_step_it_diverges(
    ref, tmp_path, module, req, pos, step
):
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
        ("dp0/decode_b1_5", "test", "1 token(s) of ref missing in test: request 1 positions 5"),
    ]


def test_a_module_one_side_lacks_is_a_fail_row_naming_the_side(ref, tmp_path):
    test = write_engine(tmp_path / "vllm", modules=[m for m in ENGINE_MODULES if "gate_up" not in m])
    report = compare(ref, test, rtol=1e-5, atol=1e-6)
    lost = {(r.module, r.missing) for r in report.rows if not r.passed}
    assert lost == {("model.layers.0.mlp.gate_proj", "test"), ("model.layers.0.mlp.up_proj", "test")}
    assert "module missing in test" in report.first_failure.note


@pytest.mark.parametrize("module", ["model.layers.0", "model.layers.0.mlp.gate_up_proj"])
def test_a_tensor_with_fewer_rows_than_its_meta_is_a_fail_row_not_a_crash(ref, tmp_path, module):
    """Issue 36, item 5: a capture truncated to fewer rows than its meta's positions crashed compare (IndexError,
    exit 1 like an ordinary FAIL); it is a FAIL row naming the module and the row counts."""
    test = write_engine(tmp_path / "vllm")
    path = test / "dp0" / "prefill_s8_0" / module / "rank0.safetensors"
    save_file({k: v[:5].contiguous() for k, v in load_file(str(path)).items()}, str(path))
    report = compare(ref, test, rtol=1e-5, atol=1e-6)
    bad = [r for r in report.rows if not r.passed]
    assert bad and bad[0].step == "dp0/prefill_s8_0" and "5 row(s) but the step's meta places 8" in bad[0].note
    assert main(["compare", str(ref), str(test)]) == 1


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
        "model.layers.3.self_attn.q_proj": 8,
        "model.layers.3.self_attn.k_proj": 4,
        "model.layers.3.self_attn.v_proj": 4,
    }
    # tensor parallelism: each rank's q/k/v heads are Slices of transformers' q/k/v (vLLM's QKVParallelLinear)
    tp2 = ModelShape.from_meta({**MODEL, "num_key_value_heads": 2, "tp_size": 2})
    assert tp2.tp_rank == 0 and "tp_rank" not in tp2.to_meta()
    for rank in (0, 1):
        out = rebuild_llama(
            "m.layers.0.self_attn.qkv_proj", {"[0]": torch.zeros(1, 4 + 4 + 4)}, dataclasses.replace(tp2, tp_rank=rank)
        )
        assert [(t["output"].tensor.shape[-1], t["output"].start) for t in out.values()] == [(4, 4 * rank)] * 3
    # one kv head, two ranks: the kv head is replicated, both ranks' k and v are transformers' whole k and v
    one_kv = ModelShape.from_meta({**MODEL, "tp_size": 2, "num_key_value_heads": 1})
    out = rebuild_llama(
        "m.layers.0.self_attn.qkv_proj", {"[0]": torch.zeros(1, 4 + 4 + 4)}, dataclasses.replace(one_kv, tp_rank=1)
    )
    assert [(t["output"].start, t["output"].stop) for t in out.values()] == [(4, 8), (0, 4), (0, 4)]
    out = rebuild_llama(
        "m.layers.0.mlp.gate_up_proj", {"[0]": torch.zeros(1, 6)}, dataclasses.replace(one_kv, tp_rank=1)
    )
    assert [(t["output"].start, t["output"].stop) for t in out.values()] == [(3, 6), (3, 6)]
    with pytest.raises(RebuildError, match="do not shard over 3"):
        rebuild_llama("m.layers.0.self_attn.qkv_proj", {"[0]": x}, ModelShape.from_meta({**MODEL, "tp_size": 3}))
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


def test_families_are_keyed_by_engine_and_model_type(ref, tmp_path):
    """Issue 37: the same model_type registered for two engines; each engine's captures are rebuilt by its own
    family, and a family registered without an engine is vLLM's (as register_family always registered)."""
    used = []

    def tagged(tag):
        def rebuild(module, tensors, shape):
            used.append(tag)
            return rebuild_llama(module, tensors, shape)

        return rebuild

    families = FamilyRegistry()
    families.register(Family("vllm-llama", ("llama",), tagged("vllm")))  # no engine: vLLM's
    families.register(Family("other-llama", ("llama",), tagged("other"), engine="other"))  # no collision
    assert families.lookup("llama").name == "vllm-llama"
    assert families.lookup("llama", engine="other").name == "other-llama"
    assert families.engines() == ["other", "vllm"] and set(families.by_type) == {"llama"}
    report = compare(ref, write_engine(tmp_path / "vllm"), rtol=1e-5, atol=1e-6, families=families)
    assert report.passed and set(used) == {"vllm"}, str(report)
    assert any("vllm against transformers" in n and "'vllm-llama' family" in n for n in report.notes)
    used.clear()
    report = compare(ref, write_engine(tmp_path / "other", engine="other"), rtol=1e-5, atol=1e-6, families=families)
    assert report.passed and set(used) == {"other"}, str(report)
    assert any("other against transformers" in n and "'other-llama' family" in n for n in report.notes)
    with pytest.raises(CompareError, match=r"can align \('third'; known: vllm, transformers, other\)"):
        compare(ref, write_engine(tmp_path / "third", engine="third"), families=families)
    vllm_llama_only = FamilyRegistry()
    vllm_llama_only.register(Family("vllm-llama", ("llama",), rebuild_llama))
    vllm_llama_only.register(Family("other-qwen2", ("qwen2",), rebuild_llama, engine="other"))
    with pytest.raises(ConfigError, match="has no registered family for engine 'other' \\(known: qwen2\\)"):
        compare(ref, tmp_path / "other", families=vllm_llama_only)  # vLLM's llama is not the other engine's
    with pytest.raises(ConfigError, match="Family.engine"):
        Family("ref", ("llama",), rebuild_llama, engine="transformers")


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


def to_tp2(root, change=None):
    """An engine run of write_engine re-laid out as vLLM's tensor_parallel_size=2 writes it: per module one
    rank{r}.safetensors per rank (decoder layers whole on both ranks; qkv_proj: rank r's query head and the
    one kv head, replicated; gate_up_proj: rank r's half of gate and of up) and a meta file per rank.
    ``change(step, module, rank, tensors)`` may alter a rank's tensors before they are written."""
    from safetensors.torch import load_file

    q, half = HEADS // 2 * HEAD_DIM, INTER // 2
    for step in sorted((root / "dp0").iterdir()):
        meta_path = step / f"{step.name}_meta.json"
        meta = json.loads(meta_path.read_text())
        meta["model"] = {**MODEL, "tp_size": 2}
        for module in meta["modules"]:
            whole = load_file(str(step / module / "rank0.safetensors"))
            for rank in (0, 1):
                t = dict(whole)
                if module.endswith("qkv_proj"):
                    x = whole["[0]"]
                    t["[0]"] = torch.cat([x[:, rank * q : (rank + 1) * q], x[:, HEADS * HEAD_DIM :]], dim=-1)
                elif module.endswith("gate_up_proj"):
                    x = whole["[0]"]
                    t["[0]"] = torch.cat(
                        [x[:, rank * half : (rank + 1) * half], x[:, INTER + rank * half : INTER + (rank + 1) * half]],
                        dim=-1,
                    )
                if change:
                    change(step.name, module, rank, t)
                save_file({k: v.contiguous() for k, v in t.items()}, str(step / module / f"rank{rank}.safetensors"))
        for rank in (0, 1):
            name = meta_path.name if rank == 0 else f"{step.name}_meta.rank1.json"
            (step / name).write_text(json.dumps({**meta, "tp_rank": rank, "tp_size": 2}))
    return root


def test_tensor_parallel_ranks_are_each_compared_whole_or_by_their_shard(ref, tmp_path):
    report = compare(ref, to_tp2(write_engine(tmp_path / "vllm")), rtol=1e-5, atol=1e-6)
    assert report.passed, str(report)
    assert any("2 tensor-parallel ranks" in n for n in report.notes)
    first = [(r.module, r.rank) for r in report.rows if r.step == "dp0/prefill_s8_0"]
    assert first == [("<input_ids>", 0)] + [(m, rank) for m in REF_MODULES for rank in (0, 1)]
    notes = {(r.module, r.rank): r.note for r in report.rows if r.step == "dp0/prefill_s8_0"}
    assert notes["model.layers.0.self_attn.q_proj", 1] == "rank 1's shard [..., 4:8]"
    assert notes["model.layers.0.self_attn.k_proj", 1] == "rank 1's shard [..., 0:4]"  # the replicated kv head
    assert notes["model.layers.0.mlp.up_proj", 1] == "rank 1's shard [..., 3:6]"
    assert notes["model.layers.1", 1] == ""


@pytest.mark.parametrize(
    "module, key, rank, want",
    [
        # one rank's shard of a fused projection: that projection, on that rank
        ("model.layers.0.mlp.gate_up_proj", "[0]", 1, "model.layers.0.mlp.up_proj"),
        # the ranks disagree on a whole (all-reduced) layer output: the rank whose copy differs is named
        ("model.layers.1", "[1]", 1, "model.layers.1"),
    ],
)
def test_a_diverging_rank_is_named(ref, tmp_path, module, key, rank, want):
    def change(step, mod, r, t):
        if step == "decode_b2_1" and mod == module and r == rank:
            t[key] = t[key].clone()
            t[key][:, -1] += 1e-2

    report = compare(ref, to_tp2(write_engine(tmp_path / "vllm"), change), rtol=1e-5, atol=1e-6)
    bad = report.first_failure
    assert (bad.step, bad.module, bad.rank) == ("dp0/decode_b2_1", want, rank), str(report)
    assert {(r.module, r.rank) for r in report.rows if not r.passed} == {(want, rank)}


def test_a_rank_whose_meta_or_file_is_missing_or_other_is_a_fail_row(ref, tmp_path):
    test = to_tp2(write_engine(tmp_path / "vllm"))
    step = test / "dp0" / "decode_b2_0"
    meta = json.loads((step / "decode_b2_0_meta.rank1.json").read_text())
    (step / "decode_b2_0_meta.rank1.json").write_text(json.dumps({**meta, "positions": meta["positions"][::-1]}))
    (test / "dp0" / "decode_b2_2" / "decode_b2_2_meta.rank1.json").unlink()
    (test / "dp0" / "decode_b2_1" / "model.layers.1" / "rank1.safetensors").unlink()
    report = compare(ref, test, rtol=1e-5, atol=1e-6)
    bad = [(r.step, r.module, r.rank, r.missing) for r in report.rows if not r.passed]
    assert bad == [
        ("dp0/decode_b2_0", "<meta>", 1, None),
        ("dp0/decode_b2_1", "model.layers.1", 1, "test"),
        ("dp0/decode_b2_2", "<meta>", 1, "test"),
    ], str(report)
    notes = [r.note for r in report.rows if not r.passed]
    assert "rank 1's meta differs from rank 0's in positions" in notes[0]
    assert "rank file missing" in notes[1] and "no meta file decode_b2_2_meta.rank1.json" in notes[2]


def test_the_draft_models_steps_are_compared_on_their_own(ref, tmp_path):
    test = write_engine(tmp_path / "vllm")
    # the draft model's steps beside the engine's: same requests and positions, another model (here: off by 1)
    write_engine(tmp_path / "vllm" / "draft", perturb=lambda m, r, p: True)
    report = compare(ref, test, rtol=1e-5, atol=1e-6)
    assert report.passed and all(not r.step.startswith("draft/") for r in report.rows), str(report)
    assert any("the steps under draft/ are another model's" in n for n in report.notes)
    bad = compare(ref, test / "draft", rtol=1e-5, atol=1e-6).first_failure
    assert (bad.step, bad.module) == ("dp0/prefill_s8_0", REF_MODULES[0])


def _with_meta(root, name, **fields):
    path = root / "dp0" / name / f"{name}_meta.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def write_cached_engine(root, cached_meta=True):
    """vLLM with its prefix cache: request 1 arrives after request 0 and its first 2 positions come from the cache
    (in a real engine, full blocks of a shared prefix), so its prefill step computes only position 2."""
    steps = [
        ("prefill_s5_0", ["0-a1b2"], [(0, 0, p) for p in range(5)], [0]),
        ("prefill_s2_1", ["0-a1b2", "1-c3d4"], [(0, 0, 5), (1, 1, 2)], [0, 2]),
    ]
    for d in range(3):
        steps.append((f"decode_b2_{d}", ["0-a1b2", "1-c3d4"], [(0, 0, 6 + d), (1, 1, 3 + d)], [0, 0]))
    steps[-1] = ("decode_b1_0", ["1-c3d4"], [(0, 1, 5)], [0])
    for index, (name, ids, rows, cached) in enumerate(steps):
        write_step(root, name, index, ids, rows, "vllm", engine_tensors(rows))
        if cached_meta:
            _with_meta(root, name, prefix_cached=cached, parents=[None] * len(ids))
    return root


def test_positions_served_from_the_prefix_cache_are_counted_not_failed(ref, tmp_path):
    """Issue 36, item 4: with prefix caching (vLLM's default) a request's cached positions are in none of its steps;
    the meta says how many (``prefix_cached``), and compare counts them in a note instead of failing the run."""
    report = compare(ref, write_cached_engine(tmp_path / "vllm"), rtol=1e-5, atol=1e-6)
    assert report.passed, str(report)
    assert any(
        "2 token(s) of ref served from the engine's prefix cache" in n and "request 1 positions 0,1" in n
        for n in report.notes
    ), report.notes
    # without the meta's word for it, the same positions are missing: FAIL, never a silent pass
    report = compare(ref, write_cached_engine(tmp_path / "vllm2", cached_meta=False), rtol=1e-5, atol=1e-6)
    assert [r.note for r in report.rows if not r.passed] == [
        "2 token(s) of ref missing in test: request 1 positions 0,1"
    ]


def test_a_prefix_cache_claim_covers_only_the_positions_it_names(ref, tmp_path):
    test = write_cached_engine(tmp_path / "vllm")
    _with_meta(test, "prefill_s2_1", prefix_cached=[0, 1], parents=[None, None])
    report = compare(ref, test, rtol=1e-5, atol=1e-6)
    assert [r.note for r in report.rows if not r.passed] == ["1 token(s) of ref missing in test: request 1 positions 1"]


def write_sampled_engine(root, parents=True):
    """vLLM's parallel sampling (n=2) of request 0: children ``0_0`` and ``1_0`` (greedy: the same tokens), and
    request 1 as it is."""
    ids = ["0_0-a1b2", "1_0-e5f6", "1-c3d4"]
    steps = [
        ("prefill_s13_0", [(0, 0, p) for p in range(5)] + [(1, 0, p) for p in range(5)] + [(2, 1, p) for p in range(3)])
    ]
    for d in range(3):
        steps.append((f"decode_b3_{d}", [(0, 0, 5 + d), (1, 0, 5 + d), (2, 1, 3 + d)]))
    for index, (name, rows) in enumerate(steps):
        write_step(root, name, index, ids, rows, "vllm", engine_tensors(rows))
        if parents:
            _with_meta(root, name, prefix_cached=[0, 0, 0], parents=["0", "0", None])
    return root


def test_parallel_sampling_children_are_compared_with_their_parent_request(ref, tmp_path):
    """Issue 36, item 4: ``n=2`` forks request 0 into children ``0_0`` and ``1_0``; the meta names their parent
    (``parents``) and compare aligns each child's rows with the reference's parent request."""
    report = compare(ref, write_sampled_engine(tmp_path / "vllm"), rtol=1e-5, atol=1e-6)
    assert report.passed, str(report)
    assert any("2 parallel-sampling child request(s)" in n and "0_0 of 0" in n for n in report.notes), report.notes
    assert all(r.missing is None for r in report.rows)
    report = compare(ref, write_sampled_engine(tmp_path / "vllm2", parents=False), rtol=1e-5, atol=1e-6)
    assert not report.passed and any("missing in ref: request 0_0 positions" in r.note for r in report.rows)
