"""Regression tests for capture / compare faults: reused folders, symlinks, bad tolerances, names
that are not UTF-8, errors escaping as non-graphpass exceptions, bad ranks, threads, compare memory."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file


from graphpass import atomic_files
from graphpass import CaptureError, ModelCapture
from graphpass.capturing import CaptureWriter
from graphpass.comparing import compare, compare_tensors
from graphpass.cli import main
from graphpass.errors import ConfigError, GraphpassError
from graphpass.models.corpus import build


def files_under(root: Path) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(root):
        out += [(Path(dirpath) / f).relative_to(root).as_posix() for f in filenames]
    return sorted(out)


def capture_run(root: Path, modules: list[str], steps: int, seed: int = 0) -> None:
    torch._dynamo.reset()
    model, inputs = build("mlp_stack", seed=seed)
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    cap = ModelCapture(compiled, modules=modules, capture_dir=root)
    cap.enable()
    for _ in range(steps):
        with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"][: inputs[0].shape[0]]):
            compiled(*inputs)


def write_meta_step(root: Path, step: str, modules: dict[str, torch.Tensor], listed: list[str] | None = None) -> Path:
    step_dir = root / "dp0" / step
    step_dir.mkdir(parents=True, exist_ok=True)
    for name, t in modules.items():
        (step_dir / name).mkdir(exist_ok=True)
        save_file({"0": t}, str(step_dir / name / "rank0.safetensors"))
    doc = {"step": step, "modules": listed if listed is not None else list(modules)}
    (step_dir / f"{step}_meta.json").write_text(json.dumps(doc))
    return step_dir


# --- 1. a reused capture_dir never mixes two runs -------------------------------------------------


def test_reused_capture_dir_is_refused_not_mixed(tmp_path):
    capture_run(tmp_path, ["layers.0-1"], steps=2)
    before = files_under(tmp_path)
    with pytest.raises(CaptureError, match="earlier run") as info:
        capture_run(tmp_path, ["layers.0"], steps=1, seed=1)
    msg = str(info.value)
    assert "decode_b4_0" in msg and "new capture_dir" in msg and "delete" in msg
    assert files_under(tmp_path) == before  # the refused step wrote nothing


def test_tensor_parallel_ranks_share_a_step_and_a_retry_is_not_an_earlier_run(tmp_path):
    t = torch.ones(2)
    w0, w1 = CaptureWriter(tmp_path, tp_rank=0), CaptureWriter(tmp_path, tp_rank=1)
    w0.write([("m", t)], is_prefill=True, size=2, meta={})
    w1.write([("m", t)], is_prefill=True, size=2, meta={})  # other ranks' files are this run's
    assert files_under(tmp_path) == [
        "dp0/prefill_s2_0/m/rank0.safetensors",
        "dp0/prefill_s2_0/m/rank1.safetensors",
        "dp0/prefill_s2_0/prefill_s2_0_meta.json",
        "dp0/prefill_s2_0/prefill_s2_0_meta.rank1.json",
    ]  # one meta per rank
    with pytest.raises(CaptureError, match="earlier run"):
        CaptureWriter(tmp_path, tp_rank=0).write([("m", t)], is_prefill=True, size=2, meta={})


def test_compare_flags_module_folders_the_meta_does_not_list(tmp_path):
    ref, test = tmp_path / "ref", tmp_path / "test"
    for root in (ref, test):
        step = write_meta_step(
            root, "decode_b4_0", {"layers.0": torch.ones(3), "layers.1": torch.ones(3)}, listed=["layers.0"]
        )  # layers.1 left over from an earlier, larger run
        (step / "stray.bin").write_bytes(b"x")
    report = compare(ref, test)
    assert not report.passed
    stale = [r for r in report.rows if r.module == "layers.1"]
    assert stale and all(r.status == "FAIL" and "not listed in its meta file" in r.note for r in stale)
    assert any(r.module == "stray.bin" and r.status == "FAIL" for r in report.rows)
    assert [r.status for r in report.rows if r.module == "layers.0"] == ["pass"]
    assert "all" not in str(report).splitlines()[-1]


def test_a_step_lands_whole_from_a_hidden_folder_and_a_leftover_one_is_noted(tmp_path, monkeypatch):
    t = torch.arange(3.0)
    renames = []
    real_rename = os.rename
    monkeypatch.setattr(
        os, "rename", lambda a, b: renames.append((os.path.basename(a), os.path.basename(b))) or real_rename(a, b)
    )
    w = CaptureWriter(tmp_path / "ref")
    w.write([("a", t), ("b", t * 2)], is_prefill=True, size=3, meta={})
    assert [b for a, b in renames] == ["prefill_s3_0"] and atomic_files.is_temp_name(renames[0][0])  # one rename
    # written again into its own step folder: file by file, no hidden folder left
    plan, buffers = w.plan([("a", t), ("b", t * 2)], step="prefill_s3_0", index=0, is_prefill=True, size=3, meta={})
    w._files.emit(plan, [b.numpy() for b in buffers])
    monkeypatch.undo()
    assert files_under(tmp_path / "ref") == [
        "dp0/prefill_s3_0/a/rank0.safetensors",
        "dp0/prefill_s3_0/b/rank0.safetensors",
        "dp0/prefill_s3_0/prefill_s3_0_meta.json",
    ]
    assert not [d for d in os.listdir(tmp_path / "ref" / "dp0") if d.startswith(".")]
    CaptureWriter(tmp_path / "test").write([("a", t), ("b", t * 2)], is_prefill=True, size=3, meta={})
    left = tmp_path / "test" / "dp0" / ".graphpass-0123abcd.tmp" / "a"  # a capture killed while writing
    left.mkdir(parents=True)
    (left / "rank0.safetensors").write_bytes(b"half")
    report = compare(tmp_path / "ref", tmp_path / "test")
    assert report.passed and any("dp0/.graphpass-0123abcd.tmp" in n for n in report.notes)


# --- 2. nothing is written through a planted symlink ---------------------------------------------


def _forced_names(monkeypatch):
    def names():
        yield ".graphpass-planted.tmp"
        while True:
            yield f".graphpass-{os.urandom(6).hex()}.tmp"

    monkeypatch.setattr(atomic_files, "temp_names", names)


@pytest.mark.parametrize("where", ["meta", "tensor"])
def test_symlink_at_temp_name_is_not_followed(tmp_path, monkeypatch, where):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    caps = tmp_path / "caps"
    step_dir = caps / "dp0" / "prefill_s4_0"
    folder = step_dir if where == "meta" else step_dir / "layers.0"
    folder.mkdir(parents=True)
    old_name = ".prefill_s4_0_meta.json" if where == "meta" else ".rank0.safetensors"
    links = [folder / f"{old_name}.tmp-{os.getpid()}", folder / ".graphpass-planted.tmp"]
    for link in links:
        link.symlink_to(victim)
    _forced_names(monkeypatch)  # the first temp name graphpass tries is the planted one
    w = CaptureWriter(caps)
    w.write([("layers.0", torch.arange(4.0))], is_prefill=True, size=4, meta={})
    assert victim.read_text() == "precious"
    assert all(link.is_symlink() and os.readlink(link) == str(victim) for link in links)
    meta = json.loads((step_dir / "prefill_s4_0_meta.json").read_text())
    assert meta["modules"] == ["layers.0"]
    assert not (step_dir / "prefill_s4_0_meta.json").is_symlink()


def test_symlinked_folder_below_capture_dir_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    caps = tmp_path / "caps"
    (caps / "dp0").mkdir(parents=True)
    (caps / "dp0" / "prefill_s4_0").symlink_to(outside)
    with pytest.raises(CaptureError):
        CaptureWriter(caps).write([("m", torch.ones(1))], is_prefill=True, size=4, meta={})
    assert list(outside.iterdir()) == []


# --- 3. compare: non-finite tolerances, names that are not UTF-8 ----------------------------------


@pytest.mark.parametrize("option,value", [("--atol", "inf"), ("--rtol", "inf"), ("--rtol", "nan"), ("--atol", "-inf")])
def test_cli_rejects_non_finite_tolerance(tmp_path, capsys, option, value):
    ref, test = tmp_path / "ref", tmp_path / "test"
    for root in (ref, test):
        write_meta_step(root, "prefill_s8_0", {"m": torch.ones(2)})
    assert main(["compare", str(ref), str(test), f"{option}={value}"]) == 2
    out, err = capsys.readouterr()
    assert "match" not in out and option.lstrip("-") in err
    assert not (test / "compare_summary.json").exists()


def test_report_with_non_utf8_names_prints_to_strict_utf8(tmp_path, monkeypatch):
    ref, test = tmp_path / "ref", tmp_path / "test"
    step = os.fsdecode(b"prefill_\xff_0")
    module = os.fsdecode(b"layer\xfe")
    for root in (ref, test):
        write_meta_step(root, step, {module: torch.ones(2), "ok": torch.ones(2)})
    buf = io.BytesIO()
    strict = io.TextIOWrapper(buf, encoding="utf-8", errors="strict", write_through=True)
    monkeypatch.setattr(sys, "stdout", strict)
    assert main(["compare", str(ref), str(test)]) == 0
    text = buf.getvalue().decode("utf-8")
    assert "prefill_\\xff_0" in text and "layer\\xfe" in text and "all 2 tensors match" in text
    json.loads((test / "compare_summary.json").read_text(encoding="utf-8"))


# --- 4. every capture failure is a GraphpassError, found up front where possible ------------------


def _tiny():
    model, inputs = build("mlp_stack")
    return torch.compile(model, backend="graphpass", options={"then": "eager"}), inputs


def test_unusable_paths_and_names_fail_at_construction(tmp_path):
    compiled, _ = _tiny()
    with pytest.raises(CaptureError, match="subdirectory"):
        ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path, subdirectory="s" * 300)
    with pytest.raises(CaptureError, match="NUL"):
        ModelCapture(compiled, modules=["layers.0"], capture_dir=str(tmp_path) + "/a\x00b")
    with pytest.raises(CaptureError, match="capture_dir"):
        ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path / ("d" * 300))
    with pytest.raises(ConfigError, match="dp_rank"):
        ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path, dp_rank=None)
    with pytest.raises(ConfigError, match="tp_rank"):
        ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path, tp_rank=10**300)
    long = nn.Sequential()
    long.add_module("m" * 300, nn.Linear(2, 2))
    with pytest.raises(CaptureError, match="module name"):
        ModelCapture(long, modules=["m" * 300], capture_dir=tmp_path)
    with pytest.raises(CaptureError, match="capture name"):
        CaptureWriter(tmp_path / "w").write([("n" * 300, torch.ones(1))], is_prefill=True, size=1, meta={})


def test_disk_full_raises_capture_error_and_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch as st

    calls = {"n": 0}

    def full(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= 2:  # the first module's file lands, the second hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kwargs) if real_write is not None else real_save(*args, **kwargs)

    real_write = atomic_files.write_all
    real_save = st.save_file
    monkeypatch.setattr(atomic_files, "write_all", full)
    w = CaptureWriter(tmp_path)
    tensors = [("layers.0", torch.ones(3)), ("layers.1", torch.ones(3))]
    with pytest.raises(CaptureError, match="No space left") as info:
        w.write(tensors, is_prefill=True, size=3, meta={})
    assert "layers.1" in str(info.value) and "disk space" in str(info.value)
    assert files_under(tmp_path) == []  # no partial step, no temp file
    monkeypatch.undo()
    assert [p.name for p in w.write(tensors, is_prefill=True, size=3, meta={})] == ["prefill_s3_0"]


# --- 5. values accepted but wrong ----------------------------------------------------------------


@pytest.mark.parametrize("key", ["dp_rank", "tp_rank"])
@pytest.mark.parametrize("value", [-1, 3.9, True, None, "0"])
def test_ranks_must_be_non_negative_ints(tmp_path, key, value):
    with pytest.raises(ConfigError) as info:
        CaptureWriter(tmp_path, **{key: value})
    assert info.value.key == key and isinstance(info.value, GraphpassError)
    compiled, _ = _tiny()
    with pytest.raises(ConfigError, match=key):
        ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path, **{key: value})


def test_names_with_a_trailing_newline_are_refused(tmp_path):
    with pytest.raises(CaptureError, match="capture name"):
        CaptureWriter(tmp_path / "w").write([("lm_head\n", torch.ones(1))], is_prefill=True, size=1, meta={})
    assert not (tmp_path / "w" / "dp0").exists()
    # compare: "rank0.safetensors\n" is not a rank file
    ref, test = tmp_path / "ref", tmp_path / "test"
    for root in (ref, test):
        step = write_meta_step(root, "prefill_s1_0", {"m": torch.ones(1)})
        os.rename(step / "m" / "rank0.safetensors", step / "m" / "rank0.safetensors\n")
    (row,) = compare(ref, test).rows
    assert row.status == "FAIL" and row.note == "no rank*.safetensors files"


# --- 6. one ModelCapture stepping in two threads ---------------------------------------------------


def test_one_capture_two_threads(tmp_path):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    cap = ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path)
    compiled(*inputs)  # compile once, before the threads (capture off: nothing written)
    cap.enable()
    x = {0: inputs[0].clone(), 1: inputs[0] * 2 + 1}
    barrier = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []
    written: dict[int, list[Path]] = {}

    def worker(i):
        try:
            cap.setup_tensor_capture()
            barrier.wait()  # both steps open at once
            compiled(x[i], *inputs[1:])
            barrier.wait()  # both forwards done before either saves
            written[i] = cap.save_tensor_captures(is_prefill=False, req_ids=[f"t{i}"])
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    from graphpass.capturing.ops import ACTIVE_CAPTURES

    assert ACTIVE_CAPTURES.get() == ()
    steps = sorted(p.name for ps in written.values() for p in ps)
    assert steps == ["decode_b1_0", "decode_b1_1"]
    from safetensors.torch import load_file

    with torch.no_grad():
        expected = {i: model.layers[0](model.proj_in(x[i])) for i in (0, 1)}
    for i, (step_dir,) in written.items():
        meta = json.loads((step_dir / f"{step_dir.name}_meta.json").read_text())
        assert meta["req_ids"] == [f"t{i}"]
        got = load_file(str(step_dir / "layers.0" / "rank0.safetensors"))
        assert list(got) == ["output"]  # one tensor: the other thread's did not leak in
        torch.testing.assert_close(got["output"], expected[i])


# --- 7. compare in chunks: same numbers, bounded memory --------------------------------------------


def whole_tensor_numbers(ref, test, rtol, atol):
    """The computation compare did before chunking (whole tensors widened to float64)."""
    wide = torch.complex128 if ref.is_complex() or test.is_complex() else torch.float64
    r, t = ref.to(wide), test.to(wide)
    ok = torch.allclose(t, r, rtol=rtol, atol=atol, equal_nan=True)
    both_nan = torch.isnan(r) & torch.isnan(t)
    diff = torch.where((r == t) | both_nan, 0.0, (t - r).abs())
    r_fin = torch.where(torch.isfinite(r), r.abs(), 0.0)
    if diff.numel() == 0:
        return ok, 0.0, 0.0, 0.0
    max_abs = diff.max().item()
    rel_l2 = (torch.linalg.vector_norm(diff) / max(torch.linalg.vector_norm(r_fin).item(), 1e-30)).item()
    return ok, max_abs, rel_l2, max_abs / max(r_fin.max().item(), 1e-30)


def _cases():
    g = torch.Generator().manual_seed(0)
    shapes = [(), (0, 3), (1,), (7,), (5, 13), (3, 4, 5), (2, 3, 1, 7), (1, 257)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.complex64):
        for shape in shapes:
            if dtype == torch.int32:
                r = torch.randint(-5, 5, shape, generator=g, dtype=torch.int32)
                t = r + (torch.rand(shape, generator=g) < 0.2).to(torch.int32)
            else:
                r = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
                t = (
                    r.to(torch.float64 if not dtype.is_complex else torch.complex128)
                    + 1e-3 * torch.randn(shape, generator=g, dtype=torch.float64)
                ).to(dtype)
            yield r, t
    r = torch.randn(6, 5, generator=g)
    t = r.clone()
    r[0, 0], t[0, 0] = float("nan"), float("nan")
    r[1, 1] = t[1, 1] = float("inf")
    t[2, 2] = float("nan")
    r[3, 3], t[3, 3] = float("inf"), 1.0
    yield r, t
    yield r.to(torch.bfloat16), t.to(torch.bfloat16)


def _same(a, b):
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or math.isclose(a, b, rel_tol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
def test_chunked_compare_equals_whole_tensor(chunk):
    for ref, test in _cases():
        row = compare_tensors.compare_tensors("s", "m", 0, "0", ref, test, 1e-3, 1e-5, chunk_elems=chunk)
        ok, max_abs, rel_l2, rel_linf = whole_tensor_numbers(ref, test, 1e-3, 1e-5)
        assert row.passed == ok, (ref.dtype, ref.shape)
        assert _same(row.max_abs, max_abs) and _same(row.rel_linf, rel_linf), (ref.dtype, ref.shape)
        assert _same(row.rel_l2, rel_l2), (ref.dtype, ref.shape, row.rel_l2, rel_l2)


def test_compare_reads_files_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(compare_tensors, "CHUNK_ELEMS", 5)
    cases = list(_cases())
    ref, test = tmp_path / "ref", tmp_path / "test"
    for root, which in ((ref, 0), (test, 1)):
        write_meta_step(root, "prefill_s1_0", {f"m{i}": case[which].contiguous() for i, case in enumerate(cases)})
    rows = {r.module: r for r in compare(ref, test).rows}
    for i, (r, t) in enumerate(cases):
        ok, max_abs, rel_l2, rel_linf = whole_tensor_numbers(r, t, 1e-3, 1e-5)
        row = rows[f"m{i}"]
        assert row.passed == ok and _same(row.max_abs, max_abs) and _same(row.rel_l2, rel_l2)
        assert _same(row.rel_linf, rel_linf)


def test_compare_memory_is_a_small_multiple_of_a_chunk(tmp_path):
    """Two 64 MiB bf16 captures: whole-file float64 widening peaked at ~1.5 GB; chunks stay small."""
    n = 32 * 1024 * 1024
    ref, test = tmp_path / "ref", tmp_path / "test"
    g = torch.Generator().manual_seed(0)
    base = torch.randn(n // 4096, 4096, generator=g, dtype=torch.float32).to(torch.bfloat16)
    write_meta_step(ref, "prefill_s1_0", {"big": base})
    write_meta_step(test, "prefill_s1_0", {"big": base})
    del base
    script = (
        "import resource, sys, graphpass, torch\n"
        "from graphpass.comparing import compare\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "report = compare(sys.argv[1], sys.argv[2])\n"
        "assert report.passed, str(report)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(ref), str(test)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    grew = int(out.stdout.strip().splitlines()[-1])
    # the two memory-mapped files (128 MiB) may count as resident; whole-tensor float64 is > 1 GiB
    assert grew < 400 * 1024 * 1024, f"compare grew peak RSS by {grew / 2**20:.0f} MiB"


# --- 8. one compiled graph shared by two instances of a class ---------------------------------------
# With inline_inbuilt_nn_modules the parameters are graph inputs and no guard pins the module's
# identity, so Dynamo runs the graph traced for one instance for every other instance of its class.


def _load_steps(root: Path) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    out = {}
    for meta_path in sorted(Path(root).rglob("*_meta.json")):
        step = meta_path.parent
        meta = json.loads(meta_path.read_text())
        out[step.relative_to(root).as_posix()] = {
            m: load_file(str(step / m / "rank0.safetensors")) for m in meta["modules"]
        }
    return out


def _eager_layers(model, x, names):
    """Eager outputs of ``model``'s modules ``names`` (forward hooks) for input ``x``."""
    got = {}
    mods = dict(model.named_modules())
    hooks = [
        mods[n].register_forward_hook(lambda m, a, out, n=n: got.setdefault(n, out.detach().clone())) for n in names
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return got


def _pair():
    first, x1 = build("mlp_stack", seed=1)
    second, x2 = build("mlp_stack", seed=2)
    opts = {"then": "eager"}
    return (first, x1, torch.compile(first, backend="graphpass", options=opts)), (
        second,
        x2,
        torch.compile(second, backend="graphpass", options=opts),
    )


def test_second_instance_capture_made_before_its_first_call_captures_its_own_values(tmp_path):
    from torch._dynamo.utils import counters

    (first, x1, c1), (second, x2, c2) = _pair()
    counters.clear()
    cap = ModelCapture(c2, modules=["layers.0-1"], capture_dir=tmp_path)  # before any call
    cap.enable()
    c1(*x1)  # the first instance compiles the graph both run; it has no ModelCapture of its own
    with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]):
        c2(*x2)
    assert counters["stats"]["unique_graphs"] == 1  # the second model ran the first one's graph
    (step,) = _load_steps(tmp_path).values()
    want = _eager_layers(second, x2[0], ["layers.0", "layers.1"])
    assert sorted(step) == ["layers.0", "layers.1"]
    for name in want:
        assert list(step[name]) == ["output"]
        torch.testing.assert_close(step[name]["output"], want[name], rtol=0, atol=0)


