"""Capture written behind the compute (graphpass/capturing/staging.py) and capture sites resolved
once (registry.CaptureSites): nothing lost, nothing partial, memory bounded, policies as documented.

The saving processes of the exit and kill tests are forked from one fork server (tests/forkserver.py)
that imported torch once; each runs its script as ``python -c`` would, to a real interpreter exit."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from graphpass import CaptureError, ModelCapture, atomic_files
from graphpass.capturing import registry as registry_mod
from graphpass.capturing.ops import capture_tensor
from graphpass.capturing.staging import ProcessWriteBehind, StagingConfig
from graphpass.capturing.writer import CaptureWriter
from graphpass.errors import ConfigError, GraphpassError
from graphpass.models.corpus import build

REPO = Path(__file__).resolve().parents[2]


def files_under(root: Path) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(root):
        out += [(Path(dirpath) / f).relative_to(root).as_posix() for f in filenames]
    return sorted(out)


def steps_on_disk(root: Path) -> dict[str, dict]:
    """step folder -> its meta, for every step with a meta file."""
    return {p.parent.name: json.loads(p.read_text()) for p in Path(root).rglob("*_meta.json")}


WRITERS = ["process", "thread"]


@pytest.fixture(params=WRITERS)
def writer(request):
    """Each write-behind: the writer process (the default on Linux) and the writer thread."""
    return request.param


class Gate:
    """Holds the capture's writer before each background write until ``open()``: the writer
    process is started and stopped (SIGSTOP, SIGCONT to go on); the writer thread waits in
    ``write_reserved``."""

    def __init__(self, monkeypatch, cap: ModelCapture | None = None):
        behind = cap._behind if cap is not None else None
        if isinstance(behind, ProcessWriteBehind):
            with behind._cond:
                behind._start()
            pid = behind._proc.pid
            os.kill(pid, signal.SIGSTOP)
            self.open = lambda: os.kill(pid, signal.SIGCONT)
            return
        self.go = threading.Event()
        self.started = threading.Semaphore(0)
        real = CaptureWriter.write_reserved

        def held(writer, *args, **kwargs):
            self.started.release()
            assert self.go.wait(60)
            return real(writer, *args, **kwargs)

        monkeypatch.setattr(CaptureWriter, "write_reserved", held)

    def open(self):
        self.go.set()


def manual_capture(tmp_path, writer: str = "process", **staging) -> ModelCapture:
    """A ModelCapture fed by ``capture_tensor`` calls (eager: no compile needed)."""
    model, _ = build("mlp_stack")
    cap = ModelCapture(
        model, modules=["layers.0"], capture_dir=tmp_path, staging=StagingConfig(writer=writer, **staging)
    )
    cap.enable()
    return cap


def manual_step(cap: ModelCapture, value: torch.Tensor, wait: bool = False) -> None:
    with cap.step(is_prefill=True, positions=torch.arange(value.shape[-1]), wait=wait):
        capture_tensor("x", value)


def eager_outputs(model, x, names) -> dict[str, torch.Tensor]:
    got = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: got.setdefault(n, o.clone())) for n in names
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return got


# --- compiled model, written behind: same files as written in place ----------------------------------


def test_write_behind_files_equal_waited_files_after_flush(tmp_path):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    behind = ModelCapture(compiled, modules=["layers.0-1", "head"], capture_dir=tmp_path / "behind")
    behind.enable()
    xs = [inputs[0] * (i + 1) for i in range(3)]
    returned = []
    for x in xs:
        with behind.step(is_prefill=False, req_ids=["a", "b", "c", "d"], wait=False):
            compiled(x)
        returned.append(behind.writer.step_dirs(["layers.0"], f"decode_b4_{len(returned)}")[0])
    behind.flush()
    assert behind.pending_steps == 0
    metas = steps_on_disk(tmp_path / "behind")
    assert sorted(metas) == ["decode_b4_0", "decode_b4_1", "decode_b4_2"]
    assert [metas[f"decode_b4_{i}"]["step_index"] for i in range(3)] == [0, 1, 2]
    for i, x in enumerate(xs):
        for name, t in eager_outputs(model, x, ["layers.0", "layers.1", "head"]).items():
            got = load_file(str(returned[i] / name / "rank0.safetensors"))["output"]
            torch.testing.assert_close(got, t, rtol=0, atol=0)  # fp32, data only moved


def test_step_returns_the_dirs_it_will_write(tmp_path):
    cap = manual_capture(tmp_path)
    with cap.step(is_prefill=True, positions=torch.arange(3), wait=False):
        capture_tensor("x", torch.ones(3))
    cap.flush()
    assert (tmp_path / "dp0" / "prefill_s3_0" / "x" / "rank0.safetensors").is_file()


# --- nothing lost: flush, disable, wait=True, auto_steps exit, interpreter exit, Ctrl-C ----------------


@pytest.mark.parametrize("how", ["flush", "disable", "wait"])
def test_every_step_is_on_disk_when_flush_disable_or_wait_returns(tmp_path, monkeypatch, how, writer):
    cap = manual_capture(tmp_path, writer)
    gate = Gate(monkeypatch, cap)
    for i in range(3):
        manual_step(cap, torch.full((4,), float(i)))
    assert steps_on_disk(tmp_path) == {} and cap.pending_steps == 3  # held: nothing written yet
    threading.Timer(0.2, gate.open).start()
    if how == "flush":
        cap.flush()
    elif how == "disable":
        cap.disable()
    else:
        manual_step(cap, torch.full((4,), 3.0), wait=True)
    assert cap.pending_steps == 0
    n = 4 if how == "wait" else 3
    assert sorted(steps_on_disk(tmp_path)) == [f"prefill_s4_{i}" for i in range(n)]
    for i in range(n):
        got = load_file(str(tmp_path / "dp0" / f"prefill_s4_{i}" / "x" / "rank0.safetensors"))["0"]
        assert torch.equal(got, torch.full((4,), float(i)))


def test_auto_steps_exit_waits_for_every_step(tmp_path, monkeypatch, writer):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    cap = ModelCapture(compiled, modules=["layers.0"], capture_dir=tmp_path, staging={"writer": writer})
    cap.enable()
    compiled(*inputs)  # compile outside the held writer
    gate = Gate(monkeypatch, cap)
    with cap.auto_steps() as auto:
        for _ in range(3):
            compiled(*inputs)
        assert cap.pending_steps == 3 and steps_on_disk(tmp_path) == {}  # written behind: held
        threading.Timer(0.2, gate.open).start()
    assert cap.pending_steps == 0 and len(steps_on_disk(tmp_path)) == 3 and auto.steps == 3


_EXIT_SCRIPT = """
import os, signal, sys, threading, time, torch
from graphpass import ModelCapture
from graphpass.capturing.ops import capture_tensor
from graphpass.capturing.writer import CaptureWriter
from graphpass.models.corpus import build

