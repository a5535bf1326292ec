"""The on-disk format's version (graphpass.capture_format): every meta written now carries it, a capture
written before it existed (no field) is read as version 1 and still compares, and compare refuses a version
it does not read with a ``CompareError`` naming the file, the version found and the versions it reads."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.capture_format import (
    FORMAT_VERSION,
    FORMAT_VERSION_KEY,
    READ_VERSIONS,
    EngineStepMeta,
    FormatVersionError,
    format_version,
)
from graphpass.cli import main
from graphpass.comparing import CompareError, compare
from graphpass.errors import GraphpassError
from test_compare import clone, model_step, write_step


def test_a_capture_written_now_carries_the_format_version(tmp_path):
    """Waited and staged steps (the writer process plans the latter) alike, every rank's meta file."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    cap = graphpass.ModelCapture(compiled, modules=["0", "2"], capture_dir=tmp_path / "run")
    cap.enable()
    with torch.no_grad():
        with cap.step(is_prefill=True, positions=torch.arange(8)):
            compiled(torch.randn(8, 4))
        with cap.step(is_prefill=False, req_ids=["a"], wait=False):
            compiled(torch.randn(1, 4))
    cap.flush()
    metas = sorted((tmp_path / "run").rglob("*_meta*.json"))
    assert len(metas) == 2
    for path in metas:
        assert json.loads(path.read_text())[FORMAT_VERSION_KEY] == FORMAT_VERSION
    assert compare(tmp_path / "run", tmp_path / "run").passed
    with pytest.raises(graphpass.ConfigError, match="cannot replace"):  # extra_meta cannot forge it
        with cap.step(is_prefill=True, positions=torch.arange(8), extra_meta={FORMAT_VERSION_KEY: 9}):
            compiled(torch.randn(8, 4))


def test_a_capture_without_the_field_is_read_as_version_1_and_still_compares(tmp_path):
    ref, test = tmp_path / "ref", tmp_path / "test"
    step = model_step()
    write_step(ref, "prefill_s8_0", step)  # a meta as graphpass wrote it before the field: no format_version
    write_step(test, "prefill_s8_0", clone(step), **{FORMAT_VERSION_KEY: FORMAT_VERSION})
    assert FORMAT_VERSION_KEY not in json.loads((ref / "dp0" / "prefill_s8_0" / "prefill_s8_0_meta.json").read_text())
    assert format_version({}, "old_meta.json") == 1
    report = compare(ref, test)
    assert report.passed, str(report)


@pytest.mark.parametrize("found", [FORMAT_VERSION + 1, "2", None, True, -1])
def test_an_unknown_format_version_is_refused_naming_the_file_and_the_versions_read(tmp_path, found):
    ref, test = tmp_path / "ref", tmp_path / "test"
    step = model_step()
    write_step(ref, "prefill_s8_0", step)
    write_step(test, "prefill_s8_0", clone(step), **{FORMAT_VERSION_KEY: found})
    meta = test / "dp0" / "prefill_s8_0" / "prefill_s8_0_meta.json"
    with pytest.raises(CompareError) as info:
        compare(ref, test)
    text = str(info.value)
    assert isinstance(info.value, GraphpassError)
    assert str(meta) in text, text
    assert f"capture format version {found!r}" in text, text
    assert re.search(r"reads format version\(s\) " + ", ".join(map(str, READ_VERSIONS)), text), text
    assert main(["compare", str(ref), str(test)]) == 2  # a GraphpassError: the CLI's usage exit, no traceback


def test_a_newer_rank_meta_file_is_refused_too(tmp_path):
    """Each tensor-parallel rank writes its own meta file: each is checked, not only rank 0's."""
    ref, test = tmp_path / "ref", tmp_path / "test"
    step = model_step()
    write_step(ref, "prefill_s8_0", step)
    step_dir = write_step(test, "prefill_s8_0", clone(step))
    doc = json.loads((step_dir / "prefill_s8_0_meta.json").read_text())
    (step_dir / "prefill_s8_0_meta.rank1.json").write_text(json.dumps({**doc, "tp_rank": 1, FORMAT_VERSION_KEY: 7}))
    with pytest.raises(CompareError, match=re.escape("prefill_s8_0_meta.rank1.json: capture format version 7")):
        compare(ref, test)


def test_format_version_raises_its_own_error_outside_compare():
    with pytest.raises(FormatVersionError, match="x.json: capture format version 2"):
        format_version({FORMAT_VERSION_KEY: 2}, "x.json")
    assert format_version({FORMAT_VERSION_KEY: FORMAT_VERSION}, "x.json") == FORMAT_VERSION


def test_engine_step_meta_round_trips_and_defaults_to_vllm():
    meta = EngineStepMeta("vllm", [0, 0, -1], model={"model_type": "llama"}, input_ids=[5, 6, 0], parents=[None])
    doc = meta.to_dict()
    assert doc == {
        "engine": "vllm",
        "token_request": [0, 0, -1],
        "model": {"model_type": "llama"},
        "input_ids": [5, 6, 0],
        "parents": [None],
    }
    assert EngineStepMeta.from_dict(doc) == meta
    assert EngineStepMeta.from_dict({"token_request": [0]}).engine == "vllm"  # written before other engines


MOVED = (
    "compare_runs",
    "compare_report",
    "compare_tensors",
    "report_format",
    "completeness",
    "shards",
    "compare_engines",
    "engine_families",
    "plots",
)


@pytest.mark.parametrize("name", MOVED)
def test_the_old_compare_module_paths_warn_and_are_the_moved_modules(name):
    """Issue 37: compare moved from capturing/ to comparing/; each old module path works for a release."""
    import importlib
    import sys

    new = importlib.import_module(f"graphpass.comparing.{name}")
    sys.modules.pop(f"graphpass.capturing.{name}", None)
    with pytest.warns(DeprecationWarning, match=f"graphpass.capturing.{name} moved to graphpass.comparing.{name}"):
        old = importlib.import_module(f"graphpass.capturing.{name}")
    assert old is new


def test_the_old_compare_names_of_capturing_warn_and_are_the_moved_ones():
    import graphpass.capturing
    import graphpass.comparing

    for name in ("compare", "CompareReport", "CompareError"):
        with pytest.warns(DeprecationWarning, match=f"graphpass.capturing.{name} moved to graphpass.comparing"):
            assert getattr(graphpass.capturing, name) is getattr(graphpass.comparing, name)
    assert graphpass.compare is graphpass.comparing.compare
    assert graphpass.CompareReport is graphpass.comparing.CompareReport
    with pytest.raises(AttributeError):
        graphpass.capturing.no_such_name  # noqa: B018
