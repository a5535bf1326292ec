"""Captures per rank and compare across shardings (issue 12 items 4 and 5).

Spawned (gloo, CPU, 2 ranks, hard timeout): the corpus MLP stack, tensor parallel with DTensor
(``ColwiseParallel(use_local_output=False)`` fc1, ``RowwiseParallel`` fc2), compiled with graphpass
(``then="eager"``) and captured per rank; rank 0 also captures the single-process eager reference.
Then, in the parent: the TP=2 capture matches the TP=1 reference once its shards are assembled, a
perturbation of rank 1's shard of ``layers.1.fc1.weight`` is found and named (module and rank), and
one run's captures written to two roots ("hosts") compare as one. The same TP=2 capture under the
AOTAutograd delegates (``aot_eager``, ``inductor``: fc1's outputs are DTensors there too) writes the
values and meta of ``then="eager"``, from one whole-model graph. The rest (assembling, replicated
copies that disagree, rank resolution from a mesh) is checked in-process on small hand-made files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import graphpass
from graphpass.capturing.model_capture import resolve_ranks
from graphpass.capturing.writer import read_step_meta
from graphpass.cli import main

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)

MODULES = ["layers.0-2", "layers.0.fc1", "layers.1.fc1", "layers.2.fc1", "head"]
STEP = "dp0/decode_b4_0"
DELEGATES = ("aot_eager", "inductor")  # AOTAutograd delegates: they trace the DTensor graph again


# ------------------------------------------------------------------ what each rank runs


def _capture(model, x, capture_dir, then="eager", **ranks):
    """One captured step of ``model`` compiled with ``graphpass.backend(then=then)``; returns the
    writer's (dp, tp) ranks and the backend (its ``graphs``)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gp = graphpass.backend(then=then)
    compiled = torch.compile(model, backend=gp)
    cap = graphpass.ModelCapture(compiled, modules=MODULES, capture_dir=capture_dir, **ranks)
    cap.enable()
    with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]), torch.no_grad():
        compiled(x)
    return (cap.writer.dp_rank, cap.writer.tp_rank), gp