def test_second_instance_capture_made_after_another_instance_compiled_is_refused(tmp_path):
    (first, x1, c1), (second, x2, c2) = _pair()
    c1(*x1)
    with pytest.raises(CaptureError) as info:
        ModelCapture(c2, modules=["layers.0"], capture_dir=tmp_path)
    msg = str(info.value)
    assert "another MLPStack instance" in msg and "before the first call" in msg and "torch._dynamo.reset()" in msg
    torch._dynamo.reset()  # the advice works: the next call recompiles with capture nodes
    cap = ModelCapture(c2, modules=["layers.0"], capture_dir=tmp_path)
    cap.enable()
    with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]):
        c2(*x2)
    (step,) = _load_steps(tmp_path).values()
    torch.testing.assert_close(step["layers.0"]["output"], _eager_layers(second, x2[0], ["layers.0"])["layers.0"])


def test_empty_step_of_an_instance_running_another_instances_graph_is_an_error(tmp_path, monkeypatch):
    """If a shared graph without this capture's nodes runs anyway (here: the pending-capture lookup
    is switched off, as for a graph compiled before the ModelCapture existed), the step refuses."""
    from graphpass.capturing import model_capture

    monkeypatch.setattr(model_capture, "_pending_by_class", lambda: {}, raising=False)
    (first, x1, c1), (second, x2, c2) = _pair()
    cap = ModelCapture(c2, modules=["layers.0"], capture_dir=tmp_path)
    cap.enable()
    c1(*x1)
    with pytest.raises(CaptureError) as info:
        with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]):
            c2(*x2)
    msg = str(info.value)
    assert "nothing was captured" in msg and "another MLPStack instance" in msg and "torch._dynamo.reset()" in msg
    assert files_under(tmp_path) == []


