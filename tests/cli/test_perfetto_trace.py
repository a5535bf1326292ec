"""``graphpass.trace`` / ``graphpass trace``: the Chrome / Perfetto trace (a range per trap, load, eviction),
the overlap it shows, the timeline PNG and its errors (docs/trace.md)."""

from __future__ import annotations

import io
import json
import re
import struct
from pathlib import Path

import pytest
import torch

import graphpass
from graphpass.cli import main
from graphpass.models.corpus import MLPStack
from graphpass.tracing import TraceError
from helpers import no_matplotlib

DEPTH, DIM, ROWS = 3, 512, 256  # ~0.5 GFLOP per block: its compute outlasts loading its 4 MiB of weights
LABELS = [f"layers.{i}" for i in range(DEPTH)]
TRACE_KEYS = {
    "path",
    "plot",
    "calls",
    "call_ms",
    "traps",
    "loads",
    "evictions",
    "waits",
    "trap_ms",
    "load_ms",
    "hidden_load_ms",
    "hidden_fraction",
    "wait_ms",
}


def small_stack():
    """The CLI factory of these tests: ``test_perfetto_trace:small_stack``."""
    torch.manual_seed(0)
    model = MLPStack(dim=DIM, depth=DEPTH).eval()
    return model, (torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1)),)


def compiled_offloaded(prefetch: int = 1, storage: str = "cpu", disk_path=None):
    model, inputs = small_stack()
    model.requires_grad_(False)
    graphpass.offload(
        model, graphpass.OffloadConfig(device="cpu", storage=storage, prefetch_distance=prefetch, disk_path=disk_path)
    )
    return model, torch.compile(model, backend=graphpass.backend(then="aot_eager")), inputs


def ranges(doc: dict, cat: str) -> list[dict]:
    return sorted((e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == cat), key=lambda e: e["ts"])


def thread_names(doc: dict) -> dict:
    return {
        e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("ph") == "M" and e.get("name") == "thread_name"
    }


def check_ranges(doc: dict, calls: int) -> None:
    """One trap range per trap per call, one load per trap load on the worker's track, an eviction per trap."""
    traps, loads = ranges(doc, "graphpass.trap"), ranges(doc, "graphpass.load")
    evictions, waits = ranges(doc, "graphpass.evict"), ranges(doc, "graphpass.wait")
    for kind in (traps, loads, evictions, waits):
        assert sorted((e["args"]["call"], e["args"]["trap"]) for e in kind) == sorted(
            (c, label) for c in range(calls) for label in LABELS
        )
        assert all(e["dur"] >= 0 for e in kind)  # start <= end
    assert [e["name"] for e in traps[:DEPTH]] == [f"graphpass.trap/{label}" for label in LABELS]
    assert len(ranges(doc, "graphpass.call")) == calls
    names = thread_names(doc)
    compute = {e["tid"] for e in traps + evictions + waits}
    workers = {e["tid"] for e in loads}
    assert len(compute) == 1 and len(workers) == 1 and not compute & workers  # the worker has its own track
    assert names[workers.pop()].startswith("graphpass offload worker") and names[compute.pop()].startswith(
        "graphpass compute"
    )
    assert all(e["args"]["nbytes"] > 0 and e["args"]["issued_us"] <= e["ts"] + 1 for e in loads)
    assert any(e.get("cat") == "cpu_op" for e in doc["traceEvents"])  # the profiler's own events are kept


def by_call(events: list[dict], call: int) -> dict:
    return {e["args"]["trap"]: e for e in events if e["args"]["call"] == call}


def test_trace_writes_a_range_per_trap_load_and_eviction(tmp_path):
    _, compiled, inputs = compiled_offloaded(prefetch=1)
    with torch.no_grad():
        report = graphpass.trace(compiled, *inputs, path=tmp_path / "t" / "trace.json", calls=2)
    doc = json.loads((tmp_path / "t" / "trace.json").read_text())
    check_ranges(doc, calls=2)
    summary = report.to_dict()
    assert set(summary) == TRACE_KEYS
    assert (summary["calls"], summary["traps"], summary["loads"], summary["evictions"]) == (
        2,
        2 * DEPTH,
        2 * DEPTH,
        2 * DEPTH,
    )
    assert not any(str(e.get("name", "")).startswith("graphpass.trace/clock") for e in doc["traceEvents"])
    assert "ui.perfetto.dev" in str(report)
    # one clock: each merged trap range sits on the profiler's own range of that trap (its
    # record_function, opened by trap_enter on the compute thread), to well under a millisecond
    own = [
        e for e in doc["traceEvents"] if e.get("cat") == "user_annotation" and e["name"].startswith("graphpass.trap/")
    ]
    merged = ranges(doc, "graphpass.trap")
    assert len(own) == len(merged) == 2 * DEPTH
    for mine, theirs in zip(merged, sorted(own, key=lambda e: e["ts"])):
        assert mine["name"] == theirs["name"]
        assert (
            abs(mine["ts"] - theirs["ts"]) < 500 and abs(mine["ts"] + mine["dur"] - theirs["ts"] - theirs["dur"]) < 500
        )


