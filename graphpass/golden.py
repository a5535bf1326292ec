"""Normalized text renderings of transformed graphs, for the golden files in ``golden/`` and for
golden-graph tests of users' own models (:mod:`graphpass.testing`, ``graphpass golden``).

A rendering holds no file paths, line numbers, object ids or memory addresses, so it is stable
across machines and runs for one torch version. ``make golden`` re-accepts every golden after a
deliberate change (``GRAPHPASS_ACCEPT_GOLDEN=1``); read the diff before committing it.

Two levels (docs/golden.md):

* the exact rendering (``<name>.txt``), checked only on the torch release it was recorded with,
  which its sidecar ``<name>.meta.json`` names (``{"torch": ..., "graphpass": ...}``); another
  release (``2.9``) may have its own, ``<name>.torch2.9.txt`` beside it where its Dynamo renders the
  graph differently, or only ``<name>.torch2.9.meta.json`` where the main file holds for it too
  (recorded with ``GRAPHPASS_ACCEPT_GOLDEN=release``);
* the structural summary (``<name>.summary.json``, :func:`summarize`): each FQN's traps, loads,
  evictions and capture nodes per trap, the schedule's load order, the number of graphs. It does
  not depend on Dynamo's node names, so it is checked on every torch version.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

import torch

from .fx_utils import graphpass_op_name

ACCEPT_ENV = "GRAPHPASS_ACCEPT_GOLDEN"
RELEASE = "release"  # accept mode: record the running torch release's exact goldens beside the main ones

_ADDR = re.compile(r"0x[0-9a-fA-F]{6,}")
_MODEL_KEY = re.compile(r"model = \d+")
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
        line = _MODEL_KEY.sub("model = ?", line)  # a trap boundary's key of its model (an id)
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
            f"holders={t.holders} consumers={t.consumers} traps={t.traps}" + (f" parent={t.parent}" if t.parent else "")
        )
    lines.append(f"traps (container {a.trap_container!r}):")
    for trap in a.traps.values():
        lines.append(
            f"  {trap.label}{' manual' if trap.manual else ''}: {len(trap.nodes)} ops "
            f"{trap.first_node}..{trap.last_node}, {len(trap.tensors)} tensors, {trap.nbytes}B"
        )
    return normalize("\n".join(lines))


def render_schedule(record) -> list[str]:
    """The offload schedule of one graph (peak, prefetch, per group: bytes, FQNs, anchors); [] without one."""
    sched = record.analysis.offload
    if sched is None:
        return []
    lines = [f"schedule peak {sched.peak_streamed_bytes}B, prefetch {sched.prefetch_distance}"]
    for grp in sched.groups:
        lines.append(
            f"  {grp.label}: {grp.nbytes}B {grp.fqns} start<{grp.start_before} wait<{grp.wait_before} "
            f"evict>{grp.evict_after}"
        )
    return lines


def render_model(graphs: Iterable) -> str:
    """The exact rendering of every graph of a model: ownership and traps, the offload schedule when
    the model is offloaded, and the rewritten code (trap boundaries, loads, evictions, capture nodes)."""
    parts = []
    for g in graphs:
        parts.append(f"=== graph {g.index} ===")
        parts.append(render_ownership(g))
        parts.extend(render_schedule(g))
        parts.append(render_code(g.gm))
    return normalize("\n".join(parts))


# --- the structural summary ---------------------------------------------------------------------

OUTSIDE = "(outside traps)"  # capture nodes, loads or evictions that sit in no trap region


def summarize(graphs: Iterable) -> dict[str, Any]:
    """What must hold on every torch version: ``graphs`` (how many), ``schedule`` (trap labels in load
    order), ``traps`` (per trap: ``loads``, ``evictions``, ``captures``) and ``fqn_traps`` (each
    weight's FQN -> the traps that read it, in graph order)."""
    graphs = list(graphs)
    traps: dict[str, dict[str, int]] = {}
    schedule: list[str] = []
    fqn_traps: dict[str, list[str]] = {}

    def count(label: str, what: str) -> None:
        traps.setdefault(label, {"loads": 0, "evictions": 0, "captures": 0})[what] += 1

    for g in graphs:
        for label in g.analysis.traps:
            traps.setdefault(label, {"loads": 0, "evictions": 0, "captures": 0})
        for t in g.analysis.tensors.values():
            if t.kind == "input":
                continue
            for fqn in t.fqns:
                seen = fqn_traps.setdefault(fqn, [])
                seen.extend(label for label in t.traps if label not in seen)
        open_traps: list[str] = []
        for node in g.gm.graph.nodes:
            op = graphpass_op_name(node)
            if op == "trap_enter":
                open_traps.append(node.args[0])
            elif op == "trap_exit" and open_traps:
                open_traps.pop()
            elif op == "load_start":
                schedule.append(node.args[1])
                count(node.args[1], "loads")
            elif op == "evict":
                count(node.args[2], "evictions")
            elif op == "capture":
                count(open_traps[-1] if open_traps else OUTSIDE, "captures")
    return {
        "graphs": len(graphs),
        "schedule": schedule,
        "traps": traps,
        "fqn_traps": {k: fqn_traps[k] for k in sorted(fqn_traps)},
    }


def summary_text(summary: dict[str, Any]) -> str:
    """JSON with one line per top-level key, and per entry of a top-level object (a trap, an FQN),
    so a diff shows exactly which trap or weight changed."""
    lines = []
    for i, (key, value) in enumerate(summary.items()):
        comma = "," if i < len(summary) - 1 else ""
        if isinstance(value, dict) and value:
            inner = [f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
            lines.append(f"  {json.dumps(key)}: {{\n" + ",\n".join(inner) + f"\n  }}{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    return "{\n" + "\n".join(lines) + "\n}\n"


# --- golden files: check or accept --------------------------------------------------------------

ACCEPT_HINT = (
    "re-accept with `--graphpass-accept-golden` (pytest), GRAPHPASS_ACCEPT_GOLDEN=1 or `graphpass golden ... --accept`"
)


class GoldenMismatch(AssertionError):
    """A rendering or summary differs from its golden file (the message holds a unified diff)."""


def accept_from_env() -> bool | str:
    """``GRAPHPASS_ACCEPT_GOLDEN``: ``1`` -> True (write the goldens), ``release`` -> :data:`RELEASE`
    (write the running torch release's exact goldens beside the main ones), anything else -> False."""
    value = os.environ.get(ACCEPT_ENV)
    return RELEASE if value == RELEASE else value == "1"


def accept_mode(accept: bool | str | None) -> bool | str:
    """``accept`` checked: True, False or :data:`RELEASE`; None reads :func:`accept_from_env`."""
    if accept is None:
        return accept_from_env()
    if isinstance(accept, bool) or accept == RELEASE:
        return accept
    from .errors import ConfigError

    raise ConfigError("accept", accept, f"expected True, False, None or {RELEASE!r}")


def release_path(path: str | os.PathLike, version: str | None = None) -> Path:
    """``dir/name.txt`` -> ``dir/name.torch2.9.txt``: the exact golden of one torch release
    (``major.minor`` of ``version``, default the running torch), kept where that release renders the
    graph differently from the main golden; its sidecar is ``dir/name.torch2.9.meta.json``."""
    path = Path(path)
    major, minor = torch_release(torch.__version__ if version is None else version).split(".")[:2]
    return path.with_name(f"{path.stem}.torch{major}.{minor}{path.suffix}")


def is_release_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a release's golden (``name.torch2.9.txt``) rather than a main one."""
    return re.search(r"\.torch\d+\.\d+$", Path(path).stem) is not None


def meta_path(path: str | os.PathLike) -> Path:
    """``dir/name.txt`` -> ``dir/name.meta.json``: the versions the exact rendering was recorded with."""
    path = Path(path)
    return path.with_name(f"{path.stem}.meta.json")


def torch_release(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: local build tags (cpu, cu128) do not change the graphs."""
    return str(version).split("+", 1)[0]


def _write(path: Path, text: str) -> None:
    from .atomic_files import write_bytes_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, text.encode("utf-8"))


def diff_text(expected: str, actual: str, path: str | os.PathLike, limit: int = 8000) -> str:
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(True), actual.splitlines(True), fromfile=f"{path} (golden)", tofile="actual", n=2
        )
    )
    return diff if len(diff) <= limit else diff[:limit] + f"\n... ({len(diff) - limit} more characters of diff)\n"


def _compare_text(path: Path, expected: str, actual: str, what: str, hint: str) -> None:
    if expected != actual:
        raise GoldenMismatch(f"{what} differs from golden {path} ({hint}):\n{diff_text(expected, actual, path)}")


def record_meta(path: str | os.PathLike) -> dict[str, str]:
    import graphpass

    meta = {"torch": torch.__version__, "graphpass": graphpass.__version__}
    _write(meta_path(path), json.dumps(meta, indent=2) + "\n")
    return meta


def check_exact(
    path: str | os.PathLike, actual: str, *, accept: bool | str | None = None, hint: str = ACCEPT_HINT
) -> str | None:
    """Check the exact rendering against ``path`` (with ``accept``, or ``GRAPHPASS_ACCEPT_GOLDEN=1``
    when ``accept`` is None: write it and its meta sidecar instead; with ``accept="release"`` or
    ``GRAPHPASS_ACCEPT_GOLDEN=release``: record it for the running torch release, :func:`accept_release`).
    The golden of the running release is ``name.torch<major.minor>.txt`` when its meta sidecar exists
    (the main ``path`` where that file does not), else ``path``. Returns None when it was checked or
    written, or the reason it was skipped: the golden was recorded with another torch release.
    Raises :class:`GoldenMismatch` with a unified diff on a difference."""
    path = Path(path)
    mode = accept_mode(accept)
    if mode == RELEASE:
        accept_release(path, actual)
        return None
    if mode:
        _write(path, actual)
        record_meta(path)
        return None
    if not path.exists():
        raise GoldenMismatch(f"golden file {path} is missing ({hint} to record it)")
    own = release_path(path)
    if meta_path(own).exists():
        return _check_recorded(own if own.exists() else path, meta_path(own), actual, hint)
    return _check_recorded(path, meta_path(path), actual, hint)


def _recorded_torch(meta_file: Path, hint: str) -> str | None:
    """The torch version ``meta_file`` names (None when the file does not exist or names none)."""
    if not meta_file.exists():
        return None
    try:
        return json.loads(meta_file.read_text()).get("torch")
    except (ValueError, AttributeError) as exc:
        raise GoldenMismatch(f"unreadable golden meta file {meta_file} ({exc}): {hint}") from None


def _check_recorded(golden: Path, meta_file: Path, actual: str, hint: str) -> str | None:
    recorded = _recorded_torch(meta_file, hint)
    if recorded is not None and torch_release(recorded) != torch_release(torch.__version__):
        return (
            f"exact golden {golden.parent.name}/{golden.name} was recorded with torch {recorded}, this is torch {torch.__version__}: "
            f"exact check skipped (Dynamo names nodes differently between releases; the structural "
            f"summary is still checked; {hint} on this version to record it here, or "
            f"{ACCEPT_ENV}={RELEASE} to record this release's goldens beside it)"
        )
    _compare_text(golden, golden.read_text(), actual, "graph", hint)
    return None


def accept_release(path: str | os.PathLike, actual: str) -> Path:
    """Record ``actual`` as the exact golden of the running torch release and return the file it is
    checked against from now on. The main ``path`` when it is missing or was recorded on this release;
    otherwise ``name.torch<major.minor>.txt`` beside it, written only where ``actual`` differs from
    the main golden (removed where it now equals it), and its meta sidecar always."""
    path = Path(path)
    recorded = _recorded_torch(meta_path(path), ACCEPT_HINT)
    if not path.exists() or (recorded is not None and torch_release(recorded) == torch_release(torch.__version__)):
        _write(path, actual)
        record_meta(path)
        return path
    own = release_path(path)
    if path.read_text() == actual:
        own.unlink(missing_ok=True)
    else:
        _write(own, actual)
    record_meta(own)
    return own if own.exists() else path


def check_summary(
    path: str | os.PathLike, summary: dict[str, Any], *, accept: bool | str | None = None, hint: str = ACCEPT_HINT
) -> None:
    """Check the structural summary against ``path`` (JSON), on every torch version; accept like
    :func:`check_exact` (``"release"`` writes only a missing summary). Raises :class:`GoldenMismatch` with a unified diff of the JSON."""
    path = Path(path)
    actual = summary_text(summary)
    mode = accept_mode(accept)
    # summaries hold on every release: "release" writes a missing one and checks an existing one
    if mode is True or (mode == RELEASE and not path.exists()):
        _write(path, actual)
        return
    if not path.exists():
        raise GoldenMismatch(f"golden summary {path} is missing ({hint} to record it)")
    try:
        expected = summary_text(json.loads(path.read_text()))  # compare the data, not its whitespace
    except ValueError as exc:
        raise GoldenMismatch(f"golden summary {path} is not valid JSON ({exc}): {hint}") from None
    _compare_text(path, expected, actual, "structural summary", hint)


def check_golden(path: Path, actual: str) -> None:
    """Compare ``actual`` to the golden file; with ``GRAPHPASS_ACCEPT_GOLDEN=1`` write it instead.
    (No version sidecar: :func:`check_exact` is the versioned check.)"""
    path = Path(path)
    if accept_from_env() is True:
        _write(path, actual)
        return
    if not path.exists():
        raise GoldenMismatch(f"golden file {path} is missing; run `make golden` to record it")
    _compare_text(path, path.read_text(), actual, "graph", "re-accept with `make golden`")
