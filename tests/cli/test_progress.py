"""Progress bars: shown on a terminal (or GRAPHPASS_PROGRESS=1), silent otherwise."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import graphpass
from graphpass import progress


def _captures(root, steps=3):
    for side in ("ref", "test"):
        for k in range(steps):
            step = root / side / "dp0" / f"prefill_s4_{k}"
            (step / "layers.0").mkdir(parents=True)
            save_file({"0": torch.ones(4)}, str(step / "layers.0" / "rank0.safetensors"))
            (step / f"prefill_s4_{k}_meta.json").write_text(json.dumps({"modules": ["layers.0"]}))
    return root / "ref", root / "test"


def test_compare_shows_progress_only_when_asked(tmp_path, monkeypatch, capsys):
    ref, test = _captures(tmp_path)
    monkeypatch.delenv("GRAPHPASS_PROGRESS", raising=False)
    assert not progress.enabled()  # pytest's stderr is not a terminal
    assert graphpass.compare(ref, test).passed
    assert "graphpass compare" not in capsys.readouterr().err
    monkeypatch.setenv("GRAPHPASS_PROGRESS", "1")
    assert graphpass.compare(ref, test).passed
    err = capsys.readouterr().err
    assert "graphpass compare" in err and "/3" in err  # a bar over the 3 steps
    monkeypatch.setenv("GRAPHPASS_PROGRESS", "0")
    graphpass.compare(ref, test)
    assert capsys.readouterr().err == ""


def _recording_bars(monkeypatch) -> list:
    """Every bar made through graphpass.progress.bar from now on (the real ones: they still print)."""
    made = []
    real = progress.bar

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(progress, "bar", spy)
    return made


def _offload_bars(made, what):
    return [b for b in made if getattr(b, "desc", "").startswith(f"graphpass offload: {what}")]


def test_offload_shows_bytes_written_to_its_file(tmp_path, monkeypatch, capsys):
    from tqdm import tqdm

    from graphpass.models.corpus import build
    from graphpass.offloading.safetensors_io import read_header

    model, _ = build("mlp_stack")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setenv("GRAPHPASS_PROGRESS", "1")
    made = _recording_bars(monkeypatch)
    state = graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=tmp_path / "w"))
    (written,) = state.files
    file_bytes = sum(loc.nbytes for loc in read_header(written).values())
    assert file_bytes > 0
    (shown,) = _offload_bars(made, "writing")
    assert shown.desc == f"graphpass offload: writing {Path(written).name}"
    assert shown.total == shown.n == file_bytes  # one bar, every tensor byte of the file counted
    assert not _offload_bars(made, "reading")  # no checkpoint: nothing read
    err = capsys.readouterr().err
    assert f"graphpass offload: writing {Path(written).name}" in err
    assert tqdm.format_sizeof(file_bytes, divisor=1024) in err  # the bar's total, in bytes
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())  # progress changes no result


def _checkpoint(tmp_path):
    from graphpass.models.corpus import build

    model, _ = build("mlp_stack")
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model, path


def test_offload_shows_checkpoint_bytes_read(tmp_path, monkeypatch, capsys):
    from graphpass.models.corpus import build
    from graphpass.offloading.safetensors_io import read_header

    source, path = _checkpoint(tmp_path)
    model, _ = build("mlp_stack", seed=1)  # other weights: the checkpoint's must be read in
    monkeypatch.setenv("GRAPHPASS_PROGRESS", "1")
    made = _recording_bars(monkeypatch)
    graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="cpu"), checkpoint=path)
    (shown,) = _offload_bars(made, "reading checkpoint")
    assert shown.total == shown.n == sum(loc.nbytes for loc in read_header(path).values())
    assert "graphpass offload: reading checkpoint" in capsys.readouterr().err
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in source.state_dict().items())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_offload_is_silent_when_off(tmp_path, monkeypatch, capsys):
    from graphpass.models.corpus import build

    _, path = _checkpoint(tmp_path)
    monkeypatch.delenv("GRAPHPASS_PROGRESS", raising=False)  # pytest's stderr is not a terminal
    graphpass.offload(
        build("mlp_stack")[0], graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=tmp_path / "a")
    )
    graphpass.offload(build("mlp_stack")[0], graphpass.OffloadConfig(device="cpu", storage="cpu"), checkpoint=path)
    assert capsys.readouterr().err == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setenv("GRAPHPASS_PROGRESS", "0")  # off even on a terminal
    graphpass.offload(
        build("mlp_stack")[0], graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=tmp_path / "b")
    )
    graphpass.offload(build("mlp_stack")[0], graphpass.OffloadConfig(device="cpu", storage="cpu"), checkpoint=path)
    assert terminal.getvalue() == ""
    monkeypatch.delenv("GRAPHPASS_PROGRESS")  # a terminal, no setting: shown
    graphpass.offload(
        build("mlp_stack")[0], graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=tmp_path / "c")
    )
    assert "graphpass offload: writing" in terminal.getvalue()


def _conformance_module():
    path = Path(__file__).resolve().parents[2] / "bench" / "conformance.py"
    spec = importlib.util.spec_from_file_location("graphpass_bench_conformance_progress", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_conformance_shows_a_bar_over_architectures_only_when_asked(monkeypatch, capsys):
    conformance = _conformance_module()

    def run_one(arch):
        return {"arch": arch, "cells": {"eager": "pass" if arch != "b" else "FAIL: boom"}, "wall_s": 0.5}

    lines = [
        f"[  1/3] {'a':28s}    0.5s  ok",
        f"[  2/3] {'b':28s}    0.5s  eager: FAIL: boom",
        f"[  3/3] {'c':28s}    0.5s  ok",
    ]
    monkeypatch.setenv("GRAPHPASS_PROGRESS", "1")
    made = _recording_bars(monkeypatch)
    results = conformance.run_all(["a", "b", "c"], run_one, ["eager"], jobs=1)
    assert list(results) == ["a", "b", "c"] and results["b"]["cells"]["eager"] == "FAIL: boom"
    out, err = capsys.readouterr()
    assert out.splitlines() == lines  # the per-architecture lines are unchanged by the bar
    assert "graphpass conformance" in err and "/3" in err
    (shown,) = made
    assert shown.total == shown.n == 3
    monkeypatch.setenv("GRAPHPASS_PROGRESS", "0")
    conformance.run_all(["a", "b", "c"], run_one, ["eager"], jobs=2)
    out, err = capsys.readouterr()
    assert err == "" and sorted(out.splitlines(), key=lambda s: s[8:]) == sorted(lines, key=lambda s: s[8:])
