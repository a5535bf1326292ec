"""Offload under hostile or faulty conditions: planted links, files written by graphpass."""

from __future__ import annotations

import os

import torch

import graphpass
from graphpass import atomic_files
from graphpass.models.corpus import build


def test_offload_file_never_written_through_a_planted_symlink(tmp_path, monkeypatch):
    """A link planted at the temporary name graphpass picks (forced here) is not followed; the
    weights file lands under its own name and the link's target is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "weights"
    folder.mkdir()
    os.symlink(victim, folder / ".graphpass-planted.tmp")

    def names():
        yield ".graphpass-planted.tmp"
        while True:
            yield f".graphpass-{os.urandom(6).hex()}.tmp"

    monkeypatch.setattr(atomic_files, "temp_names", names)
    torch._dynamo.reset()
    model, inputs = build("mlp_stack")
    model.eval().requires_grad_(False)
    ref = model(*inputs)
    state = graphpass.offload(model, graphpass.OffloadConfig(device="cpu", storage="disk", disk_path=folder))
    assert victim.read_text() == "precious"
    assert len(state.files) == 1 and os.path.isfile(state.files[0]) and not os.path.islink(state.files[0])
    compiled = torch.compile(model, backend=graphpass.backend(then="aot_eager"))
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), ref)