def _tp_model(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from graphpass.models.corpus import build

    model, (x,) = build("mlp_stack")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = {}
    for i in range(len(model.layers)):
        plan[f"layers.{i}.fc1"] = ColwiseParallel(use_local_output=False)
        plan[f"layers.{i}.fc2"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan), x


def case_tp_captures(rank: int, world: int, root: str) -> dict:
    """What each rank runs (``dist_helpers.run_ranks``): the eager reference (rank 0), a TP=2
    capture, and one with rank 1's shard perturbed."""
    from graphpass.models.corpus import build

    result: dict = {}
    if rank == 0:  # the single-process eager reference (explicit ranks: this process is one of two)
        model, (x,) = build("mlp_stack")
        _capture(model, x, Path(root) / "ref", dp_rank=0, tp_rank=0)
    dist.barrier()
    model, x = _tp_model(world)
    result["ranks"] = _capture(model, x, Path(root) / f"host{rank}")[0]  # ranks from the DTensor mesh
    model, x = _tp_model(world)
    if rank == 1:
        with torch.no_grad():
            model.layers[1].fc1.weight.to_local().add_(1e-2)  # rank 1's shard of one layer's weight
    _capture(model, x, Path(root) / "bad")
    return result


def case_tp_delegates(rank: int, world: int, root: str) -> dict:
    """The TP=2 capture under ``then="eager"`` and each of :data:`DELEGATES`, each into
    ``root/delegates/<then>``; per delegate: graphs compiled, Dynamo's graph breaks and fallbacks
    (a delegate that fails on a graph is one: Dynamo then runs that frame outside any graph and
    compiles its inner calls piecemeal) and the modules whose capture nodes are in the graphs
    graphpass handed to the delegate."""
    from graphpass.capturing.ops import is_capture

    result: dict = {}
    for then in ("eager", *DELEGATES):
        model, x = _tp_model(world)
        _, gp = _capture(model, x, Path(root) / "delegates" / then, then=then)
        counters = torch._dynamo.utils.counters
        result[then] = {
            "graphs": len(gp.graphs),
            "breaks": sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values()),
            "captured": sorted({n.args[0] for g in gp.graphs for n in g.gm.graph.nodes if is_capture(n)}),
        }
    return result


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Both spawned cases in one pair of ranks: (root, per-rank results)."""
    from dist_helpers import run_ranks

    root = tmp_path_factory.mktemp("tp_captures")
    results = run_ranks(
        2,
        [
            ("captures", "test_distributed_capture:case_tp_captures", {"root": str(root)}),
            ("delegates", "test_distributed_capture:case_tp_delegates", {"root": str(root)}),
        ],
        timeout=360,
    )
    return root, results


@pytest.fixture(scope="module")
def tp_captures(tp_run):
    from dist_helpers import ok

    root, results = tp_run
    for rank, res in enumerate(ok(results, "captures")):
        assert res["ranks"] == (0, rank)  # (dp, tp) from the mesh's "tp" dimension
    return root


# ------------------------------------------------------------------ spawned: per-rank captures


@pytest.mark.slow
def test_each_rank_writes_its_own_files_and_meta(tp_captures):
    step = tp_captures / "bad" / STEP
    assert sorted(p.name for p in step.glob("*_meta*.json")) == ["decode_b4_0_meta.json", "decode_b4_0_meta.rank1.json"]
    assert sorted(p.name for p in (step / "layers.1.fc1").iterdir()) == ["rank0.safetensors", "rank1.safetensors"]
    meta = read_step_meta(step)
    assert meta["ranks"] == [0, 1]
    fc1 = {r: meta["rank_tensors"][r]["layers.1.fc1"][0] for r in (0, 1)}
    for r, entry in fc1.items():
        assert entry["key"] == "output" and entry["placements"] == ["Shard(1)"]
        assert entry["mesh_shape"] == [2] and entry["mesh_dim_names"] == ["tp"]
        assert entry["global_shape"] == [4, 64] and entry["shape"] == [4, 32]
        assert entry["global_offset"] == [0, 32 * r] and entry["coordinate"] == [r]
    assert "placements" not in meta["rank_tensors"][1]["layers.1"][0]  # a plain (replicated) output


@pytest.mark.slow
def test_tp2_capture_matches_the_single_process_reference(tp_captures):
    report = graphpass.compare(
        tp_captures / "ref", [tp_captures / "host0", tp_captures / "host1"], rtol=1e-4, atol=1e-5
    )
    assert report.passed, str(report)
    fc1 = [r for r in report.rows if r.module == "layers.1.fc1" and r.key == "output"]
    assert [r.rank for r in fc1] == [0, 1] and "Shard(1)" in fc1[1].note  # compared shard by shard
    assert report.test_dir == os.pathsep.join(str(tp_captures / h) for h in ("host0", "host1"))


@pytest.mark.slow
def test_perturbed_shard_is_named_by_layer_and_rank(tp_captures, capsys):
    code = main(
        [
            "compare",
            str(tp_captures / "ref"),
            str(tp_captures / "bad"),
            "--rtol",
            "1e-4",
            "--atol",
            "1e-5",
            "--json",
            str(tp_captures / "bad_summary.json"),
        ]
    )
    out = capsys.readouterr().out
    print(out)  # the report, for the record
    assert code == 1
    report = graphpass.compare(tp_captures / "ref", tp_captures / "bad", rtol=1e-4, atol=1e-5)
    first = report.first_failure
    assert (first.module, first.rank, first.key) == ("layers.1.fc1", 1, "output")
    assert all(r.passed for r in report.rows if r.module in ("layers.0", "layers.0.fc1"))
    assert [r.passed for r in report.rows if r.module == "layers.1.fc1" and r.key == "output"] == [True, False]
    assert "first diverging module: layers.1.fc1 (step dp0/decode_b4_0, rank 1, key output)" in out


@pytest.mark.slow
def test_a_host_root_left_out_is_named_not_matched(tp_captures):
    """Issue 22, item 1: host1's root not passed. Nothing of rank 1 is on the test side, but the meta's
    ``tp_size`` (from the mesh) says the run had two ranks, and the fc1 shards cover half their
    global tensor. Before, compare checked rank 0 alone and said "all match"."""
    assert read_step_meta(tp_captures / "host0" / STEP)["tp_size"] == 2
    report = graphpass.compare(tp_captures / "ref", [tp_captures / "host0"], rtol=1e-4, atol=1e-5)
    assert not report.passed
    first = report.first_failure
    assert (first.step, first.module, first.rank, first.missing) == (STEP, "", 1, "test")
    assert first.note.startswith("rank 1 missing in test")
    cover = [r for r in report.rows if r.module == "layers.1.fc1" and not r.passed]
    assert [(r.rank, r.key, r.missing) for r in cover] == [(None, "output", "test")]
    assert "the test's pieces (ranks 0) hold 128 of the 256 elements of the global shape [4, 64]" in cover[0].note


@pytest.mark.slow
def test_a_perturbed_rank_whose_file_was_left_out_is_named(tp_captures, tmp_path, capsys):
    """Rank 1's shard of layers.1.fc1 perturbed, and its rank-1 file of that module left out: before,
    compare named ``layers.1 (rank 0)`` (the row-parallel output that sums both ranks)."""
    import shutil

    shutil.copytree(tp_captures / "bad", tmp_path / "bad")
    (tmp_path / "bad" / STEP / "layers.1.fc1" / "rank1.safetensors").unlink()
    report = graphpass.compare(tp_captures / "ref", tmp_path / "bad", rtol=1e-4, atol=1e-5)
    first = report.first_failure
    assert (first.module, first.rank, first.key, first.missing) == ("layers.1.fc1", 1, None, "test")
    assert first.note == "rank file missing in test"
    assert main(["compare", str(tp_captures / "ref"), str(tmp_path / "bad"), "--rtol", "1e-4", "--atol", "1e-5"]) == 1
    assert (
        "first diverging module: layers.1.fc1 (step dp0/decode_b4_0, rank 1): rank file missing in test"
        in capsys.readouterr().out
    )


@pytest.mark.slow
@pytest.mark.parametrize("then", DELEGATES)
def test_dtensor_outputs_are_captured_under_aot_delegates(tp_run, then):
    """Under aot_eager and inductor the DTensor outputs (fc1, ``Shard(1)``) are captured from the
    delegate's own graph: one graph, no graph break, and each rank's values and meta (placements,
    mesh shape, global shape and offset) are those ``then="eager"`` wrote."""
    from dist_helpers import ok

    root, results = tp_run
    for _rank, res in enumerate(ok(results, "delegates")):
        assert res[then]["graphs"] == 1 and res[then]["breaks"] == 0, res[then]
        assert res[then]["captured"] == res["eager"]["captured"]
        assert {"layers.0.fc1", "layers.1.fc1", "layers.2.fc1"} <= set(res[then]["captured"])
    ref, test = root / "delegates" / "eager", root / "delegates" / then
    report = graphpass.compare(ref, test, rtol=1e-5, atol=1e-6)
    assert report.passed, str(report)
    fc1 = [(r.rank, r.status) for r in report.rows if r.module == "layers.1.fc1" and r.key == "output"]
    assert fc1 == [(0, "pass"), (1, "pass")]  # compared rank against rank: the same layout
    assert len(report.rows) == 2 * 7  # every module (3 blocks, 3 fc1, head) on both ranks
    want, got = read_step_meta(ref / STEP), read_step_meta(test / STEP)
    assert got["ranks"] == [0, 1] and got["rank_tensors"] == want["rank_tensors"]
    for r in (0, 1):
        entry = got["rank_tensors"][r]["layers.1.fc1"][0]
        assert entry["placements"] == ["Shard(1)"] and entry["mesh_shape"] == [2]
        assert entry["global_shape"] == [4, 64] and entry["shape"] == [4, 32] and entry["global_offset"] == [0, 32 * r]


@pytest.mark.slow
def test_the_same_rank_file_in_two_roots_is_refused(tp_captures):
    from graphpass.comparing import CompareError

    with pytest.raises(CompareError, match="in both"):
        graphpass.compare(tp_captures / "ref", [tp_captures / "bad", tp_captures / "bad"])


# ------------------------------------------------------------------ in-process: hand-made files


def _write(root: Path, rank: int, key_values: dict, layouts: dict | None = None, module: str = "m") -> None:
    step = root / "dp0" / "prefill_s4_0"
    (step / module).mkdir(parents=True, exist_ok=True)
    save_file(key_values, str(step / module / f"rank{rank}.safetensors"))
    entries = [
        dict({"key": k, "dtype": "float32", "shape": list(v.shape)}, **(layouts or {}).get(k, {}))
        for k, v in key_values.items()
    ]
    name = "prefill_s4_0_meta.json" if rank == 0 else f"prefill_s4_0_meta.rank{rank}.json"
    (step / name).write_text(json.dumps({"modules": [module], "tensors": {module: entries}, "tp_rank": rank}))


def _shard(rank, offset):
    return {"output": {"placements": ["Shard(0)"], "mesh_shape": [2], "global_shape": [4, 3], "global_offset": offset}}


def test_shards_are_assembled_and_a_bad_shard_names_its_rank(tmp_path):
    whole = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    _write(tmp_path / "ref", 0, {"output": whole})
    for name, bump in (("good", 0.0), ("bad", 1.0)):
        _write(tmp_path / name, 0, {"output": whole[:2].clone()}, _shard(0, [0, 0]))
        _write(tmp_path / name, 1, {"output": whole[2:] + bump}, _shard(1, [2, 0]))
    assert graphpass.compare(tmp_path / "ref", tmp_path / "good").passed
    report = graphpass.compare(tmp_path / "ref", tmp_path / "bad")
    assert [(r.rank, r.status) for r in report.rows] == [(0, "pass"), (1, "FAIL")]
    assert report.first_failure.max_abs == 1.0 and "[Shard(0)] on mesh [2] at [2, 0]" in report.first_failure.note
    # and the other way round: a sharded reference is assembled for a whole test tensor
    back = graphpass.compare(tmp_path / "good", tmp_path / "ref")
    assert back.passed and "assembled from ranks [0, 1]" in back.rows[0].note


def test_replicated_copy_that_disagrees_names_its_rank(tmp_path):
    t = torch.ones(2, 2)
    _write(tmp_path / "ref", 0, {"output": t})
    rep = {
        "output": {"placements": ["Replicate()"], "mesh_shape": [2], "global_shape": [2, 2], "global_offset": [0, 0]}
    }
    _write(tmp_path / "test", 0, {"output": t}, rep)
    _write(tmp_path / "test", 1, {"output": t + 0.5}, rep)
    report = graphpass.compare(tmp_path / "ref", tmp_path / "test")
    bad = [r for r in report.rows if not r.passed]
    assert bad and all(r.rank == 1 for r in bad)
    assert any("Replicate() copy differs from rank 0's" in r.note for r in bad)


def test_a_partial_placement_is_a_row_not_a_crash(tmp_path):
    _write(
        tmp_path / "ref",
        0,
        {"output": torch.ones(2)},
        {"output": {"placements": ["Partial(sum)"], "global_shape": [2], "global_offset": [0]}},
    )
    _write(tmp_path / "test", 0, {"output": torch.ones(2)})
    _write(tmp_path / "test", 1, {"output": torch.ones(2)})
    report = graphpass.compare(tmp_path / "ref", tmp_path / "test")
    assert not report.passed and "Partial() placement cannot be assembled" in report.first_failure.note


class _Mesh:
    """What resolve_ranks reads of a DeviceMesh."""

    def __init__(self, names, coords):
        self.mesh_dim_names, self._coords, self.ndim = names, coords, len(coords)

    def get_local_rank(self, dim):
        return self._coords[self.mesh_dim_names.index(dim) if isinstance(dim, str) else dim]


def test_ranks_from_a_mesh_by_dimension_names_or_explicit():
    model = torch.nn.Linear(2, 2)
    assert resolve_ranks(model, "auto", "auto", _Mesh(("dp", "tp"), (1, 3))) == (1, 3)
    assert resolve_ranks(model, "auto", "auto", _Mesh(("replica", "model"), (2, 1)), "replica", "model") == (2, 1)
    assert resolve_ranks(model, "auto", "auto", _Mesh(("tp",), (1,))) == (0, 1)
    assert resolve_ranks(model, "auto", "auto", _Mesh(("dp",), (1,))) == (1, 0)
    assert resolve_ranks(model, 5, "auto", _Mesh(("dp", "tp"), (1, 3))) == (5, 3)  # explicit wins
    assert resolve_ranks(model, "auto", "auto") == (0, 0)  # no mesh, no process group