def test_two_instances_with_different_modules_each_get_their_own(tmp_path):
    (first, x1, c1), (second, x2, c2) = _pair()
    cap1 = ModelCapture(c1, modules=["layers.0"], capture_dir=tmp_path / "one")
    cap2 = ModelCapture(c2, modules=["layers.1", "head"], capture_dir=tmp_path / "two")
    for cap, compiled, x in ((cap1, c1, x1), (cap2, c2, x2), (cap1, c1, x1)):
        cap.enable()
        with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]):
            compiled(*x)
    one, two = _load_steps(tmp_path / "one"), _load_steps(tmp_path / "two")
    assert sorted(one) == ["dp0/decode_b4_0", "dp0/decode_b4_1"] and sorted(two) == ["dp0/decode_b4_0"]
    want1 = _eager_layers(first, x1[0], ["layers.0"])
    want2 = _eager_layers(second, x2[0], ["layers.1", "head"])
    for step in one.values():
        assert sorted(step) == ["layers.0"] and list(step["layers.0"]) == ["output"]
        torch.testing.assert_close(step["layers.0"]["output"], want1["layers.0"], rtol=0, atol=0)
    (step,) = two.values()
    assert sorted(step) == ["head", "layers.1"]
    for name, t in want2.items():
        assert list(step[name]) == ["output"]
        torch.testing.assert_close(step[name]["output"], t, rtol=0, atol=0)


