"""Golden graphs: the pipeline's output for the corpus, compared to golden/ (``make golden`` re-accepts).

Two files per model: ``golden/ownership/<model>.txt`` (analysis passes: ownership, traps) and
``golden/trap_boundaries/<model>.txt`` (the rewritten graph's code); ``golden/capture_nodes/``
holds graphs with a ModelCapture attached, ``golden/offload_schedule/`` offloaded models' graphs.

The checks are the ones users get (``graphpass.testing.check_goldens``, the pytest plugin's
functions): every exact file has a ``<name>.meta.json`` naming the torch release it was recorded
with and is compared only on that release (skipped elsewhere; a release with its own
``<name>.torch2.9.meta.json`` is compared against ``<name>.torch2.9.txt`` where that exists, else
against ``<name>.txt``); every configuration also has a
``<name>.summary.json`` structural summary (``graphpass.golden.summarize``), compared on every
torch version.
"""

import gc
import json
import re
from pathlib import Path

import pytest
import torch

import graphpass
from graphpass.golden import (
    GoldenMismatch,
    check_golden,
    is_release_path,
    meta_path,
    render_code,
    render_ownership,
    render_schedule,
    summarize,
)
from graphpass.models.corpus import CORPUS, build
from graphpass.capturing.model_capture import sweep_marking_hook
from graphpass.testing import check_goldens


@pytest.fixture(autouse=True)
def _no_capture_left_behind():
    """Goldens are recorded with no ModelCapture alive: one an earlier test left for the collector
    keeps the global marking hook, and Dynamo orders a hooked module's inputs differently."""
    gc.collect()
    sweep_marking_hook()
    yield


GOLDEN = Path(__file__).resolve().parents[2] / "golden"
HINT = "re-accept with `make golden`"


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    return model, (ids,)


MODELS = {**{name: (lambda n=name: build(n)) for name in CORPUS}, "tiny_llama": tiny_llama}


def transformed(name):
    model, inputs = MODELS[name]()
    gp = graphpass.backend(then="eager")
    with torch.no_grad():
        out = torch.compile(model, backend=gp)(*inputs)
        ref = model(*inputs)
    if hasattr(out, "logits"):
        out, ref = out.logits, ref.logits
    assert torch.equal(out, ref)
    return gp.graphs


@pytest.mark.parametrize("name", list(MODELS))
def test_golden(name):
    graphs = transformed(name)
    ownership = "\n".join(render_ownership(g) for g in graphs)
    code = "\n".join(f"graph {g.index}\n{render_code(g.gm)}" for g in graphs)
    check_goldens(
        {GOLDEN / "ownership" / f"{name}.txt": ownership, GOLDEN / "trap_boundaries" / f"{name}.txt": code},
        {GOLDEN / "trap_boundaries" / f"{name}.summary.json": summarize(graphs)},
        hint=HINT,
    )


CAPTURED = {
    "tiny_transformer": ["layers.0-1", "lm_head"],
    "graph_break": ["layers.0.fc2", "layers.1.fc1", "layers.1.fc2"],
    "moe": [".*moe"],
    "tiny_llama": ["model.layers.0-1", "lm_head"],
}