def test_prefetch_one_starts_the_next_load_under_the_current_trap(tmp_path):
    _, compiled, inputs = compiled_offloaded(prefetch=1)
    with torch.no_grad():
        graphpass.trace(compiled, *inputs, path=tmp_path / "trace.json", calls=2)
    doc = json.loads((tmp_path / "trace.json").read_text())
    for call in range(2):
        traps, loads = by_call(ranges(doc, "graphpass.trap"), call), by_call(ranges(doc, "graphpass.load"), call)
        for k in range(DEPTH - 1):
            trap, nxt = traps[LABELS[k]], loads[LABELS[k + 1]]
            assert nxt["args"]["issued_us"] < trap["ts"] < trap["ts"] + trap["dur"]  # issued before trap k starts
            assert nxt["ts"] + nxt["dur"] <= traps[LABELS[k + 1]]["ts"]  # and done (waited) before trap k+1


def test_prefetch_zero_loads_after_the_previous_trap(tmp_path):
    """The counter-case: without prefetch, trap k+1's load is issued only once trap k has ended."""
    _, compiled, inputs = compiled_offloaded(prefetch=0)
    with torch.no_grad():
        report = graphpass.trace(compiled, *inputs, path=tmp_path / "trace.json")
    doc = json.loads((tmp_path / "trace.json").read_text())
    check_ranges(doc, calls=1)
    traps, loads = by_call(ranges(doc, "graphpass.trap"), 0), by_call(ranges(doc, "graphpass.load"), 0)
    for k in range(DEPTH - 1):
        assert loads[LABELS[k + 1]]["args"]["issued_us"] >= traps[LABELS[k]]["ts"] + traps[LABELS[k]]["dur"]
    assert report.to_dict()["hidden_load_ms"] == 0


def test_disk_storage_maps_on_the_worker(tmp_path):
    _, compiled, inputs = compiled_offloaded(prefetch=1, storage="disk", disk_path=tmp_path / "off")
    with torch.no_grad():
        graphpass.trace(compiled, *inputs, path=tmp_path / "trace.json")
    check_ranges(json.loads((tmp_path / "trace.json").read_text()), calls=1)