@pytest.mark.parametrize("draft_captured", [False, True])
def test_same_class_draft_inside_the_targets_step_does_not_leak_in(tmp_path, draft_captured):
    (target, xt, ct), (draft, xd, cd) = _pair()
    cap = ModelCapture(ct, modules=["layers.0-2", "head"], capture_dir=tmp_path)
    dcap = (
        ModelCapture(cd, modules=["layers.0"], capture_dir=tmp_path, subdirectory="draft") if draft_captured else None
    )
    cap.enable()
    if dcap is not None:
        dcap.enable()
    for _ in range(2):
        with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]):
            ct(*xt)  # target
            if dcap is not None:
                with dcap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]):
                    cd(*xd)  # speculative draft, same architecture
            else:
                cd(*xd)
            ct(*xt)  # target again (verification)
    steps = _load_steps(tmp_path)
    target_steps = {k: v for k, v in steps.items() if not k.startswith("draft/")}
    assert sorted(target_steps) == ["dp0/decode_b4_0", "dp0/decode_b4_1"]
    want = _eager_layers(target, xt[0], ["layers.0", "layers.1", "layers.2", "head"])
    for step in target_steps.values():
        assert sorted(step) == sorted(want)
        for name, t in want.items():
            assert list(step[name]) == ["output", "output#1"]  # the target's two forwards, nothing of the draft's
            for v in step[name].values():
                torch.testing.assert_close(v, t, rtol=0, atol=0)
    draft_steps = {k: v for k, v in steps.items() if k.startswith("draft/")}
    if dcap is None:
        assert draft_steps == {}
    else:
        assert sorted(draft_steps) == ["draft/dp0/decode_b4_0", "draft/dp0/decode_b4_1"]
        dwant = _eager_layers(draft, xd[0], ["layers.0"])["layers.0"]
        for step in draft_steps.values():
            assert sorted(step) == ["layers.0"] and list(step["layers.0"]) == ["output"]
            torch.testing.assert_close(step["layers.0"]["output"], dwant, rtol=0, atol=0)