@pytest.mark.parametrize("name", list(CAPTURED))
def test_golden_capture_nodes(name, tmp_path):
    """``insert_capture_nodes``: the graph with a ModelCapture attached."""
    model, inputs = MODELS[name]()
    gp = graphpass.backend(then="eager")
    compiled = torch.compile(model, backend=gp)
    capture = graphpass.ModelCapture(compiled, modules=CAPTURED[name], capture_dir=tmp_path)
    with torch.no_grad():
        compiled(*inputs)
    del capture
    code = "\n".join(f"graph {g.index}\n{render_code(g.gm)}" for g in gp.graphs)
    assert "graphpass.capture" in code
    summary = summarize(gp.graphs)
    assert sum(t["captures"] for t in summary["traps"].values()) == code.count("graphpass.capture.default(")
    check_goldens(
        {GOLDEN / "capture_nodes" / f"{name}.txt": code},
        {GOLDEN / "capture_nodes" / f"{name}.summary.json": summary},
        hint=HINT,
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_golden_offload_schedule(name, tmp_path):
    """``insert_offload_schedule``: loads, waits and evictions per trap, storage="cpu", prefetch 1."""
    model, inputs = MODELS[name]()
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        ref = model(*inputs)
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu", prefetch_distance=1))
    gp = graphpass.backend(then="eager")
    with torch.no_grad():
        out = torch.compile(model, backend=gp)(*inputs)
    if hasattr(out, "logits"):
        out, ref = out.logits, ref.logits
    assert torch.equal(out, ref)
    text = []
    for g in gp.graphs:
        text.append(f"graph {g.index}")
        text.extend(render_schedule(g))
        text.append(render_code(g.gm))
    code = "\n".join(text)
    assert "graphpass.load_start" in code
    summary = summarize(gp.graphs)
    assert summary["schedule"] and all(summary["traps"][label]["loads"] >= 1 for label in summary["schedule"])
    check_goldens(
        {GOLDEN / "offload_schedule" / f"{name}.txt": code},
        {GOLDEN / "offload_schedule" / f"{name}.summary.json": summary},
        hint=HINT,
    )


def test_golden_static_shapes(tmp_path):
    """``plan_static_shapes`` and ``slice_static_buffers`` on the seed-style model, dynamic=True."""
    from graphpass.models.corpus import SeedStyle

    torch.manual_seed(0)
    model = SeedStyle().eval()
    gp = graphpass.backend(then="eager", static_shapes={"dims": {"ids": 1}, "buckets": [8, 16]})
    with torch.no_grad():
        torch.compile(model, backend=gp, dynamic=True)(torch.randint(0, 64, (2, 5)))
    (g,) = gp.graphs
    plan = g.analysis.bucket_plan
    lines = [
        f"padded inputs: {sorted((i, [d for d, _ in dims]) for i, dims in plan.pad.items())}",
        f"size inputs: {sorted(plan.size_inputs)}",
        f"outputs: {[o is not None for o in plan.outputs]}",
        f"refused: {plan.refused}",
        *[line for line in g.log if "static" in line and "compiled bucket" not in line],
        render_code(g.gm),
    ]
    check_goldens(
        {GOLDEN / "static_shapes" / "seed_style.txt": "\n".join(lines) + "\n"},
        {GOLDEN / "static_shapes" / "seed_style.summary.json": summarize(gp.graphs)},
        hint=HINT,
    )


def test_golden_corpus_is_complete():
    assert len(MODELS) >= 7
    for name in MODELS:
        for sub in ("ownership", "trap_boundaries", "offload_schedule"):
            assert (GOLDEN / sub / f"{name}.txt").exists(), f"run `make golden` to record {sub}/{name}"
            assert meta_path(GOLDEN / sub / f"{name}.txt").exists(), (
                f"run `make golden` to record {sub}/{name}.meta.json"
            )
        for sub in ("trap_boundaries", "offload_schedule"):
            assert (GOLDEN / sub / f"{name}.summary.json").exists(), (
                f"run `make golden` to record {sub}/{name}.summary.json"
            )
    for sub in ("capture_nodes", "static_shapes"):
        for txt in (GOLDEN / sub).glob("*.txt"):
            if not is_release_path(txt):
                assert meta_path(txt).exists() and txt.with_name(f"{txt.stem}.summary.json").exists(), txt
    # a release's own golden (name.torch2.9.txt and/or its meta) sits beside a main one
    for txt in GOLDEN.rglob("*.txt"):
        if is_release_path(txt):
            assert meta_path(txt).exists(), txt
    for meta in GOLDEN.rglob("*.torch*.meta.json"):
        assert meta.with_name(re.sub(r"\.torch\d+\.\d+\.meta\.json$", ".txt", meta.name)).exists(), meta
    for meta in GOLDEN.rglob("*.meta.json"):
        assert set(json.loads(meta.read_text())) == {"torch", "graphpass"}, meta


def test_golden_mismatch_fails(tmp_path, monkeypatch):
    monkeypatch.delenv("GRAPHPASS_ACCEPT_GOLDEN", raising=False)
    f = tmp_path / "g.txt"
    f.write_text("a\n")
    with pytest.raises(AssertionError, match="make golden"):
        check_golden(f, "b\n")
    check_golden(f, "a\n")
    with pytest.raises(GoldenMismatch, match=r"(?s)make golden.*-a\n\+b"):
        check_goldens({f: "b\n"}, {}, hint=HINT, accept=False)


def test_renderings_hold_no_paths_ids_or_addresses():
    text = "\n".join(
        (GOLDEN / sub / f).read_text()
        for sub in ("ownership", "trap_boundaries")
        for f in sorted(p.name for p in (GOLDEN / sub).glob("*.txt"))
    )
    text += "\n".join(
        p.read_text()
        for sub in ("capture_nodes", "static_shapes", "offload_schedule")
        for p in sorted((GOLDEN / sub).glob("*.txt"))
    )
    text += "\n".join(p.read_text() for p in sorted(GOLDEN.rglob("*.json")))
    for bad in ("/work/", "site-packages", ".py:", "0x7f", "File \""):
        assert bad not in text
