"""One capture step's files, written from a *step plan*: torch-free, so that the capture writer
process (:mod:`graphpass.capturing.write_process`) runs it without importing torch.

:meth:`CaptureWriter.plan <graphpass.capturing.writer.CaptureWriter.plan>` turns a step's captured
tensors into a plan (plain JSON-able data: which folders, which files, each tensor's safetensors
dtype, shape and byte count, the meta file's text) and a list of buffers (the tensors' bytes);
:meth:`StepFiles.emit` makes the folders and writes the files. In the saving process the buffers
are the tensors' own memory; in the writer process they are slices of the shared staging ring.

Rules (docs/capture.md, "What a run leaves on disk"): a step's files are created exclusively in a
new hidden folder (``.graphpass-<hex>.tmp``) that is then renamed onto the step folder (or, when
that exists, each file is renamed into place from it), so no file is ever seen half-written; no folder below ``capture_dir`` may be a symbolic link; a step folder holding an earlier
run's files is refused; a write that fails raises ``CaptureError`` naming the path and removes what
this step had already written.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Sequence

from .. import atomic_files
from ..capture_format import (
    DP_RANK,
    FORMAT_VERSION,
    FORMAT_VERSION_KEY,
    MODULES,
    PHASE,
    SIZE,
    STEP,
    STEP_INDEX,
    TENSORS,
    TP_RANK,
    TP_SIZE,
    meta_file_name,
    meta_file_rank,
    rank_file_name,
    rank_file_rank,
)
from ..errors import CaptureError


def safetensors_header(tensors: Sequence[dict]) -> tuple[bytes, list[dict]]:
    """The header of a safetensors file holding ``tensors`` (plan entries: ``key``, ``dtype`` (the
    format's name, ``F32``), ``shape``, ``nbytes``, ``esize``) and the order their bytes follow it:
    an 8-byte little-endian length, the JSON header with each tensor's ``data_offsets``, padded
    with spaces to 8 bytes; wider dtypes first, then by key (``safetensors.torch.save``'s order,
    so each tensor's bytes are aligned). Kept per layout (keys, dtypes, shapes): the files of a
    step, and of every step of one size, mostly share one."""
    sig = tuple((e["key"], e["dtype"], tuple(e["shape"]), e["nbytes"], e["esize"]) for e in tensors)
    hit = _HEADERS.get(sig)
    if hit is None:
        idx = sorted(range(len(tensors)), key=lambda i: (-sig[i][4], sig[i][0]))
        header: dict[str, dict] = {}
        offset = 0
        for i in idx:
            key, dtype, shape, nbytes, _ = sig[i]
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        if len(_HEADERS) >= 1024:
            _HEADERS.clear()
        hit = _HEADERS[sig] = (struct.pack("<Q", len(text)) + text, idx)
    return hit[0], [tensors[i] for i in hit[1]]


_HEADERS: dict[tuple, tuple[bytes, list[int]]] = {}  # safetensors_header's answers, by layout


# One captured value of a step, as the planner takes it (a list, in this order: what the saving
# process sends the writer process): its module or capture name, the folder its step folder goes
# in (dp{d} under capture_dir[/subdirectory]), its key in the module's output (None: an inline
# capture_tensor value), its DTensor layout JSON or "", its safetensors dtype (None: not one the
# plain encoder writes), its dtype as the meta names it, its shape, byte count, element size, and
# the index of its buffer.
RECORD = ("name", "base", "key", "layout", "dtype", "meta_dtype", "shape", "nbytes", "esize", "src")


def plan_step(
    records: Sequence[Sequence],
    *,
    step: str,
    index: int,
    is_prefill: bool,
    size: int,
    meta: dict,
    dp_rank: int,
    tp_rank: int,
    tp_size: int | None,
) -> dict:
    """The plan of one step (what :meth:`StepFiles.emit` writes) from its values' ``records``
    (:data:`RECORD`, registration order): per step folder, one file per module (keys from
    :func:`file_keys`) and the meta file's text. A file holding a value whose ``dtype`` is None is
    marked ``"encode"`` (the saving process encodes it with safetensors itself)."""
    grouped: dict[str, list[dict]] = {}
    for rec in records:
        e = dict(zip(RECORD, rec))
        grouped.setdefault(e["name"], []).append(e)
    by_base: dict[str, list[str]] = {}
    for name, entries in grouped.items():
        by_base.setdefault(entries[0]["base"], []).append(name)
    bases = []
    file_name = rank_file_name(tp_rank)
    for base, names in by_base.items():
        step_dir = os.path.join(base, step)
        info: dict[str, list[dict]] = {}
        files = []
        for name in names:
            f = _module_file(name, grouped[name], step_dir, file_name)
            files.append(f)
            info[name] = [_tensor_info(t) for t in f["tensors"]]
        doc = {
            **meta,
            STEP: step,
            STEP_INDEX: index,
            PHASE: "prefill" if is_prefill else "decode",
            SIZE: size,
            MODULES: names,
            TENSORS: info,
            DP_RANK: dp_rank,
            TP_RANK: tp_rank,
            TP_SIZE: tp_size,
            FORMAT_VERSION_KEY: FORMAT_VERSION,
        }
        # one line: json's C encoder (an indented dump runs the pure-Python one, 10x slower)
        bases.append(
            {
                "dir": step_dir,
                "files": files,
                "meta": json.dumps(doc, default=str),
                "meta_path": os.path.join(step_dir, meta_file_name(step, tp_rank)),
            }
        )
    return {"bases": bases}


def _module_file(name: str, entries: list[dict], step_dir: str, file_name: str) -> dict:
    """One module's file in a step folder: its values keyed as :func:`file_keys` names them, marked
    ``"encode"`` when one has no plain dtype."""
    if len(entries) == 1 and entries[0]["key"]:  # one output (a decoder layer's): its own key
        tensors = entries
    else:
        tensors = [dict(entries[i], key=k) for k, i in file_keys([(None, e["key"]) for e in entries])]
    mod_dir = step_dir + os.sep + name  # name: one checked component (no separator, no "..")
    f = {
        "dir": mod_dir,
        "path": mod_dir + os.sep + file_name,
        "name": name,
        "file": file_name,
        "tensors": tensors,
    }
    if any(t["dtype"] is None for t in tensors):
        f["encode"] = True
    return f


def _tensor_info(t: dict) -> dict:
    """One value's entry in the step meta: key, dtype, (local) shape and, for a DTensor shard, its
    placements, mesh shape and dim names, global shape, offset and this rank's mesh coordinate."""
    info = {"key": t["key"], "dtype": t["meta_dtype"], "shape": list(t["shape"])}
    if t["layout"]:
        info.update(json.loads(t["layout"]))
    return info


def file_keys(entries: Sequence[tuple[Any, str | None]]) -> list[tuple[str, int]]:
    """The keys one module's values get in its file, in file order, with each value's index in
    ``entries``.

    ``(value, key)`` in registration order, ``key`` as :meth:`TensorRegistry.get_all_entries` gives
    it: output leaves keep their key path (``[0]``, ``.last_hidden_state``, ``output``) in output
    order, a later call's repeat of a key gets ``#1``, ``#2``, ...; then the values computed in the
    module and read outside it without being returned, ``other[0]``, ``other[1]``, ...; inline
    ``capture_tensor`` values (key None) are ``0``, ``1``, ... as they always were."""
    named: list[tuple[str, int]] = []
    seen: dict[str, int] = {}
    other: list[int] = []
    manual: list[int] = []
    for index, (_, key) in enumerate(entries):
        if key is None:
            manual.append(index)
        elif not key:
            other.append(index)
        else:
            n = seen.get(key, 0)
            seen[key] = n + 1
            named.append((key if n == 0 else f"{key}#{n}", index))
    return (
        named
        + [(f"other[{i}]", index) for i, index in enumerate(other)]
        + [(str(i), index) for i, index in enumerate(manual)]
    )


class StepFiles:
    """Writes planned steps under ``capture_dir`` for tensor-parallel rank ``tp_rank``; remembers
    the step folders it claimed (it may write them again; another run's files there are refused)."""

    def __init__(self, capture_dir: str | os.PathLike, tp_rank: int) -> None:
        self.capture_dir = Path(capture_dir)
        self.tp_rank = int(tp_rank)
        self._own_steps: set[str] = set()

    def emit(self, plan: dict, buffers: Sequence[Any]) -> list[str]:
        """Write the step ``plan`` describes; ``buffers[i]`` holds the bytes of the plan's tensor or
        file with ``src == i``. Returns the step folders written. On failure nothing of the step is
        left and ``CaptureError`` names the path.

        Each step folder's files are written into a new hidden folder beside it (``.graphpass-<hex>.tmp``,
        made by ``mkdir``, so exclusively), then the hidden folder is renamed onto the step folder in
        one call: a step appears whole or not at all, and its files cost no temporary name and no
        rename each. A step folder that already exists (another tensor-parallel rank's, or this
        writer's own step written again) instead gets each file renamed into place from the hidden
        folder, one by one, meta last, as a file written on its own would be."""
        root = os.path.realpath(self.capture_dir)
        written: list[str] = []
        new_files: list[str] = []
        new_dirs: list[Any] = []
        staging: list[str] = []  # hidden folders not yet renamed or removed
        where: Any = self.capture_dir
        try:
            for base in plan["bases"]:
                step_dir = where = base["dir"]
                real = os.path.realpath(step_dir)
                if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
                    raise CaptureError(f"capture path {step_dir} would leave capture_dir")
                parent = os.path.dirname(step_dir)
                _make_dirs(self.capture_dir, Path(parent), new_dirs)
                tmp = _make_temp_dir(parent)
                staging.append(tmp)
                sep = tmp + os.sep
                for f in base["files"]:
                    where = f["path"]
                    name = f["name"]
                    os.mkdir(sep + name)
                    _write_new(sep + name + os.sep + f["file"], _file_parts(f, buffers))
                where, meta_name = base["meta_path"], os.path.basename(base["meta_path"])
                _write_new(sep + meta_name, [base["meta"].encode("utf-8")])
                where = step_dir
                if not self._move_whole(tmp, step_dir):
                    self._claim(Path(step_dir))
                    _make_dir(step_dir, new_dirs)
                    for f in base["files"]:
                        where = f["dir"]
                        _make_dir(where, new_dirs)
                        where = f["path"]
                        _move_file(sep + f["name"] + os.sep + f["file"], where, new_files)
                    where = base["meta_path"]
                    _move_file(sep + meta_name, where, new_files)
                    _remove_tree(staging.pop())
                else:  # all of it is this step's: a failure of a later folder removes it
                    staging.pop()
                    new_dirs += [step_dir, *(f["dir"] for f in base["files"])]
                    new_files += [*(f["path"] for f in base["files"]), base["meta_path"]]
                written.append(step_dir)
        except BaseException as exc:
            _roll_back(new_files, new_dirs)
            for tmp in staging:
                _remove_tree(tmp)
            if isinstance(exc, CaptureError) or not isinstance(exc, Exception):
                raise
            raise _write_error(exc, where) from exc
        return written

    def _move_whole(self, tmp: str, step_dir: str) -> bool:
        """Rename the written hidden folder ``tmp`` onto ``step_dir`` when no step folder is there
        yet; False (nothing moved) when one is (or appeared meanwhile: ``rename`` refuses a folder
        that holds anything, and a link or file, since ``tmp`` is a folder)."""
        if os.path.abspath(step_dir) in self._own_steps or os.path.lexists(step_dir):
            return False
        try:
            os.rename(tmp, step_dir)  # an empty folder made meanwhile (another rank) is replaced: nothing lost
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                return False
            raise
        self._own_steps.add(os.path.abspath(step_dir))
        return True

    def _claim(self, step_dir: Path) -> None:
        """Refuse a step folder that holds an earlier run's files (this writer's own are fine)."""
        key = os.path.abspath(step_dir)
        if key in self._own_steps:
            return
        stale = _earlier_run_file(step_dir, self.tp_rank)
        if stale is not None:
            raise CaptureError(
                f"step folder {str(step_dir)!r} already holds {str(stale)!r} from an earlier run, and graphpass never "
                "mixes two runs in one folder (compare would read the old files as current): pass a new capture_dir "
                f"(or subdirectory), or delete {str(self.capture_dir)!r} before capturing again"
            )
        self._own_steps.add(key)


def _file_parts(f: dict, buffers: Sequence[Any]) -> list:
    """The byte strings one planned file consists of: an encoded file (``blob``), or a safetensors
    header and then each tensor's bytes in header order."""
    if f.get("blob") is not None:
        return [buffers[f["blob"]]]
    header, order = safetensors_header(f["tensors"])
    return [header] + [buffers[e["src"]] for e in order if e["nbytes"]]


def _write_new(path: str, parts: list) -> None:
    """Create ``path`` exclusively (never through a link) in a folder of this step's own and write
    ``parts`` back to back onto it."""
    fd = os.open(path, atomic_files.CREATE_FLAGS, 0o666)
    try:
        atomic_files.write_all(fd, parts)
    finally:
        os.close(fd)


def _move_file(src: str, path: str, created: list) -> None:
    """Rename the finished file ``src`` onto ``path`` (``os.replace``: a link at ``path`` is
    replaced, never followed); ``path`` is appended to ``created`` when it did not exist before."""
    existed = os.path.lexists(path)
    os.replace(src, path)
    if not existed:
        created.append(path)


def _make_temp_dir(parent: str) -> str:
    """A new hidden folder in ``parent`` (``mkdir`` fails on any existing name, a link included)."""
    for _, name in zip(range(100), atomic_files.temp_names()):
        path = os.path.join(parent, name)
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary folder name", parent)


def _remove_tree(path: str) -> None:
    """Remove a hidden folder of this writer's (never follows a link in it)."""
    shutil.rmtree(path, ignore_errors=True)


def _earlier_run_file(step_dir: Path, tp_rank: int) -> Path | None:
    """The first file under ``step_dir`` an earlier run left, or None. Not counted: hidden names
    (temporary files), other tensor-parallel ranks' meta files and ``rank{r}.safetensors`` files."""
    if not os.path.lexists(step_dir):
        return None
    if os.path.islink(step_dir) or not step_dir.is_dir():
        return step_dir
    for dirpath, dirnames, filenames in os.walk(step_dir):  # never follows links
        here = Path(dirpath)
        depth = len(here.relative_to(step_dir).parts)
        links = [d for d in dirnames if os.path.islink(here / d)]
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in links]
        for name in filenames + links:
            if name.startswith("."):
                continue
            meta_rank = meta_file_rank(step_dir.name, name) if depth == 0 else None
            if meta_rank is not None and meta_rank != tp_rank:
                continue  # another rank's meta file
            file_rank = rank_file_rank(name)
            if depth == 1 and file_rank is not None and file_rank != tp_rank:
                continue
            return here / name
    return None


def _make_dirs(capture_dir: Path, path: Path, created: list) -> None:
    """mkdir -p below ``capture_dir``, refusing any existing component that is a symbolic link."""
    current = capture_dir
    for part in path.relative_to(capture_dir).parts:
        current = current / part
        _make_dir(current, created)


def _make_dir(path: str | Path, created: list) -> None:
    """mkdir ``path`` (appended to ``created`` when new); an existing one must be a real folder, not a
    symbolic link (``mkdir`` fails on a link too, so the check costs nothing for a new folder)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if os.path.islink(path):
            raise CaptureError(
                f"{str(path)!r} is a symbolic link graphpass did not create; refusing to write "
                "through it: remove it or use a new capture_dir"
            ) from None
        if not os.path.isdir(path):
            raise CaptureError(
                f"{str(path)!r} exists and is not a directory: remove it or use a new capture_dir"
            ) from None
    else:
        created.append(path)


def _roll_back(files: list, dirs: list) -> None:
    for f in reversed(files):
        try:
            os.unlink(f)
        except OSError:
            pass
    for d in reversed(dirs):
        try:
            os.rmdir(d)  # only if empty: another rank's files stay
        except OSError:
            pass


def _write_error(exc: Exception, where: Any) -> CaptureError:
    """The error a step whose write failed raises: the path, the cause and what to do."""
    hint = (
        "free some disk space"
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        else "check the path and its permissions"
    )
    return CaptureError(
        f"cannot write capture file {str(where)!r}: {type(exc).__name__}: {exc}; {hint} and "
        "run the step again (nothing of this step was kept)"
    )