class TwoStacks(nn.Module):
    """Runs two MLPStack blocks eagerly; each block is compiled on its own (``Module.compile``)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(build("mlp_stack", seed=s)[0] for s in (1, 2))

    def forward(self, x):
        return torch.cat([block(x) for block in self.blocks], dim=-1)


def test_block_running_another_blocks_graph_is_named_after_itself(tmp_path):
    """blocks.1 runs the graph traced from blocks.0's frame, whose capture nodes were traced for
    ``blocks.0.*``: its values are named after blocks.1, never filed under blocks.0."""
    from torch._dynamo.utils import counters

    model = TwoStacks()
    x = build("mlp_stack")[1][0]
    for block in model.blocks:
        block.compile(backend="graphpass", options={"then": "eager"})
    names = ["blocks.0.layers.0", "blocks.1.layers.0", "blocks.1.head"]
    cap = ModelCapture(model, modules=names, capture_dir=tmp_path)
    cap.enable()
    counters.clear()
    with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]):
        model(x)
    assert counters["stats"]["unique_graphs"] == 1  # one graph, both blocks
    (step,) = _load_steps(tmp_path).values()
    want = _eager_layers(model, x, names)
    assert sorted(step) == sorted(names)
    for name, t in want.items():
        assert list(step[name]) == ["output"], name
        torch.testing.assert_close(step[name]["output"], t, rtol=0, atol=0)


# --- 9. compare: leftovers of an interrupted capture are a note, not data ----------------------------


def test_compare_notes_and_ignores_leftover_temporary_files(tmp_path):
    ref, test = tmp_path / "ref", tmp_path / "test"
    for root in (ref, test):
        write_meta_step(root, "prefill_s4_0", {"layers.0": torch.ones(3)})
    step = test / "dp0" / "prefill_s4_0"
    (step / ".graphpass-0123456789abcdef.tmp").write_bytes(b"half a meta file")
    (step / "layers.0" / ".graphpass-fedcba9876543210.tmp").write_bytes(b"half a tensor")
    report = compare(ref, test)
    assert report.passed and [(r.module, r.status) for r in report.rows] == [("layers.0", "pass")]
    (note,) = [n for n in report.notes if "temporary" in n]
    assert "test" in note and "interrupted" in note and "2 " in note
    assert "dp0/prefill_s4_0/layers.0/.graphpass-fedcba9876543210.tmp" in note
    assert main(["compare", str(ref), str(test)]) == 0


# --- 10. compare: lost ranks, steps, modules and keys are named failures (issue 22, item 1) --------

LOSS_MODULES = ["layers.0-2", "head"]


def _rank_run(root: Path, rank: int, steps: int, bump: float = 0.0) -> None:
    """One tensor-parallel rank of a (replicated) run, captured for real: the corpus MLP stack,
    compiled with graphpass, ``steps`` decode steps; ``bump`` perturbs layers.1 on this rank."""
    torch._dynamo.reset()
    model, (x,) = build("mlp_stack", seed=0)
    with torch.no_grad():
        model.layers[1].fc2.bias.add_(bump)
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    cap = ModelCapture(compiled, modules=LOSS_MODULES, capture_dir=root, dp_rank=0, tp_rank=rank)
    cap.enable()
    for _ in range(steps):
        with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]), torch.no_grad():
            compiled(x)


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    """Two-rank runs of two steps each: ``ref``, ``same`` (identical) and ``bad`` (rank 1 perturbed)."""
    root = tmp_path_factory.mktemp("rank_runs")
    for name, bump in (("ref", 0.0), ("same", 0.0), ("bad", 0.25)):
        for rank in (0, 1):
            _rank_run(root / name, rank, steps=2, bump=bump if rank == 1 else 0.0)
    return root


def _lose(step: Path, what: str) -> None:
    import shutil

    if what == "step":
        shutil.rmtree(step)
    elif what == "module":
        shutil.rmtree(step / "layers.2")
    elif what == "rank file":
        (step / "layers.1" / "rank1.safetensors").unlink()
    elif what == "rank's step":  # a host whose rank stopped one step early: no file, no meta file
        for f in step.glob("*/rank1.safetensors"):
            f.unlink()
        (step / f"{step.name}_meta.rank1.json").unlink()
    elif what == "key":
        save_file({}, str(step / "layers.0" / "rank0.safetensors"))


LOSSES = {  # what is lost from step decode_b4_1 of the test run -> the row that must name it
    "step": ("", None, None, "step missing in test"),
    "module": ("layers.2", None, None, "missing in test"),
    "rank file": ("layers.1", 1, None, "rank file missing in test"),
    "rank's step": (
        "",
        1,
        None,
        "rank 1 missing in test: no meta or rank file of it in this step (the test run "
        "has ranks 0-1: its other steps' files or tp_size)",
    ),
    "key": ("layers.0", 0, "output", "key missing in test"),
}


@pytest.mark.parametrize("what", list(LOSSES))
def test_compare_names_every_kind_of_loss(rank_runs, tmp_path, capsys, what):
    import shutil

    test = tmp_path / "test"
    shutil.copytree(rank_runs / "same", test)
    _lose(test / "dp0" / "decode_b4_1", what)
    report = compare(rank_runs / "ref", test)
    assert not report.passed
    first = report.first_failure
    assert (first.step, first.module, first.rank, first.key, first.note) == ("dp0/decode_b4_1", *LOSSES[what])
    assert first.missing == "test" and first.status == "FAIL"
    assert [r for r in report.rows if not r.passed] == [first]  # nothing else is wrong
    assert all(r.passed for r in report.rows if r.step == "dp0/decode_b4_0")
    assert main(["compare", str(rank_runs / "ref"), str(test), "--json", str(tmp_path / "s.json")]) == 1
    out = capsys.readouterr().out
    assert "1 missing in test" in out and "all" not in out.splitlines()[-2]
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["counts"]["missing_in_test"] == 1 and data["first_failure"]["missing"] == "test"


def test_a_perturbed_rank_whose_files_were_lost_is_named_missing_not_matched(rank_runs, tmp_path):
    """Rank 1 diverges (layers.1 on); its rank files were left out, its meta files kept. Before,
    compare checked rank 0 alone and said "all match"."""
    import shutil

    test = tmp_path / "test"
    shutil.copytree(rank_runs / "bad", test)
    assert not compare(rank_runs / "ref", test).passed  # with rank 1 there: layers.1 differs on rank 1
    for f in test.glob("dp0/*/*/rank1.safetensors"):
        f.unlink()
    report = compare(rank_runs / "ref", test)
    assert not report.passed
    lost = [(r.step, r.module, r.rank) for r in report.rows if not r.passed]
    assert lost == [(f"dp0/decode_b4_{k}", m, 1) for k in (0, 1) for m in ("layers.0", "layers.1", "layers.2", "head")]
    assert all(r.missing == "test" and r.note == "rank file missing in test" for r in report.rows if not r.passed)
    assert str(report).splitlines()[-1] == (
        "first diverging module: layers.0 (step dp0/decode_b4_0, rank 1): rank file missing in test"
    )


def test_a_host_root_not_passed_is_named_through_tp_size(tmp_path):
    """The writer records tp_size (ModelCapture: from the mesh or process group): with one host's
    root left out, the ranks it held are missing, though no file of theirs is anywhere."""
    t = torch.arange(6.0).reshape(2, 3)
    CaptureWriter(tmp_path / "ref").write([("m", t)], is_prefill=True, size=2, meta={})
    for rank in (0, 1):
        CaptureWriter(tmp_path / f"host{rank}", tp_rank=rank, tp_size=2).write(
            [("m", t)], is_prefill=True, size=2, meta={}
        )
    assert compare(tmp_path / "ref", [tmp_path / "host0", tmp_path / "host1"]).passed
    report = compare(tmp_path / "ref", [tmp_path / "host0"])
    assert not report.passed
    first = report.first_failure
    assert (first.step, first.module, first.rank, first.missing) == ("dp0/prefill_s2_0", "", 1, "test")
    assert first.note.startswith("rank 1 missing in test")
    back = compare([tmp_path / "host0"], tmp_path / "ref")  # the same loss on the ref side
    assert not back.passed and back.first_failure.missing == "ref"


def test_meta_records_step_index_and_tp_size(tmp_path):
    model, (x,) = build("mlp_stack", seed=0)
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    caps = {
        "auto": ModelCapture(compiled, modules=["head"], capture_dir=tmp_path / "auto"),
        "ints": ModelCapture(compiled, modules=["head"], capture_dir=tmp_path / "ints", dp_rank=0, tp_rank=0),
    }
    for cap in caps.values():
        cap.enable()
        for is_prefill in (True, False, False, True, False):
            with cap.step(is_prefill=is_prefill, req_ids=["a", "b", "c", "d"]), torch.no_grad():
                compiled(x)
    from graphpass.capturing.writer import read_step_meta

    for name, tp_size in (("auto", 1), ("ints", None)):
        steps = {p.name: read_step_meta(p) for p in (tmp_path / name / "dp0").iterdir()}
        assert {s: m["step_index"] for s, m in steps.items()} == {
            "prefill_s8_0": 0,
            "decode_b4_0": 1,
            "decode_b4_1": 2,
            "prefill_s8_1": 3,
            "decode_b4_2": 4,
        }
        assert {m["tp_size"] for m in steps.values()} == {tp_size}
    with pytest.raises(ConfigError, match="tp_size"):
        CaptureWriter(tmp_path / "w", tp_rank=2, tp_size=2)


# --- 11. compare: a tampered meta never makes compare allocate what the disk does not hold (item 14) --


def _shards(root: Path, pieces: dict[int, tuple[torch.Tensor, dict]], module: str = "m") -> None:
    """A step whose ranks' files hold ``pieces`` (rank -> (tensor, layout fields of its meta entry))."""
    step = root / "dp0" / "prefill_s4_0"
    (step / module).mkdir(parents=True, exist_ok=True)
    for rank, (t, layout) in pieces.items():
        save_file({"output": t.contiguous()}, str(step / module / f"rank{rank}.safetensors"))
        entry = dict({"key": "output", "dtype": "float32", "shape": list(t.shape)}, **layout)
        name = "prefill_s4_0_meta.json" if rank == 0 else f"prefill_s4_0_meta.rank{rank}.json"
        (step / name).write_text(json.dumps({"modules": [module], "tensors": {module: [entry]}, "tp_rank": rank}))