def test_the_cli_writes_the_same_trace(tmp_path, capsys):
    out = tmp_path / "cli.json"
    assert main(["trace", "test_perfetto_trace:small_stack", "--out", str(out), "--calls", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) == TRACE_KEYS  # the schema docs/cli.md documents
    assert (summary["path"], summary["plot"], summary["traps"], summary["loads"]) == (
        str(out),
        None,
        2 * DEPTH,
        2 * DEPTH,
    )
    check_ranges(json.loads(out.read_text()), calls=2)
    torch._dynamo.reset()  # the next offload() of an MLPStack needs the class's compiled code gone
    assert (
        main(["trace", "test_perfetto_trace:small_stack", "--out", str(tmp_path / "plain.json"), "--offload", "disk"])
        == 0
    )
    text = capsys.readouterr().out
    assert text.startswith(f"trace written to {tmp_path / 'plain.json'}: 1 call(s), {DEPTH} trap ranges, {DEPTH} loads")


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_the_plot_is_a_png_of_the_requested_size(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    _, compiled, inputs = compiled_offloaded(prefetch=1)
    with torch.no_grad():
        report = graphpass.trace(
            compiled,
            *inputs,
            path=tmp_path / "trace.json",
            plot=tmp_path / "p" / "t.png",
            plot_size=(640, 240),
            title="test",
        )
    data = (tmp_path / "p" / "t.png").read_bytes()
    assert report.plot == tmp_path / "p" / "t.png" and png_size(data) == (640, 240)
    pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
    assert pixels.shape[:2] == (240, 640) and pixels[..., :3].std() > 0.05  # drawn, not blank
    report.plot_png(tmp_path / "again.png", size=(300, 200))
    assert png_size((tmp_path / "again.png").read_bytes()) == (300, 200)
    torch._dynamo.reset()
    assert (
        main(
            [
                "trace",
                "test_perfetto_trace:small_stack",
                "--out",
                str(tmp_path / "c.json"),
                "--plot",
                str(tmp_path / "c.png"),
                "--plot-size",
                "500x200",
            ]
        )
        == 0
    )
    assert png_size((tmp_path / "c.png").read_bytes()) == (500, 200)
    assert f"plot written to {tmp_path / 'c.png'}" in capsys.readouterr().out


def test_missing_matplotlib_names_the_extra_before_running(tmp_path, monkeypatch, capsys):
    from graphpass.comparing.plots import PlotUnavailableError

    no_matplotlib(monkeypatch)
    calls = []
    with pytest.raises(PlotUnavailableError, match=re.escape("pip install 'graphpass[plot]'")) as info:
        graphpass.trace(lambda x: calls.append(x), torch.ones(1), path=tmp_path / "t.json", plot=tmp_path / "t.png")
    assert isinstance(info.value, graphpass.GraphpassError) and "trace timeline" in str(info.value)
    assert calls == [] and not (tmp_path / "t.json").exists()  # nothing ran, nothing was written
    assert (
        main(
            [
                "trace",
                "test_perfetto_trace:small_stack",
                "--out",
                str(tmp_path / "c.json"),
                "--plot",
                str(tmp_path / "c.png"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("graphpass: error: ") and "pip install 'graphpass[plot]'" in err


def test_bad_arguments_name_the_option_or_path(tmp_path):
    fn = lambda x: x + 1  # noqa: E731
    x = torch.ones(2)
    for kwargs, key in (
        ({"calls": 0}, "calls"),
        ({"warmup": -1}, "warmup"),
        ({"plot_size": (10, 10)}, "plot_size"),
        ({"path": ""}, "path"),
    ):
        with pytest.raises(graphpass.ConfigError, match=f"'{key}'"):
            graphpass.trace(fn, x, **{"path": tmp_path / "t.json", **kwargs})
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(TraceError, match=re.escape(str(tmp_path / "file" / "t.json"))):
        graphpass.trace(fn, x, path=tmp_path / "file" / "t.json")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(TraceError, match="already running"):
            graphpass.trace(fn, x, path=tmp_path / "t.json")
    assert main(["trace", "test_perfetto_trace:small_stack", "--plot-size", "big"]) == 2


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("/proc/missing/t.json", r"its folder '/proc/missing' does not exist"),  # and cannot be created
        ("folder", r"it is a folder, not a file"),
        ("file/t.json", r"its folder '.*file' is not a folder"),
        ("/proc/t.json", r"its folder '/proc' is not writable"),  # root may write anywhere chmod allows: /proc refuses
    ],
)
@pytest.mark.parametrize("which", ["path", "plot"])
def test_output_paths_are_checked_before_the_model_runs(tmp_path, capsys, bad, problem, which):
    """Issue 22 item 15: the paths were checked only when the trace was written, after the model ran.
    (A missing folder that can be created is created, now before the run: see the tests above.)"""
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("not a folder")
    target = bad if bad.startswith("/") else str(tmp_path / bad)
    calls = []
    outputs = {"path": tmp_path / "t.json", "plot": None, which: target}
    if which == "plot":
        pytest.importorskip("matplotlib")
    with pytest.raises(TraceError, match=f"{which}: cannot write the .* to '{re.escape(target)}': {problem}"):
        graphpass.trace(lambda x: calls.append(x), torch.ones(1), **outputs)
    assert calls == [] and not (tmp_path / "t.json").exists()  # nothing ran, nothing was written
    flag = {"path": "--out", "plot": "--plot"}[which]
    argv = ["trace", "test_perfetto_trace:missing_factory", "--out", str(tmp_path / "c.json"), flag, target]
    assert main(argv) == 2  # refused before the factory is even looked up
    err = capsys.readouterr().err
    assert err.startswith(f"graphpass: error: {flag}: cannot write") and not (tmp_path / "c.json").exists()


def test_the_plot_and_the_trace_in_one_file_are_refused(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(graphpass.ConfigError, match=r"'plot'.*the same file as path"):
        graphpass.trace(lambda x: x, torch.ones(1), path=tmp_path / "t.json", plot=tmp_path / "t.json")


def test_a_model_without_offload_has_trap_ranges_only(tmp_path):
    model, inputs = small_stack()
    compiled = torch.compile(model, backend=graphpass.backend(then="eager", traps=["layers.*"]))
    with torch.no_grad():
        report = graphpass.trace(compiled, *inputs, path=tmp_path / "trace.json", warmup=2)
    doc = json.loads((tmp_path / "trace.json").read_text())
    assert [e["args"]["trap"] for e in ranges(doc, "graphpass.trap")] == LABELS
    assert ranges(doc, "graphpass.load") == [] and report.to_dict()["hidden_fraction"] is None
    assert Path(report.path) == tmp_path / "trace.json"
