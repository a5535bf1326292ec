"""Prefix caching (on by default in vLLM 0.32) and parallel sampling (``n=2``) against ``graphpass reference``
(issue 36, item 4 and acceptance 3).

One engine, with the engine's defaults (prefix caching on; vLLM's CPU block of 128 tokens, so max_model_len 256),
serves two rounds: first a prompt of 134 tokens, then a prompt that shares its first 128 tokens, with ``n=2``. The second round's two children each find the shared
blocks in the prefix cache, so the engine computes (and captures) only their uncached suffix. The meta says so
(``prefix_cached``, ``parents``), and compare aligns the children with their parent request and counts the cached
positions: a correct run is all match."""

import json

import pytest

pytest.importorskip("vllm.config")  # vLLM itself, not a folder named vllm on sys.path

from graphpass.comparing import compare  # noqa: E402

from vllm_serving import MAX_NEW_TOKENS, reference_run, serve, write_tiny_llama  # noqa: E402

MODULES = ["model.layers.0", "model.layers.1"]
SHARED = list(range(1, 129))  # 128 tokens: a whole block of vLLM's CPU engine (block_size 128 by default)
PROMPTS = [SHARED + [70, 71, 72, 73, 74, 75], SHARED + [200, 201, 202]]
RTOL, ATOL = 1e-3, 1e-5


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("prefix-cache")
    settings = {"options": {"then": "eager"}, "tensor_capture": {"modules": MODULES, "capture_dir": str(out / "caps")}}
    rounds = [{"prompts": PROMPTS[:1], "n": 1}, {"prompts": PROMPTS[1:], "n": 2}]
    return serve(tiny_llama, out, settings, rounds=rounds, llm_kwargs={"max_model_len": 256}), out / "caps"


@pytest.fixture(scope="module")
def reference(tiny_llama, tmp_path_factory):
    return reference_run(tiny_llama, tmp_path_factory.mktemp("reference"), PROMPTS, MAX_NEW_TOKENS, MODULES)


def _metas(caps):
    return sorted(
        (json.loads(p.read_text()) for p in (caps / "dp0").glob("*/*_meta.json")), key=lambda m: m["step_index"]
    )


def test_the_meta_marks_positions_served_from_the_prefix_cache_and_the_children_of_parallel_sampling(served):
    result, caps = served
    assert result["prefix_caching"], "vLLM's default turned prefix caching off: this test needs it on"
    assert result["request_ids"] == ["0", "1"] and [len(s) for s in result["samples"]] == [1, 2]
    cached, parents = {}, {}
    for m in _metas(caps):
        assert len(m["prefix_cached"]) == len(m["parents"]) == len(m["req_ids"])
        for rid, n, parent in zip(m["req_ids"], m["prefix_cached"], m["parents"]):
            cached[rid] = max(cached.get(rid, 0), n)
            parents[rid] = parent
    children = sorted(r for r in parents if parents[r] is not None)
    assert [r.rsplit("-", 1)[0] for r in children] == ["0_1", "1_1"] and {parents[r] for r in children} == {"1"}
    block = result["block_size"]
    want = len(SHARED) // block * block
    assert want > 0, f"block size {block}: the shared prefix holds no whole block"
    # each child: the shared prefix's whole blocks came from the cache (the first request computed them)
    assert [cached[r] for r in children] == [want, want], (cached, block)
    assert all(cached[r] == 0 for r in parents if parents[r] is None)
    # and its steps hold only the rest: positions want .. end, each once
    for child in children:
        seen = sorted(
            p
            for m in _metas(caps)
            for i, p in zip(m["token_request"], m["positions"])
            if i >= 0 and m["req_ids"][i] == child
        )
        assert seen == list(range(want, len(PROMPTS[1]) + MAX_NEW_TOKENS - 1))


def test_a_correct_run_with_prefix_caching_and_n2_compares_all_match(served, reference):
    result, caps = served
    tokens = json.loads((reference / "tokens.json").read_text())
    assert result["samples"] == [[tokens[0]], [tokens[1], tokens[1]]]  # greedy: both children the reference's
    report = compare(reference, caps, rtol=RTOL, atol=ATOL)
    assert report.passed, str(report)
    assert all(r.missing is None for r in report.rows)
    want = len(SHARED) // result["block_size"] * result["block_size"]
    notes = "\n".join(report.notes)
    assert f"{want} token(s) of ref served from the engine's prefix cache" in notes, notes
    assert "2 parallel-sampling child request(s)" in notes, notes
    assert max(r.max_abs for r in report.rows) < ATOL
