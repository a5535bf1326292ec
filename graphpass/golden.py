"""Normalized text renderings of transformed graphs, for the golden files in ``golden/``.

A rendering holds no file paths, line numbers, object ids or memory addresses, so it is stable
across machines and runs for one torch version. ``make golden`` re-accepts every golden after a
deliberate change (``GRAPHPASS_ACCEPT_GOLDEN=1``); read the diff before committing it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

ACCEPT_ENV = "GRAPHPASS_ACCEPT_GOLDEN"

_ADDR = re.compile(r"0x[0-9a-fA-F]{6,}")
_FILE = re.compile(r"(File \"?)[^\"\n,]+")
_LINENO = re.compile(r"line \d+")


def normalize(text: str) -> str:
    """Drop comments, file paths, line numbers and addresses; strip trailing space."""
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        line = _ADDR.sub("0x?", line)
        line = _FILE.sub(r"\1<file>", line)
        line = _LINENO.sub("line ?", line)
        out.append(line.rstrip())
    while out and not out[-1]:
        out.pop()
    return "\n".join(out).strip("\n") + "\n"


def render_code(gm: torch.fx.GraphModule) -> str:
    return normalize(gm.code)


def render_ownership(record) -> str:
    """What the analysis passes found in one :class:`graphpass.dynamo_backend.CompiledGraph`: every
    tensor input with its FQNs, kind, owners and traps, then every trap."""
    a = record.analysis
    lines = [f"graph {record.index}"]
    lines.append("tensors:")
    for t in a.tensors.values():
        aliases = ", ".join(t.fqns)
        lines.append(
            f"  {t.node}: {aliases} [{t.kind}] {t.dtype}{list(t.shape)} {t.nbytes}B "
            f"holders={t.holders} consumers={t.consumers} traps={t.traps}"
            + (f" parent={t.parent}" if t.parent else "")
        )
    lines.append(f"traps (container {a.trap_container!r}):")
    for trap in a.traps.values():
        lines.append(
            f"  {trap.label}{' manual' if trap.manual else ''}: {len(trap.nodes)} ops "
            f"{trap.first_node}..{trap.last_node}, {len(trap.tensors)} tensors, {trap.nbytes}B"
        )
    return normalize("\n".join(lines))


def check_golden(path: Path, actual: str) -> None:
    """Compare ``actual`` to the golden file; with ``GRAPHPASS_ACCEPT_GOLDEN=1`` write it instead."""
    path = Path(path)
    if os.environ.get(ACCEPT_ENV) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(actual)
        tmp.replace(path)
        return
    if not path.exists():
        raise AssertionError(f"golden file {path} is missing; run `make golden` to record it")
    expected = path.read_text()
    if expected != actual:
        import difflib

        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(True), actual.splitlines(True), fromfile=str(path), tofile="actual", n=2
            )
        )
        raise AssertionError(f"graph differs from golden {path} (re-accept with `make golden`):\n{diff[:8000]}")
