"""Progress bars: shown on a terminal (or GRAPHPASS_PROGRESS=1), silent otherwise."""

from __future__ import annotations

import json

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