def _shard0(offset, global_shape=(4, 3), placements=("Shard(0)",)):
    return {
        "placements": list(placements),
        "mesh_shape": [2],
        "global_shape": list(global_shape),
        "global_offset": list(offset),
    }


WHOLE = torch.arange(12, dtype=torch.float32).reshape(4, 3)


@pytest.fixture
def allocations(monkeypatch):
    """The number of elements of every torch.empty / torch.zeros call while compare runs."""
    sizes: list[int] = []
    for name in ("empty", "zeros"):
        real = getattr(torch, name)

        def spy(*size, _real=real, **kw):
            dims = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)) else size
            sizes.append(math.prod(int(d) for d in dims))
            return _real(*size, **kw)

        monkeypatch.setattr(torch, name, spy)
    return sizes


def test_tampered_global_shape_is_not_allocated(tmp_path, allocations):
    _shards(
        tmp_path / "ref", {0: (WHOLE[:2], _shard0([0, 0], (1 << 24, 3))), 1: (WHOLE[2:], _shard0([2, 0], (1 << 24, 3)))}
    )
    _shards(tmp_path / "test", {0: (WHOLE, {})})
    report = compare(tmp_path / "ref", tmp_path / "test")
    assert not report.passed
    (row,) = report.rows
    assert (row.module, row.key, row.missing) == ("m", "output", "ref")
    assert row.note == (
        "cannot assemble ref: the ref's pieces (ranks 0-1) hold 12 of the 50331648 elements of the "
        "global shape [16777216, 3]"
    )
    assert max(allocations, default=0) <= 12  # nothing sized by the claimed global shape


