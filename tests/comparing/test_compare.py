"""graphpass.compare and ``graphpass compare``: capture directories built by hand, compared."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import graphpass
from graphpass.cli import main
from graphpass.comparing import CompareError, CompareReport, compare
from graphpass.errors import GraphpassError

Step = dict[str, dict[int, dict[str, torch.Tensor]]]  # module -> rank -> key -> tensor


def write_step(
    root: Path,
    step: str,
    modules: Step,
    *,
    dp: int = 0,
    order: list[str] | None = None,
    subdir: str = "",
    meta: bool = True,
    **fields,
) -> Path:
    """Write one step the way CaptureWriter lays it out; ``order`` is the meta's module order,
    ``fields`` more meta fields (``step_index=3``)."""
    step_dir = root / subdir / f"dp{dp}" / step if subdir else root / f"dp{dp}" / step
    step_dir.mkdir(parents=True, exist_ok=True)
    for module, ranks in modules.items():
        (step_dir / module).mkdir(exist_ok=True)
        for rank, tensors in ranks.items():
            save_file(
                {k: v.contiguous() for k, v in tensors.items()}, str(step_dir / module / f"rank{rank}.safetensors")
            )
    if meta:
        first_rank = {m: next(iter(r.values()), {}) for m, r in modules.items()}
        doc = {
            "phase": step.split("_")[0],
            "step": step,
            "modules": order if order is not None else list(modules),
            "tensors": {
                m: [
                    {"key": k, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for k, t in ts.items()
                ]
                for m, ts in first_rank.items()
            },
            "req_ids": ["r0"],
            "positions": [0],
            "dp_rank": dp,
            "tp_rank": 0,
            "graphpass_version": graphpass.__version__,
            "torch_version": torch.__version__,
            **fields,
        }
        (step_dir / f"{step}_meta.json").write_text(json.dumps(doc))
    return step_dir


def model_step(seed: int = 0, n_layers: int = 4) -> Step:
    g = torch.Generator().manual_seed(seed)
    mods: Step = {f"layers.{i}": {0: {"0": torch.randn(2, 8, 16, generator=g)}} for i in range(n_layers)}
    mods["lm_head"] = {0: {"0": torch.randn(2, 8, 32, generator=g), "1": torch.randn(4, generator=g)}}
    return mods


def clone(step: Step) -> Step:
    return {m: {r: {k: v.clone() for k, v in ts.items()} for r, ts in ranks.items()} for m, ranks in step.items()}


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    ref, test = tmp_path / "ref", tmp_path / "test"
    ref.mkdir()
    test.mkdir()
    return ref, test


def only(report: CompareReport, module: str) -> list:
    return [r for r in report.rows if r.module == module]


def test_all_equal(dirs):
    ref, test = dirs
    step = model_step()
    write_step(ref, "prefill_s8_0", step)
    write_step(test, "prefill_s8_0", clone(step))
    report = compare(ref, test)
    assert report.passed and report.first_failure is None
    assert len(report.rows) == 6  # 4 layers + lm_head keys 0, 1
    assert [r.module for r in report.rows] == ["layers.0", "layers.1", "layers.2", "layers.3", "lm_head", "lm_head"]
    assert all(r.max_abs == 0.0 and r.rel_l2 == 0.0 and r.rel_linf == 0.0 for r in report.rows)
    assert str(report).splitlines()[-1] == "all 6 tensors match (rtol=0.001, atol=1e-05)"
    assert report.rows[0].step == "dp0/prefill_s8_0"
    assert graphpass.compare is compare and graphpass.CompareReport is CompareReport


def test_perturbed_middle_module_is_first_failure(dirs):
    ref, test = dirs
    step = model_step()
    bad = clone(step)
    bad["layers.2"][0]["0"][1, 3, 5] += 0.0125
    bad["layers.3"][0]["0"] += 1.0  # downstream divergence: not the first failure
    write_step(ref, "prefill_s8_0", step)
    write_step(test, "prefill_s8_0", bad)
    report = compare(ref, test)
    assert not report.passed
    first = report.first_failure
    assert (first.module, first.rank, first.key, first.status) == ("layers.2", 0, "0", "FAIL")
    assert first.max_abs == pytest.approx(0.0125, rel=1e-5)
    r = step["layers.2"][0]["0"].double()
    assert first.rel_l2 == pytest.approx(0.0125 / r.norm().item(), rel=1e-4)
    assert first.rel_linf == pytest.approx(0.0125 / r.abs().max().item(), rel=1e-4)
    assert [row.status for row in report.rows] == ["pass", "pass", "FAIL", "FAIL", "pass", "pass"]
    assert str(report).splitlines()[-1] == (
        "first diverging module: layers.2 (step dp0/prefill_s8_0, rank 0, key 0): max abs 1.25e-02"
    )
    assert "2 of 6 rows FAIL (rtol=0.001, atol=1e-05)" in str(report)


def test_tolerance_decides(dirs):
    ref, test = dirs
    t = torch.ones(10)
    write_step(ref, "prefill_s8_0", {"m": {0: {"0": t}}})
    write_step(test, "prefill_s8_0", {"m": {0: {"0": t + 5e-4}}})
    assert compare(ref, test).passed  # 5e-4 <= 1e-5 + 1e-3 * 1
    report = compare(ref, test, rtol=1e-4)
    assert not report.passed and report.rows[0].max_abs == pytest.approx(5e-4, rel=1e-3)


def test_missing_module_in_test_and_in_ref(dirs):
    ref, test = dirs
    step = model_step()
    other = clone(step)
    del other["layers.1"]
    other["extra"] = {0: {"0": torch.zeros(3)}}
    write_step(ref, "prefill_s8_0", step)
    write_step(test, "prefill_s8_0", other, order=["layers.0", "layers.2", "extra", "layers.3", "lm_head"])
    report = compare(ref, test)
    (missing,) = only(report, "layers.1")
    assert (missing.status, missing.note, missing.rank, missing.max_abs) == ("FAIL", "missing in test", None, None)
    (extra,) = only(report, "extra")
    assert (extra.status, extra.note) == ("FAIL", "missing in ref")
    assert report.rows[-1] is extra  # modules only in test come after the ref order
    assert report.first_failure is missing
    assert "first diverging module: layers.1 (step dp0/prefill_s8_0): missing in test" in str(report)


def test_missing_rank_and_key(dirs):
    ref, test = dirs
    write_step(ref, "decode_b2_1", {"m": {0: {"0": torch.ones(2), "1": torch.ones(2)}, 1: {"0": torch.ones(2)}}})
    write_step(test, "decode_b2_1", {"m": {0: {"0": torch.ones(2)}}})
    rows = compare(ref, test).rows
    assert [(r.rank, r.key, r.status, r.note) for r in rows] == [
        (0, "0", "pass", ""),
        (0, "1", "FAIL", "key missing in test"),
        (1, None, "FAIL", "rank file missing in test"),
    ]


def test_shape_mismatch(dirs):
    ref, test = dirs
    write_step(ref, "prefill_s8_0", {"m": {0: {"0": torch.zeros(2, 8)}}})
    write_step(test, "prefill_s8_0", {"m": {0: {"0": torch.zeros(2, 9)}}})
    (row,) = compare(ref, test).rows
    assert (row.status, row.note) == ("FAIL", "shape mismatch [2, 8] vs [2, 9]")
    assert row.max_abs is None and row.rel_l2 is None and row.rel_linf is None


def test_dtype_difference_within_tolerance_passes_with_note(dirs):
    ref, test = dirs
    t = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    write_step(ref, "prefill_s8_0", {"m": {0: {"0": t}}})
    write_step(test, "prefill_s8_0", {"m": {0: {"0": t.to(torch.bfloat16)}}})
    (row,) = compare(ref, test, rtol=1e-2, atol=1e-2).rows
    assert (row.status, row.note) == ("pass", "dtype float32 vs bfloat16")
    assert row.max_abs == pytest.approx((t.to(torch.bfloat16).double() - t.double()).abs().max().item())
    assert 0 < row.max_abs < 0.02
    (strict,) = compare(ref, test).rows  # default tolerances: bf16 rounding is too much
    assert strict.status == "FAIL" and strict.note == "dtype float32 vs bfloat16"


def test_corrupt_file(dirs):
    ref, test = dirs
    write_step(ref, "prefill_s8_0", {"a": {0: {"0": torch.ones(2)}}, "b": {0: {"0": torch.ones(2)}}})
    write_step(test, "prefill_s8_0", {"a": {0: {"0": torch.ones(2)}}, "b": {0: {"0": torch.ones(2)}}})
    (test / "dp0" / "prefill_s8_0" / "a" / "rank0.safetensors").write_bytes(b"\x07\x00not a safetensors file")
    report = compare(ref, test)
    bad, good = report.rows
    assert (bad.module, bad.status, bad.key) == ("a", "FAIL", None)
    assert bad.note.startswith("cannot read test file: ")
    assert (good.module, good.status) == ("b", "pass")


def test_order_from_meta_not_alphabetical(dirs):
    ref, test = dirs
    mods = {
        name: {0: {"0": torch.full((3,), float(i))}} for i, name in enumerate(["layers.10", "layers.2", "attn_scores"])
    }
    write_step(ref, "prefill_s8_0", mods, order=["layers.10", "layers.2", "attn_scores"])
    bad = clone(mods)
    bad["layers.2"][0]["0"] += 1
    bad["layers.10"][0]["0"] += 1
    write_step(test, "prefill_s8_0", bad, order=["layers.10", "layers.2", "attn_scores"])
    report = compare(ref, test)
    assert [r.module for r in report.rows] == ["layers.10", "layers.2", "attn_scores"]
    assert report.first_failure.module == "layers.10"


def test_missing_meta_falls_back_to_sorted_dirs(dirs):
    ref, test = dirs
    mods = {name: {0: {"0": torch.ones(1)}} for name in ["layers.10", "layers.2", "embed"]}
    write_step(ref, "prefill_s8_0", mods, meta=False)
    write_step(test, "prefill_s8_0", clone(mods), meta=False)
    report = compare(ref, test)
    assert [r.module for r in report.rows] == ["embed", "layers.2", "layers.10"]
    assert report.passed
    assert any("no ref meta file" in n for n in report.notes)


def test_multiple_steps_in_execution_order(dirs):
    ref, test = dirs
    for k, name in enumerate(["prefill_s8_0", "decode_b2_1", "decode_b2_2", "decode_b2_10"]):
        write_step(ref, name, {"m": {0: {"0": torch.full((2,), float(k))}}})
        write_step(test, name, {"m": {0: {"0": torch.full((2,), float(k) + (0.5 if k >= 2 else 0))}}})
    write_step(ref, "prefill_s8_0", {"m": {0: {"0": torch.ones(1)}}}, dp=1)
    report = compare(ref, test)
    assert [r.step for r in report.rows] == [
        "dp0/prefill_s8_0",
        "dp0/decode_b2_1",
        "dp0/decode_b2_2",
        "dp0/decode_b2_10",
        "dp1/prefill_s8_0",
    ]
    assert [r.status for r in report.rows] == ["pass", "pass", "FAIL", "FAIL", "FAIL"]
    assert report.first_failure.step == "dp0/decode_b2_2" and report.first_failure.max_abs == 0.5
    assert (report.rows[-1].module, report.rows[-1].note) == ("", "step missing in test")


def test_dp_directory_as_root(dirs):
    ref, test = dirs
    write_step(ref, "prefill_s8_0", {"m": {0: {"0": torch.ones(2)}}}, dp=0)
    write_step(test, "prefill_s8_0", {"m": {0: {"0": torch.ones(2)}}}, dp=3)
    (row,) = compare(ref / "dp0", test / "dp3").rows
    assert (row.step, row.status) == ("prefill_s8_0", "pass")


def test_subdirectory_and_step_only_in_test(dirs):
    ref, test = dirs
    write_step(ref, "prefill_s8_0", {"m": {0: {"0": torch.ones(2)}}}, subdir="run1")
    write_step(test, "prefill_s8_0", {"m": {0: {"0": torch.ones(2)}}}, subdir="run1")
    write_step(test, "decode_b1_1", {"m": {0: {"0": torch.ones(2)}}}, subdir="run1")
    rows = compare(ref, test).rows
    assert [(r.step, r.status, r.note) for r in rows] == [
        ("run1/dp0/prefill_s8_0", "pass", ""),
        ("run1/dp0/decode_b1_1", "FAIL", "step missing in ref"),
    ]


def test_nan_handling(dirs):
    ref, test = dirs
    a = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    write_step(ref, "prefill_s8_0", {"same": {0: {"0": a}}, "one_sided": {0: {"0": a}}})
    write_step(
        test,
        "prefill_s8_0",
        {
            "same": {0: {"0": a.clone()}},
            "one_sided": {0: {"0": torch.tensor([float("nan"), float("nan"), 3.0, float("inf")])}},
        },
    )
    report = compare(ref, test)
    same, one = report.rows
    assert (same.status, same.max_abs, same.rel_l2, same.rel_linf) == ("pass", 0.0, 0.0, 0.0)
    assert one.status == "FAIL" and math.isnan(one.max_abs) and "NaN in only one" in one.note
    data = report.to_dict()
    json.dumps(data, allow_nan=False)  # strict JSON: non-finite floats become strings
    assert data["rows"][1]["max_abs"] == "nan"


def test_empty_dirs(dirs):
    ref, test = dirs
    report = compare(ref, test)
    assert report.rows == [] and report.first_failure is None and not report.passed
    assert str(report).startswith("nothing compared: no captured steps found in")


def test_bad_arguments(tmp_path, dirs):
    ref, test = dirs
    with pytest.raises(CompareError, match="does not exist"):
        compare(tmp_path / "nope", test)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CompareError, match="not a directory"):
        compare(tmp_path / "file", test)
    with pytest.raises(CompareError, match="rtol must be >= 0"):
        compare(ref, test, rtol=-1e-3)
    with pytest.raises(CompareError, match="atol"):
        compare(ref, test, atol=float("nan"))
    assert issubclass(CompareError, GraphpassError)


def test_write_json_atomic(dirs, tmp_path):
    ref, test = dirs
    write_step(ref, "prefill_s8_0", {"m": {0: {"0": torch.ones(2)}}})
    write_step(test, "prefill_s8_0", {"m": {0: {"0": torch.ones(2) * 2}}})
    out = compare(ref, test).write_json(tmp_path / "out" / "s.json")
    data = json.loads(out.read_text())
    assert (
        data["counts"]
        == {"total": 1, "pass": 0, "fail": 1, "missing_in_test": 0, "missing_in_ref": 0, "missing_in_both": 0}
        and data["passed"] is False
    )
    assert data["first_failure"]["module"] == "m" and data["first_failure"]["max_abs"] == 1.0
    assert [p.name for p in out.parent.iterdir()] == ["s.json"]  # no temp file left behind


def test_cli_all_pass(dirs, capsys):
    ref, test = dirs
    step = model_step()
    write_step(ref, "prefill_s8_0", step)
    write_step(test, "prefill_s8_0", clone(step))
    assert main(["compare", str(ref), str(test)]) == 0
    out = capsys.readouterr().out
    assert "all 6 tensors match (rtol=0.001, atol=1e-05)" in out
    assert f"summary written to {test / 'compare_summary.json'}" in out
    assert json.loads((test / "compare_summary.json").read_text())["passed"] is True


def test_cli_failure_writes_json(dirs, tmp_path, capsys):
    ref, test = dirs
    step = model_step()
    bad = clone(step)
    bad["layers.1"][0]["0"][0, 0, 0] -= 0.25
    write_step(ref, "prefill_s8_0", step)
    write_step(test, "prefill_s8_0", bad)
    summary = tmp_path / "summary.json"
    assert main(["compare", str(ref), str(test), "--json", str(summary), "--atol", "1e-4"]) == 1
    out = capsys.readouterr().out
    assert "first diverging module: layers.1" in out and "layers.2" in out  # the table lists every row
    data = json.loads(summary.read_text())
    assert data["atol"] == 1e-4 and data["first_failure"]["module"] == "layers.1"
    assert data["first_failure"]["max_abs"] == pytest.approx(0.25)
    assert not (test / "compare_summary.json").exists()


def test_cli_bad_argument_exits_2(tmp_path, capsys):
    assert main(["compare", str(tmp_path / "missing"), str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- issue 22: integers exact, execution order, completeness --------------------------------------


def _one(dirs, ref_value: torch.Tensor, test_value: torch.Tensor, **tol):
    ref, test = dirs
    write_step(ref, "prefill_s8_0", {"ids": {0: {"output": ref_value}}})
    write_step(test, "prefill_s8_0", {"ids": {0: {"output": test_value}}})
    (row,) = compare(ref, test, **tol).rows
    return row


def test_token_ids_are_compared_exactly(dirs):
    """32000 vs 32031 is within rtol=1e-3 as floats: as token ids they differ."""
    row = _one(dirs, torch.tensor([[1, 32000, 7]]), torch.tensor([[1, 32031, 7]]))
    assert (row.status, row.max_abs) == ("FAIL", 31.0)
    assert row.note == "compared exactly: 1 of 3 elements differ"


def test_int64_above_2_to_53_is_not_rounded_through_float64(dirs):
    big = 2**53
    row = _one(dirs, torch.tensor([big, -big - 7, 2**63 - 1]), torch.tensor([big + 1, -big - 7, 2**63 - 1]))
    assert (row.status, row.max_abs, row.note) == ("FAIL", 1.0, "compared exactly: 1 of 3 elements differ")
    extremes = torch.tensor([-(2**63), 2**63 - 1])
    row = _one(dirs, extremes, extremes.flip(0))  # |difference| 2**64 - 1: no int64 overflow in the numbers
    assert row.status == "FAIL" and row.max_abs == pytest.approx(2.0**64)


def test_equal_integers_bools_and_uint64_pass_and_any_difference_fails(dirs):
    mask = torch.tensor([True, False, True])
    assert _one(dirs, mask, mask.clone()).status == "pass"
    row = _one(dirs, mask, ~mask, atol=10.0, rtol=10.0)  # tolerances do not apply
    assert (row.status, row.note) == ("FAIL", "compared exactly: 3 of 3 elements differ")
    u = torch.tensor([2**64 - 1, 2**63, 5], dtype=torch.uint64)
    assert _one(dirs, u, u.clone()).status == "pass"
    row = _one(dirs, u, torch.tensor([2**64 - 2, 2**63, 5], dtype=torch.uint64))
    assert (row.status, row.max_abs) == ("FAIL", 1.0)


def test_integer_dtype_mismatch_is_reported(dirs):
    ids = torch.tensor([3, 4, 2**40])
    row = _one(dirs, ids, ids.to(torch.int32).to(torch.int64))  # same dtype, different values (wrapped)
    assert row.status == "FAIL"
    row = _one(dirs, torch.tensor([3, 4], dtype=torch.int64), torch.tensor([3, 4], dtype=torch.int32))
    assert (row.status, row.note) == ("pass", "dtype int64 vs int32")  # equal values, the dtype noted
    row = _one(dirs, torch.tensor([3, 4]), torch.tensor([3.0, 4.0]))
    assert row.status == "FAIL" and row.max_abs is None
    assert row.note.startswith("dtype int64 vs float32; integer vs floating-point: integer and bool tensors")
    row = _one(dirs, torch.tensor([1, 0]), torch.tensor([True, False]))
    assert row.status == "FAIL" and "integer vs bool" in row.note


def test_execution_order_comes_from_the_step_index(dirs):
    """Two generate() calls: prefill_s8_0, decode_b1_0, decode_b1_1, prefill_s8_1, decode_b1_2. The
    counter k alone would put decode_b1_0 (or prefill_s8_1) before steps that ran earlier."""
    ref, test = dirs
    order = ["prefill_s8_0", "decode_b1_0", "decode_b1_1", "prefill_s8_1", "decode_b1_2"]
    for index, name in enumerate(order):
        bump = 1.0 if index >= 3 else 0.0  # the second generate() diverges from its prefill on
        write_step(ref, name, {"m": {0: {"0": torch.zeros(2)}}}, step_index=index)
        write_step(test, name, {"m": {0: {"0": torch.zeros(2) + bump}}}, step_index=index)
    report = compare(ref, test)
    assert [r.step for r in report.rows] == [f"dp0/{name}" for name in order]
    assert report.first_failure.step == "dp0/prefill_s8_1"
    assert not report.notes


def test_steps_without_an_index_put_a_prefill_before_its_decodes(dirs):
    ref, test = dirs
    for name in ("decode_b1_1", "decode_b1_0", "prefill_s8_0"):
        write_step(ref, name, {"m": {0: {"0": torch.zeros(2)}}})
        write_step(test, name, {"m": {0: {"0": torch.ones(2)}}})  # every step diverges
    report = compare(ref, test)
    assert [r.step for r in report.rows] == ["dp0/prefill_s8_0", "dp0/decode_b1_0", "dp0/decode_b1_1"]
    assert report.first_failure.step == "dp0/prefill_s8_0"
    assert any("no step_index" in n and "a prefill before a decode of the same k" in n for n in report.notes)


def test_steps_the_runs_ran_in_another_order_are_noted(dirs):
    ref, test = dirs
    for name, (ri, ti) in {"prefill_s8_0": (0, 0), "decode_b1_0": (1, 2), "decode_b1_1": (2, 1)}.items():
        write_step(ref, name, {"m": {0: {"0": torch.zeros(2)}}}, step_index=ri)
        write_step(test, name, {"m": {0: {"0": torch.zeros(2)}}}, step_index=ti)
    report = compare(ref, test)
    assert [r.step for r in report.rows] == ["dp0/prefill_s8_0", "dp0/decode_b1_0", "dp0/decode_b1_1"]
    assert report.passed
    (note,) = report.notes
    assert "another order" in note and "dp0/decode_b1_0 (ref 1, test 2)" in note


def test_a_key_the_meta_lists_but_no_file_holds_is_missing(dirs):
    ref, test = dirs
    for root in dirs:
        step = write_step(root, "prefill_s8_0", {"m": {0: {"[0]": torch.ones(2)}}})
        doc = json.loads((step / "prefill_s8_0_meta.json").read_text())
        doc["tensors"]["m"].append({"key": "[1]", "dtype": "float32", "shape": [2]})  # lost from both files
        (step / "prefill_s8_0_meta.json").write_text(json.dumps(doc))
    report = compare(ref, test)
    assert [(r.key, r.status, r.missing, r.note) for r in report.rows] == [
        ("[0]", "pass", None, ""),
        ("[1]", "FAIL", "both", "key missing in ref and test (listed in its meta file)"),
    ]


def test_cli_names_what_is_missing_and_exits_1(dirs, tmp_path, capsys):
    ref, test = dirs
    step = model_step()
    write_step(ref, "prefill_s8_0", step, step_index=0)
    write_step(ref, "decode_b2_0", step, step_index=1)
    lost = clone(step)
    del lost["layers.2"]
    write_step(test, "prefill_s8_0", lost, step_index=0, order=["layers.0", "layers.1", "layers.3", "lm_head"])
    summary = tmp_path / "s.json"
    assert main(["compare", str(ref), str(test), "--json", str(summary)]) == 1
    out = capsys.readouterr().out
    assert "2 of 7 rows FAIL (rtol=0.001, atol=1e-05; 2 missing in test)" in out
    assert "first diverging module: layers.2 (step dp0/prefill_s8_0): missing in test" in out
    data = json.loads(summary.read_text())
    assert data["passed"] is False and data["counts"]["missing_in_test"] == 2
    assert [(r["step"], r["module"], r["missing"]) for r in data["rows"] if r["missing"]] == [
        ("dp0/prefill_s8_0", "layers.2", "test"),
        ("dp0/decode_b2_0", "", "test"),
    ]


def test_a_failing_submodule_is_the_first_divergence_before_its_failing_parent():
    """A reference's meta may list a decoder layer before its own projections (issue 36, item 3): a module returns
    after its submodules, so the failing submodule of the same step and rank is named, not the layer; a passing
    submodule, another step's or another rank's, or a sibling module sharing a prefix, is not."""
    from graphpass.comparing.compare_report import CompareRow

    def row(module, status, step="dp0/prefill_s8_0", rank=0):
        return CompareRow(step=step, module=module, rank=rank, key="output", status=status)

    def first(*rows):
        return CompareReport("ref", "test", 1e-3, 1e-5, rows=list(rows)).first_failure.module

    layer, gate = "model.layers.0", "model.layers.0.mlp.gate_proj"
    assert (
        first(row(layer, "FAIL"), row("model.layers.0.mlp", "FAIL"), row(gate, "FAIL"), row("model.layers.1", "FAIL"))
        == gate
    )
    assert first(row(layer, "FAIL"), row(gate, "pass"), row("model.layers.1", "FAIL")) == layer
    assert first(row(layer, "FAIL"), row(gate, "FAIL", step="dp0/decode_b2_1")) == layer
    assert first(row(layer, "FAIL"), row(gate, "FAIL", rank=1)) == layer
    assert first(row("model.layers.1", "FAIL"), row("model.layers.10.mlp", "FAIL")) == "model.layers.1"


def test_two_runs_captured_into_one_folder_are_refused_naming_both(tmp_path):
    """Issue 36, items 1 and 2: every step's meta names its run; a folder holding the steps of two runs (step
    names that do not collide) is refused by compare, which names both runs, instead of comparing stale steps."""
    import torch.nn as nn

    def capture_run(folder, length, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
        cap = graphpass.ModelCapture(compiled, modules=["0", "2"], capture_dir=folder)
        cap.enable()
        with torch.no_grad(), cap.step(is_prefill=True, positions=torch.arange(length)):
            compiled(torch.randn(length, 4))
        return cap.run

    torch._dynamo.reset()
    ref_run = capture_run(tmp_path / "ref", 8, 0)
    first = capture_run(tmp_path / "test", 8, 0)
    second = capture_run(tmp_path / "test", 16, 1)  # another run into the same folder: prefill_s16_0, no clash
    assert len({ref_run, first, second}) == 3
    metas = [json.loads(p.read_text()) for p in (tmp_path / "test").rglob("*_meta.json")]
    assert sorted(m["run"] for m in metas) == sorted([first, second])
    with pytest.raises(CompareError, match="holds the steps of 2 runs") as info:
        compare(tmp_path / "ref", tmp_path / "test")
    assert first in str(info.value) and second in str(info.value)
    assert main(["compare", str(tmp_path / "ref"), str(tmp_path / "test")]) != 0
    assert compare(tmp_path / "ref", tmp_path / "ref").passed  # one run: compared as before
