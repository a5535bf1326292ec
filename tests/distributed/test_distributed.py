"""graphpass under torch.distributed (gloo, CPU): tensor parallel (DTensor), FSDP2, DDP and TP x FSDP2
compile with ``graphpass.backend(then="aot_eager")`` and match single-process eager; ``explain``
shows every weight's placement, mesh and bytes, the same traps on every rank, and the collectives
inside the traps they serve.

Each group of cases runs in one set of spawned ranks (``dist_helpers.run_ranks``: a free
MASTER_PORT per spawn, every child killed after a hard timeout), shared by the tests through a
module fixture, so the file costs two spawns (2 ranks, 4 ranks). The inductor cases join those two
spawns (after the aot_eager cases) when an ``inductor``-marked test of this file is selected, and
are left out of them under ``-m "not inductor"``.

Tolerances (fp32): forward logits atol 1e-5, gradients atol 1e-5 (measured: <= 3e-7 and <= 3e-8;
aot_eager runs the same aten ops as eager, only collectives reorder sums). Inductor: atol 1e-4.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dist_helpers import ok, run_ranks

# slow (make test-slow): each module spawns its own gloo ranks, each importing torch and compiling
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
    ),
]

FWD_ATOL = 1e-5
GRAD_ATOL = 1e-5
MODELS = ["tiny", "llama"]
TWO_RANK_CASES = [
    (f"{engine}:{m}", engine, {"model_name": m}) for engine in ("tp", "fsdp2", "ddp", "explain_tp") for m in MODELS
]
FOUR_RANK_CASES = [(f"tp_fsdp2:{m}", "tp_fsdp2", {"model_name": m}) for m in MODELS]
# Inductor as the delegate (the tests marked ``inductor``): TP on the Llama, the split-graph engines
# and the 2-D mesh on the bundled transformer. Named "<engine>:<model>:inductor".
TWO_RANK_INDUCTOR = [("tp:llama:inductor", "tp", {"model_name": "llama", "then": "inductor"})]
TWO_RANK_INDUCTOR += [(f"{e}:tiny:inductor", e, {"model_name": "tiny", "then": "inductor"}) for e in ("fsdp2", "ddp")]
FOUR_RANK_INDUCTOR = [("tp_fsdp2:tiny:inductor", "tp_fsdp2", {"model_name": "tiny", "then": "inductor"})]


def _inductor_selected(request) -> bool:
    """Whether this run selected an ``inductor``-marked test of this file (their cases then share
    the aot_eager cases' spawns instead of paying spawns of their own)."""
    return any(
        item.get_closest_marker("inductor") and getattr(item, "module", None) is request.module
        for item in request.session.items
    )


@pytest.fixture(scope="module")
def two_ranks(request):
    pytest.importorskip("transformers")
    inductor = _inductor_selected(request)
    return run_ranks(2, TWO_RANK_CASES + (TWO_RANK_INDUCTOR if inductor else []), timeout=660 if inductor else 300)


@pytest.fixture(scope="module")
def four_ranks(request):
    pytest.importorskip("transformers")
    inductor = _inductor_selected(request)
    return run_ranks(4, FOUR_RANK_CASES + (FOUR_RANK_INDUCTOR if inductor else []), timeout=600 if inductor else 240)


def _check(per_rank, grads: bool) -> None:
    for rank, res in enumerate(per_rank):
        assert res["out_diff"] <= FWD_ATOL, (rank, res["out_diff"])
        if grads:
            assert res["grad_diff"] <= GRAD_ATOL, (rank, res["grad_diff"])
            assert res["params"] > 0
        assert res["boundaries"] > 0, "no trap boundaries were inserted"
    # Every rank traced the same graphs and drew the same traps.
    assert all(r["traps"] == per_rank[0]["traps"] for r in per_rank)


@pytest.mark.parametrize("model", MODELS)
def test_tensor_parallel_matches_eager(two_ranks, model):
    per_rank = ok(two_ranks, f"tp:{model}")
    _check(per_rank, grads=False)
    assert per_rank[0]["graphs"] == 1  # DTensor traces whole: no graph break


@pytest.mark.parametrize("model", MODELS)
def test_fsdp2_forward_and_gradients_match_eager(two_ranks, model):
    per_rank = ok(two_ranks, f"fsdp2:{model}")
    _check(per_rank, grads=True)
    # FSDP2's hooks break the graph around each block; the block's graph gets its trap and knows
    # its parameters are FSDP2 shards at rest.
    block = next(g for g in per_rank[0]["summary"] if g["traps"])
    placements = {w[2] for w in block["weights"]}
    assert placements == {"Shard(0)"}, placements


@pytest.mark.parametrize("model", MODELS)
def test_ddp_bucket_graphs_and_gradients_match_eager(two_ranks, model):
    per_rank = ok(two_ranks, f"ddp:{model}")
    _check(per_rank, grads=True)
    assert per_rank[0]["graphs"] > 2  # DDPOptimizer split the graph at its buckets


@pytest.mark.parametrize("model", MODELS)
def test_tp_x_fsdp2_on_a_2d_mesh_matches_eager(four_ranks, model):
    per_rank = ok(four_ranks, f"tp_fsdp2:{model}")
    _check(per_rank, grads=True)
    block = next(g for g in per_rank[0]["summary"] if g["traps"])
    placements = {w[2] for w in block["weights"]}
    assert any("tp=Shard" in p for p in placements), placements  # the 2-D (dp, tp) at-rest placement


@pytest.mark.parametrize("model", MODELS)
def test_explain_shows_placement_mesh_and_bytes_same_traps_on_every_rank(two_ranks, model):
    per_rank = ok(two_ranks, f"explain_tp:{model}")
    traps = [[(t["label"], t["first_node"], t["last_node"], t["fqns"]) for t in r["dict"]["traps"]] for r in per_rank]
    assert traps[0] and all(t == traps[0] for t in traps)
    weights = {w["fqns"][0]: w for w in per_rank[0]["dict"]["tensors"]}
    prefix = "model.layers.0" if model == "llama" else "layers.0"
    colwise, rowwise = ("self_attn.q_proj", "self_attn.o_proj") if model == "llama" else ("attn.qkv", "attn.o_proj")
    q = weights[f"{prefix}.{colwise}.weight"]
    assert q["placement"] == "Shard(0)" and q["mesh"] == "cpu[0, 1]" and q["sharded_by"] == "dtensor"
    assert q["global_nbytes"] == 2 * q["nbytes"] == 2 * q["local_nbytes"]
    assert q["global_shape"][0] == 2 * q["shape"][0]
    assert weights[f"{prefix}.{rowwise}.weight"]["placement"] == "Shard(1)"
    norm = next(w for f, w in weights.items() if f.endswith("norm.weight"))
    assert "placement" not in norm  # a plain (not distributed) weight keeps the old record
    # Every collective / redistribution in the graph belongs to a trap (the block it serves).
    collectives = per_rank[0]["dict"]["collectives"]
    assert collectives and all(c["trap"] and c["trap"].startswith(prefix[:-1]) for c in collectives)
    text = per_rank[0]["text"]
    assert "placement" in text and "cpu[0, 1]" in text and "bytes/rank" in text and "global bytes" in text


@pytest.mark.inductor
def test_tensor_parallel_with_inductor_matches_eager(two_ranks):
    per_rank = ok(two_ranks, "tp:llama:inductor")
    for res in per_rank:
        assert res["out_diff"] <= 1e-4, res["out_diff"]


@pytest.mark.inductor
def test_fsdp2_ddp_and_tp_x_fsdp2_with_inductor_match_eager(two_ranks, four_ranks):
    """The engines whose graphs Dynamo splits (FSDP2's hooks, DDP's buckets) and the 2-D mesh, with
    inductor as the delegate: forward and a training step's gradients within 1e-4 of eager
    (inductor reorders float math)."""
    for results, case in (
        (two_ranks, "fsdp2:tiny:inductor"),
        (two_ranks, "ddp:tiny:inductor"),
        (four_ranks, "tp_fsdp2:tiny:inductor"),
    ):
        per_rank = ok(results, case)
        for rank, res in enumerate(per_rank):
            assert res["out_diff"] <= 1e-4 and res["grad_diff"] <= 1e-4, (case, rank, res["out_diff"], res["grad_diff"])
            assert res["boundaries"] > 0 and res["params"] > 0
        assert all(r["traps"] == per_rank[0]["traps"] for r in per_rank)