def test_tampered_global_shape_on_the_test_side(tmp_path, allocations):
    _shards(tmp_path / "ref", {0: (WHOLE, {})})
    _shards(tmp_path / "test", {0: (WHOLE[:2], _shard0([0, 0])), 1: (WHOLE[2:], _shard0([2, 0], (1 << 24, 3)))})
    report = compare(tmp_path / "ref", tmp_path / "test")
    assert not report.passed
    notes = [r.note for r in report.rows if not r.passed]
    assert any("ranks disagree on the global shape: [4, 3] and rank 1's [16777216, 3]" in n for n in notes)
    assert any(n == "shape mismatch [4, 3] vs [16777216, 3] (global)" for n in notes)
    assert max(allocations, default=0) <= 12


@pytest.mark.parametrize("side", ["ref", "test"])
def test_overlapping_shards_are_refused(tmp_path, side):
    """Rows 0-1 on rank 0, rows 1-3 on rank 1: together they cover the tensor, and before, the
    overlap passed (the later rank's copy of row 1 won)."""
    overlap = {0: (WHOLE[:2], _shard0([0, 0])), 1: (WHOLE[1:], _shard0([1, 0]))}
    _shards(tmp_path / side, overlap)
    _shards(tmp_path / ("test" if side == "ref" else "ref"), {0: (WHOLE, {})})
    report = compare(tmp_path / "ref", tmp_path / "test")
    assert not report.passed
    want = "the pieces of rank 0 ([2, 3] at [0, 0]) and rank 1 ([3, 3] at [1, 0]) overlap"
    assert any(want in r.note for r in report.rows if not r.passed), str(report)