model, _ = build("mlp_stack")
cap = ModelCapture(model, modules=["layers.0"], capture_dir=sys.argv[1], staging={"writer": sys.argv[2]})
if sys.argv[2] == "thread":
    real = CaptureWriter.write_reserved
    def slow(self, *a, **k):
        time.sleep(0.3)
        return real(self, *a, **k)
    CaptureWriter.write_reserved = slow
else:  # the writer process is held until a second after the script ends
    with cap._behind._cond:
        cap._behind._start()
    os.kill(cap._behind._proc.pid, signal.SIGSTOP)
    threading.Timer(1.0, os.kill, (cap._behind._proc.pid, signal.SIGCONT)).start()
cap.enable()
for i in range(4):
    with cap.step(is_prefill=True, positions=torch.arange(2), wait=False):
        capture_tensor("x", torch.full((2,), float(i)))
print("staged", cap.pending_steps, flush=True)
{ending}
"""


def assert_four_steps(root: Path) -> None:
    assert sorted(steps_on_disk(root)) == [f"prefill_s2_{i}" for i in range(4)]
    for i in range(4):
        got = load_file(str(root / "dp0" / f"prefill_s2_{i}" / "x" / "rank0.safetensors"))["0"]
        assert torch.equal(got, torch.full((2,), float(i)))
    assert not [f for f in files_under(root) if atomic_files.is_temp_name(Path(f).name)]


@pytest.mark.parametrize(
    "ending",
    [
        "pass",
        "raise KeyboardInterrupt",
        "raise RuntimeError('boom')",
        "with cap.step(is_prefill=True, positions=torch.arange(2), wait=False):\n"
        "    capture_tensor('x', torch.ones(2)); raise KeyboardInterrupt",
    ],
)
def test_interpreter_exit_exception_or_ctrl_c_loses_no_completed_step(tmp_path, ending, writer, forks):
    script = _EXIT_SCRIPT.replace("{ending}", ending)
    rc, out, err = forks.run(script, tmp_path, writer, timeout=300)
    assert rc != "hang" and "staged" in out, (rc, err[-3000:])
    assert int(out.split()[1]) >= 2  # most of the steps were still staged when the script ended
    assert_four_steps(tmp_path)


def test_ctrl_c_to_the_process_group_is_ignored_by_the_writer_process(tmp_path, forks):
    """The terminal sends Ctrl-C to every process of the foreground group, the writer process
    included: it ignores it, and writes every step staged before the interrupt."""
    # A terminal's Python program: Ctrl-C raises KeyboardInterrupt. Python installs that handler only
    # when SIGINT was not ignored at its start, and a shell ignores SIGINT in what it runs in the
    # background (`.ci/run &`): the script sets it itself.
    script = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n" + _EXIT_SCRIPT.replace(
        "{ending}", "for _ in range(1200):\n    time.sleep(0.1)"
    )
    proc = forks.spawn(script, tmp_path, "process", new_session=True)
    assert proc.readline().startswith("staged"), proc.stderr()
    os.killpg(proc.pid, signal.SIGINT)  # the saving process's group (its writer process has its own session)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(60)
        pytest.fail(f"the saving process outlived its Ctrl-C: {proc.stderr()[-2000:]}")
    err = proc.stderr()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert_four_steps(tmp_path)


def test_steps_staged_before_the_saving_process_is_killed_are_still_written(tmp_path, forks):
    """SIGKILL: no exit handler runs in the saving process; its writer process sees its input end
    and writes every step it was sent."""
    script = _EXIT_SCRIPT.replace("{ending}", "print('writer', cap._behind._proc.pid, flush=True); time.sleep(120)")
    proc = forks.spawn(script, tmp_path, "process")
    assert proc.readline().startswith("staged"), proc.stderr()
    child = int(proc.readline(line=1).split()[1])
    proc.kill()
    proc.wait(60)
    os.kill(child, signal.SIGCONT)  # its timer died with it
    for _ in range(600):
        if len(steps_on_disk(tmp_path)) == 4:
            break
        time.sleep(0.1)
    assert_four_steps(tmp_path)


# --- a background write that fails: rolled back, reported on the saving side ------------------------


def test_failed_background_write_leaves_nothing_and_is_raised_by_flush(tmp_path, monkeypatch):
    import errno

    calls = {"n": 0}
    real = atomic_files.write_all

    def full(fd, data):
        calls["n"] += 1
        if calls["n"] == 3:  # step 0: file + meta land; step 1's first file hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(atomic_files, "write_all", full)
    cap = manual_capture(tmp_path, "thread")  # the failure is injected into this process's writes
    for i in range(3):
        manual_step(cap, torch.full((2,), float(i)))
    with pytest.raises(CaptureError, match="No space left") as info:
        cap.flush()
    assert "in the background" in str(info.value) and isinstance(info.value, GraphpassError)
    assert sorted(steps_on_disk(tmp_path)) == ["prefill_s2_0", "prefill_s2_2"]  # step 1 rolled back, a gap
    assert not (tmp_path / "dp0" / "prefill_s2_1").exists()
    assert not [f for f in files_under(tmp_path) if atomic_files.is_temp_name(Path(f).name)]
    cap.flush()  # reported once


def test_a_step_the_writer_process_cannot_write_is_rolled_back_and_raised_by_flush(tmp_path):
    (tmp_path / "dp0").mkdir()
    (tmp_path / "dp0" / "prefill_s2_1").write_text("not a folder")  # step 1's folder: a file is there
    cap = manual_capture(tmp_path, "process")
    for i in range(3):
        manual_step(cap, torch.full((2,), float(i)))
    with pytest.raises(CaptureError, match="prefill_s2_1") as info:
        cap.flush()
    assert "in the background" in str(info.value) and "earlier run" in str(info.value)
    assert sorted(steps_on_disk(tmp_path)) == ["prefill_s2_0", "prefill_s2_2"]
    assert not [f for f in files_under(tmp_path) if atomic_files.is_temp_name(Path(f).name)]
    cap.flush()  # reported once


def test_a_writer_process_that_dies_loses_only_the_steps_it_held_and_says_so(tmp_path, monkeypatch):
    cap = manual_capture(tmp_path, "process")
    gate = Gate(monkeypatch, cap)
    manual_step(cap, torch.zeros(2))
    manual_step(cap, torch.ones(2))
    os.kill(cap._behind._proc.pid, signal.SIGKILL)
    with pytest.raises(CaptureError, match=r"writer process exited .*before writing this step"):
        cap.flush()
    assert steps_on_disk(tmp_path) == {} and cap.pending_steps == 0
    manual_step(cap, torch.full((2,), 2.0))  # a new writer process takes the next step
    cap.flush()
    assert sorted(steps_on_disk(tmp_path)) == ["prefill_s2_2"]
    del gate


def test_a_writer_process_that_dies_between_steps_is_replaced_not_waited_for(tmp_path):
    cap = manual_capture(tmp_path, "process")
    manual_step(cap, torch.zeros(2))
    cap.flush()
    behind = cap._behind
    os.kill(behind._proc.pid, signal.SIGKILL)  # idle: no step in flight
    behind._thread.join(60)  # its reply thread sees the end of the writer's output
    manual_step(cap, torch.ones(2))
    done = threading.Thread(target=cap.flush)
    done.start()
    done.join(60)
    assert not done.is_alive()  # before the fix: the step went down a dead pipe and flush never returned
    assert sorted(steps_on_disk(tmp_path)) == ["prefill_s2_0", "prefill_s2_1"]


def test_a_step_sent_to_a_writer_process_that_just_died_is_refused_and_the_next_is_written(tmp_path):
    cap = manual_capture(tmp_path, "process")
    manual_step(cap, torch.zeros(2))
    cap.flush()
    behind = cap._behind
    proc = behind._proc
    os.kill(proc.pid, signal.SIGKILL)
    behind._thread.join(60)
    with behind._cond:  # as if its reply thread had not seen the end yet: the write finds a broken pipe
        behind._proc = proc
    with pytest.raises(CaptureError, match="writer process is gone"):
        manual_step(cap, torch.ones(2))
    assert cap.pending_steps == 0 and behind._ring.place(100) == 0  # nothing held for the refused step
    manual_step(cap, torch.full((2,), 2.0))
    cap.flush()
    assert sorted(steps_on_disk(tmp_path)) == ["prefill_s2_0", "prefill_s2_2"]


def test_a_forked_process_never_writes_into_its_parents_ring(tmp_path, monkeypatch):
    cap = manual_capture(tmp_path, "process")
    gate = Gate(monkeypatch, cap)
    manual_step(cap, torch.zeros(2))
    manual_step(cap, torch.ones(2))
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's is pending here; its own step gets its own writer
        code = 1
        try:
            if cap.pending_steps == 0 and cap._behind._ring is None:
                cap.flush()  # returns at once: no parent step to wait for
                cap.writer.capture_dir = tmp_path / "child"
                cap.writer._files = type(cap.writer._files)(tmp_path / "child", 0)
                cap.writer._routes.clear()
                (tmp_path / "child").mkdir()
                manual_step(cap, torch.full((2,), 7.0))
                cap.flush()
                code = 0 if list(steps_on_disk(tmp_path / "child")) == ["prefill_s2_2"] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    gate.open()
    cap.flush()
    assert sorted(steps_on_disk(tmp_path / "dp0")) == ["prefill_s2_0", "prefill_s2_1"]
    got = load_file(str(tmp_path / "dp0" / "prefill_s2_1" / "x" / "rank0.safetensors"))["0"]
    assert torch.equal(got, torch.ones(2))


def test_failed_background_write_is_raised_by_the_next_save(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(13, "Permission denied")

    cap = manual_capture(tmp_path, "thread")  # the failure is injected into this process's writes
    monkeypatch.setattr(atomic_files, "write_all", broken)
    manual_step(cap, torch.ones(2))
    cap._behind.wait_idle()
    monkeypatch.undo()
    with pytest.raises(CaptureError, match="Permission denied"):
        manual_step(cap, torch.ones(2))
    cap.flush()  # the second step was staged before the error was raised: it is written
    assert sorted(steps_on_disk(tmp_path)) == ["prefill_s2_1"]


# --- memory bound and the policy when the writer falls behind ---------------------------------------


def test_block_policy_waits_for_room_and_never_exceeds_the_bound(tmp_path, monkeypatch, writer):
    step_bytes = 16 * 4
    cap = manual_capture(tmp_path, writer, max_staged_bytes=2 * step_bytes)
    gate = Gate(monkeypatch, cap)
    manual_step(cap, torch.zeros(16))
    manual_step(cap, torch.ones(16))  # the ring is full now (2 steps, 128 bytes)
    third = threading.Thread(target=manual_step, args=(cap, torch.full((16,), 2.0)))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # blocked: the writer is held, the ring full
    assert cap.pending_steps == 2
    gate.open()
    third.join(60)
    assert not third.is_alive()
    cap.flush()
    assert cap._behind.peak_bytes <= 2 * step_bytes and cap.dropped_steps == 0
    assert sorted(steps_on_disk(tmp_path)) == ["prefill_s16_0", "prefill_s16_1", "prefill_s16_2"]


def test_block_policy_writes_a_step_larger_than_the_bound_in_place(tmp_path, monkeypatch, writer):
    cap = manual_capture(tmp_path, writer, max_staged_bytes=8)
    manual_step(cap, torch.zeros(2))  # 8 bytes: staged
    manual_step(cap, torch.zeros(16))  # 64 bytes: waits for the ring to empty, written by the caller
    assert cap._behind.peak_bytes <= 8
    assert sorted(steps_on_disk(tmp_path)) == ["prefill_s16_1", "prefill_s2_0"]  # k counts per phase


def test_step_count_bound(tmp_path, monkeypatch, writer):
    cap = manual_capture(tmp_path, writer, max_staged_steps=1, when_full="drop")
    gate = Gate(monkeypatch, cap)
    manual_step(cap, torch.zeros(2))
    manual_step(cap, torch.zeros(2))
    assert cap.pending_steps == 1 and cap.dropped_steps == 1
    gate.open()
    cap.flush()


def test_drop_policy_counts_logs_and_keeps_later_names(tmp_path, monkeypatch, caplog, writer):
    cap = manual_capture(tmp_path, writer, max_staged_bytes=16, when_full="drop")
    gate = Gate(monkeypatch, cap)
    with caplog.at_level(logging.WARNING, logger="graphpass.capturing"):
        for i in range(4):  # 8 bytes each: two fit, two are dropped (the writer is held)
            manual_step(cap, torch.full((2,), float(i)))
    assert cap.dropped_steps == 2
    assert "prefill_s2_2 dropped" in caplog.text
    gate.open()
    cap.flush()
    manual_step(cap, torch.full((2,), 4.0), wait=True)
    metas = steps_on_disk(tmp_path)
    assert sorted(metas) == ["prefill_s2_0", "prefill_s2_1", "prefill_s2_4"]  # the dropped names stay gaps
    assert metas["prefill_s2_4"]["dropped_steps"] == 2 and metas["prefill_s2_4"]["step_index"] == 4
    assert cap._behind.peak_bytes <= 16


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_staged_bytes", -1),
        ("max_staged_bytes", 1.5),
        ("max_staged_bytes", True),
        ("max_staged_steps", 0),
        ("when_full", "grow"),
    ],
)
def test_staging_options_are_checked(tmp_path, field, value):
    with pytest.raises(ConfigError) as info:
        StagingConfig(**{field: value})
    assert info.value.key == field
    model, _ = build("mlp_stack")
    with pytest.raises(ConfigError, match=field):
        ModelCapture(model, modules=["layers.0"], capture_dir=tmp_path, staging={field: value})
    with pytest.raises(ConfigError, match="staging"):
        ModelCapture(model, modules=["layers.0"], capture_dir=tmp_path, staging={"max_bytes": 1})


# --- capture sites resolved once, per ModelCapture ----------------------------------------------------


def test_owner_names_are_resolved_once_per_site_not_per_step(tmp_path, monkeypatch):
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend="graphpass", options={"then": "eager"})
    cap = ModelCapture(compiled, modules=["layers.0-1"], capture_dir=tmp_path)
    cap.enable()
    compiled(*inputs)
    builds = {"n": 0}
    real = registry_mod.owned_tensors

    def counted(m):
        builds["n"] += 1
        return real(m)

    monkeypatch.setattr(registry_mod, "owned_tensors", counted)
    for _ in range(4):
        with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]):
            compiled(*inputs)
    assert builds["n"] == 1  # the first step builds the weight table; later steps reuse the sites
    # a weight swapped between steps: the cached site no longer matches, the full look-up runs again
    for layer in model.layers[:2]:
        for fc in (layer.fc1, layer.fc2):
            fc.weight = torch.nn.Parameter(fc.weight.detach() * 2)
    with cap.step(is_prefill=False, req_ids=["a", "b", "c", "d"]):
        compiled(*inputs)
    assert builds["n"] == 2
    step = tmp_path / "dp0" / "decode_b4_4"
    assert sorted(p.name for p in step.iterdir() if p.is_dir()) == ["layers.0", "layers.1"]
    for name, t in eager_outputs(model, inputs[0], ["layers.0", "layers.1"]).items():
        torch.testing.assert_close(load_file(str(step / name / "rank0.safetensors"))["output"], t, rtol=0, atol=0)


def test_two_instances_sharing_a_graph_keep_their_names_step_after_step(tmp_path):
    first, x1 = build("mlp_stack", seed=1)
    second, x2 = build("mlp_stack", seed=2)
    c1 = torch.compile(first, backend="graphpass", options={"then": "eager"})
    c2 = torch.compile(second, backend="graphpass", options={"then": "eager"})
    cap1 = ModelCapture(c1, modules=["layers.0"], capture_dir=tmp_path / "one")
    cap2 = ModelCapture(c2, modules=["layers.1"], capture_dir=tmp_path / "two")
    cap1.enable()
    cap2.enable()
    for _ in range(3):  # warm site caches, alternating: each capture keeps only its model's values
        with cap1.step(is_prefill=False, req_ids=list("abcd"), wait=False):
            c1(*x1)
            c2(*x2)
        with cap2.step(is_prefill=False, req_ids=list("abcd"), wait=False):
            c2(*x2)
            c1(*x1)
    cap1.flush()
    cap2.flush()
    want1 = eager_outputs(first, x1[0], ["layers.0"])["layers.0"]
    want2 = eager_outputs(second, x2[0], ["layers.1"])["layers.1"]
    for i in range(3):
        one = load_file(str(tmp_path / "one" / "dp0" / f"decode_b4_{i}" / "layers.0" / "rank0.safetensors"))
        two = load_file(str(tmp_path / "two" / "dp0" / f"decode_b4_{i}" / "layers.1" / "rank0.safetensors"))
        assert list(one) == ["output"] and list(two) == ["output"]  # one value each: the other model's went nowhere
        torch.testing.assert_close(one["output"], want1, rtol=0, atol=0)
        torch.testing.assert_close(two["output"], want2, rtol=0, atol=0)


# --- the writer's own safetensors encoding: what safetensors reads back --------------------------------


def test_encoded_files_read_back_with_safetensors_for_every_common_dtype():
    from safetensors.torch import load, save

    from graphpass.capturing.writer import encode_safetensors

    g = torch.Generator().manual_seed(0)
    payload = {
        "[0]": torch.randn(2, 3, generator=g),
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, generator=g).half(),
        "f64": torch.randn(2, generator=g).double(),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(6).reshape(2, 3),
        "i32": torch.arange(3, dtype=torch.int32),
        "u8": torch.arange(7, dtype=torch.uint8),
        "i8": -torch.arange(3, dtype=torch.int8),
        "i16": torch.arange(3, dtype=torch.int16),
        "fp8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
    }
    blob = encode_safetensors(payload)  # fp8 is not in the writer's table: safetensors' own save
    back = load(blob)
    assert set(back) == set(payload)
    for k, t in payload.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    plain = {k: v for k, v in payload.items() if k != "fp8"}
    blob = encode_safetensors(plain)
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    assert (8 + n) % 8 == 0
    for k, entry in header.items():  # every tensor's bytes start aligned to its element size
        assert entry["data_offsets"][0] % plain[k].element_size() == 0, k
    ours, theirs = load(blob), load(save(plain))
    assert all(torch.equal(ours[k], theirs[k]) for k in plain)


@pytest.mark.parametrize("seed", range(5))
def test_staging_ring_takes_and_gives_back_first_in_first_out_and_never_overlaps(seed):
    import random

    from graphpass.capturing.staging import StagingRing

    rng = random.Random(seed)
    ring = StagingRing(100)
    live: list[tuple[int, int]] = []
    placed = refused = 0
    try:
        for _ in range(2000):
            if rng.random() < 0.55:
                n = rng.randint(1, 40)
                start = ring.place(n)
                if start is None:
                    refused += 1
                    assert live  # an empty ring always has room for n <= capacity
                    continue
                assert 0 <= start and start + n <= 100
                assert not any(s < start + n and start < e for s, e in live)  # never over a live region
                assert ring.take(n) == start
                live.append((start, start + n))
                placed += 1
            elif live:
                ring.give_back()
                live.pop(0)
        assert placed > 500 and refused > 50  # both paths exercised
    finally:
        ring.close()