def test_two_shards_at_one_place_are_refused_but_replicas_are_not(tmp_path):
    same = {0: (WHOLE[:2], _shard0([0, 0], (2, 3))), 1: (WHOLE[:2], _shard0([0, 0], (2, 3)))}
    _shards(tmp_path / "ref", {0: (WHOLE[:2], {})})
    _shards(tmp_path / "test", same)
    report = compare(tmp_path / "ref", tmp_path / "test")
    assert not report.passed and any("overlapping shards" in r.note for r in report.rows)
    replicas = {r: (WHOLE[:2], _shard0([0, 0], (2, 3), ("Replicate()",))) for r in (0, 1)}
    _shards(tmp_path / "rep", replicas)
    assert compare(tmp_path / "ref", tmp_path / "rep").passed


@pytest.mark.parametrize("offset", [["a", 0], [-1, 0], [3, 0], [0], None])
def test_malformed_or_misplaced_test_offsets_are_rows_not_crashes(tmp_path, offset):
    _shards(tmp_path / "ref", {0: (WHOLE, {})})
    bad = dict(_shard0([2, 0]), global_offset=offset)
    _shards(tmp_path / "test", {0: (WHOLE[:2], _shard0([0, 0])), 1: (WHOLE[2:], bad)})
    report = compare(tmp_path / "ref", tmp_path / "test")
    assert not report.passed
    (row,) = [r for r in report.rows if r.rank == 1]
    assert row.status == "FAIL" and row.note.startswith("test meta: ")
