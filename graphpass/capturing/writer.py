"""``CaptureWriter``: writes one step's captured tensors as safetensors files (write, then rename).

Rules for what lands on disk (docs/capture.md, "What a run leaves on disk"):

* every file is written to a new temporary file created exclusively (``O_CREAT | O_EXCL |
  O_NOFOLLOW``, random name) in its target folder, then renamed into place; nothing is written
  through a symbolic link, and no folder below ``capture_dir`` may be a link;
* a step folder that already holds files of an earlier run is refused (``CaptureError``), so two
  runs never mix; other tensor-parallel ranks' ``rank{r}.safetensors`` files and the shared meta
  file are not "an earlier run";
* a write that fails (disk full, permissions) raises ``CaptureError`` naming the path and removes
  what this step had already written, temporary files included.
"""

from __future__ import annotations

import errno
import json
import numbers
import os
import re
import struct
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import torch

from ..atomic_files import probe_writable, write_bytes_atomic
from ..errors import CaptureError, ConfigError
from ..patterns import compile_patterns
from ..tensor_utils import is_dtensor, local_tensor

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-\[\]]+")  # always fullmatch: `$` would accept a trailing newline
_RANK_FILE = re.compile(r"rank([0-9]+)\.safetensors")
_RANK_META = re.compile(r"(.+)_meta\.rank([0-9]+)\.json")
NAME_MAX = 255  # bytes in one path component (Linux, macOS, Windows)


def _check_component(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or value in (".", "..") or _SAFE_NAME.fullmatch(value) is None:
        raise CaptureError(f"{what} {value!r} cannot be used as a directory name under capture_dir "
                           "(allowed: letters, digits, '_', '.', '-', '[', ']')")
    if len(value) > NAME_MAX:
        raise CaptureError(f"{what} {value[:40]!r}... is {len(value)} characters long; a file or folder name may "
                           f"have at most {NAME_MAX}: use a shorter name")
    return value


def check_rank(value: Any, key: str) -> int:
    """``dp_rank`` / ``tp_rank``: a non-bool int >= 0 whose file name fits."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ConfigError(key, value, "must be an int >= 0 (the data / tensor parallel rank of this process)")
    value = int(value)
    if len(f"rank{value}.safetensors") > NAME_MAX:
        raise ConfigError(key, value, f"too large: its file name would exceed {NAME_MAX} bytes")
    return value


MAX_TP_SIZE = 1 << 16  # tensor-parallel ranks compare expects at most (a larger tp_size in a meta is ignored)


def check_tp_size(value: Any, tp_rank: int) -> int | None:
    """``tp_size``: None (unknown) or a non-bool int > ``tp_rank`` and <= :data:`MAX_TP_SIZE`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not tp_rank < int(value) <= MAX_TP_SIZE:
        raise ConfigError("tp_size", value, f"must be None or an int in ({tp_rank}, {MAX_TP_SIZE}] (the number of "
                                            f"tensor-parallel ranks; this writer's tp_rank is {tp_rank})")
    return int(value)


def check_capture_dir(value: Any) -> Path:
    """``capture_dir``: a str or path without NUL whose every component fits the file-name limit."""
    try:
        text = os.fspath(value)
    except TypeError:
        raise CaptureError(f"capture_dir must be a str or os.PathLike, got {type(value).__name__}") from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\x00" in text:
        raise CaptureError(f"capture_dir {text!r} contains a NUL character: pass a valid directory path")
    path = Path(text)
    for part in path.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise CaptureError(f"capture_dir {text[:60]!r}...: the component {part[:40]!r}... is longer than "
                               f"{NAME_MAX} bytes, which no file system allows: use a shorter path")
    return path


def check_subdirectory(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise CaptureError(f"subdirectory must be a str or None, got {type(value).__name__}")
    text = os.fspath(value)
    if not isinstance(text, str) or not text:
        raise CaptureError(f"subdirectory {text!r} must be a non-empty relative path (str)")
    if Path(text).is_absolute():
        raise CaptureError(f"subdirectory {text!r} must be relative to capture_dir")
    for part in Path(text).parts:
        _check_component(part, "subdirectory part")
    return text


class CaptureWriter:
    """Writes one step's captures under ``capture_dir``; every file lands by write-then-rename."""

    def __init__(
        self,
        capture_dir: str | os.PathLike,
        subdirectory: str | None = None,
        dp_rank: int = 0,
        tp_rank: int = 0,
        capture_filter: Sequence[str] | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.capture_dir = check_capture_dir(capture_dir)
        self.subdirectory = check_subdirectory(subdirectory)
        self.dp_rank = check_rank(dp_rank, "dp_rank")
        self.tp_rank = check_rank(tp_rank, "tp_rank")
        self.tp_size = check_tp_size(tp_size, self.tp_rank)
        if capture_filter is not None and (isinstance(capture_filter, str)
                                           or not isinstance(capture_filter, (list, tuple))):
            raise ConfigError("capture_filter", capture_filter, "expected a list of module patterns or None")
        self.filter = compile_patterns(list(capture_filter), "capture_filter") if capture_filter is not None else None
        self._counts: dict[str, int] = {}
        self._index = 0  # steps named, whatever their phase: the meta's step_index (execution order)
        self._own_steps: set[str] = set()  # step folders this writer claimed (it may write them again)
        self._lock = threading.Lock()  # one ModelCapture stepping in several threads: one write at a time
        self._names = threading.Lock()  # step names / indexes (taken while another step is being written)
        self._check_writable()

    def _check_writable(self) -> None:
        try:
            self.capture_dir.mkdir(parents=True, exist_ok=True)
            probe_writable(self.capture_dir)
        except OSError as exc:
            raise CaptureError(f"capture_dir {str(self.capture_dir)!r} is not writable: {exc}") from None

    def _base(self, module: str) -> Path:
        sub = self.subdirectory
        if sub is None and module.startswith("visual."):
            sub = "vision"
        base = self.capture_dir / sub if sub else self.capture_dir
        return base / f"dp{self.dp_rank}"

    def step_name(self, is_prefill: bool, size: int) -> str:
        phase = "prefill" if is_prefill else "decode"
        k = self._counts.get(phase, 0)
        return f"prefill_s{size}_{k}" if is_prefill else f"decode_b{size}_{k}"

    def write(self, tensors: Sequence[tuple], *, is_prefill: bool, size: int, meta: dict) -> list[Path]:
        """Write ``tensors`` as one step: ``(name, tensor)`` pairs or ``(name, tensor, key)`` triples
        (:meth:`TensorRegistry.get_all_entries`) in execution order; :func:`file_keys` names them in
        each module's file. Returns the step dirs.

        Raises ``CaptureError`` (naming the path) when a step folder holds an earlier run's files or a
        write fails; then nothing of this step is left behind."""
        with self._lock:
            step, index = self.reserve(is_prefill, size)
            try:
                return self._write(tensors, step=step, index=index, is_prefill=is_prefill, size=size, meta=meta)
            except BaseException:
                self._release(is_prefill, index)
                raise

    def reserve(self, is_prefill: bool, size: int) -> tuple[str, int]:
        """The next step's folder name and ``step_index``, taken now (a step staged to be written
        later keeps the name and place of its call, whatever the writer's pace)."""
        with self._names:
            step = self.step_name(is_prefill, size)
            phase = "prefill" if is_prefill else "decode"
            self._counts[phase] = self._counts.get(phase, 0) + 1
            self._index += 1
            return step, self._index - 1

    def _release(self, is_prefill: bool, index: int) -> None:
        """Give back the reservation ``index`` of a step that failed, when no later step took one
        (so the next step uses the same name); otherwise its name stays a gap."""
        with self._names:
            if self._index == index + 1:
                phase = "prefill" if is_prefill else "decode"
                self._counts[phase] -= 1
                self._index -= 1

    def step_dirs(self, names: Sequence[str], step: str) -> list[Path]:
        """The step folders :meth:`write` makes for values named ``names`` under ``step`` (what it
        returns), without writing: a staged step's answer."""
        bases = dict.fromkeys(self._base(n) for n in dict.fromkeys(names)
                              if self.filter is None or any(p.matches(n) for p in self.filter))
        return [base / step for base in bases]

    def write_reserved(self, tensors: Sequence[tuple], *, step: str, index: int, is_prefill: bool, size: int,
                       meta: dict) -> list[Path]:
        """:meth:`write` under a name taken earlier with :meth:`reserve` (the write-behind thread)."""
        with self._lock:
            return self._write(tensors, step=step, index=index, is_prefill=is_prefill, size=size, meta=meta)

    def _write(self, tensors: Sequence[tuple], *, step: str, index: int, is_prefill: bool, size: int,
               meta: dict) -> list[Path]:
        encode = encode_safetensors
        grouped: dict[str, list[tuple[torch.Tensor, str | None, str]]] = {}
        for entry in tensors:
            name, t, key, layout = (*entry, None, "")[:4] if len(entry) == 2 else (*entry, "")[:4]
            _check_component(name, "capture name")
            if self.filter is not None and not any(p.matches(name) for p in self.filter):
                continue
            grouped.setdefault(name, []).append(_local(t, key, layout))
        root = self.capture_dir.resolve()
        by_base: dict[Path, list[str]] = {}
        for name in grouped:
            by_base.setdefault(self._base(name), []).append(name)
        written: list[Path] = []
        new_files: list[Path] = []
        new_dirs: list[Path] = []
        where = self.capture_dir
        try:
            for base, names in by_base.items():
                step_dir = where = base / step
                if not step_dir.resolve().is_relative_to(root):
                    raise CaptureError(f"capture path {step_dir} would leave capture_dir")
                self._claim(step_dir)
                _make_dirs(self.capture_dir, step_dir, new_dirs)
                info: dict[str, list[dict]] = {}
                step_text, file_name = os.fspath(step_dir), f"rank{self.tp_rank}.safetensors"
                for name in names:
                    # ``name`` is one checked component (_check_component: no separator, no ``..``) and
                    # step_dir was checked above: only the module folder itself is new (never a link).
                    # Plain strings here: this loop runs once per module and step (pathlib costs more
                    # than the system calls).
                    mod_dir = where = os.path.join(step_text, name)
                    _make_dir(mod_dir, new_dirs)
                    entries = grouped[name]
                    keyed = file_keys([(t, key) for t, key, _ in entries])
                    payload = {k: entries[i][0].detach().to("cpu").contiguous() for k, i in keyed}
                    where = os.path.join(mod_dir, file_name)
                    _atomic(where, encode(payload), new_files)
                    info[name] = [_tensor_info(k, payload[k], entries[i][2]) for k, i in keyed]
                doc = dict(meta, step=step, step_index=index, phase="prefill" if is_prefill else "decode",
                           size=size, modules=names, tensors=info, dp_rank=self.dp_rank, tp_rank=self.tp_rank,
                           tp_size=self.tp_size)
                where = step_dir / meta_file_name(step, self.tp_rank)
                # one line: json's C encoder (an indented dump runs the pure-Python one, 10x slower)
                _atomic(where, json.dumps(doc, default=_jsonable).encode("utf-8"), new_files)
                written.append(step_dir)
        except BaseException as exc:
            _roll_back(new_files, new_dirs)
            if isinstance(exc, CaptureError) or not isinstance(exc, Exception):
                raise
            hint = "free some disk space" if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) \
                else "check the path and its permissions"
            raise CaptureError(f"cannot write capture file {str(where)!r}: {type(exc).__name__}: {exc}; {hint} and "
                               "run the step again (nothing of this step was kept)") from exc
        return written

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
                f"(or subdirectory), or delete {str(self.capture_dir)!r} before capturing again")
        self._own_steps.add(key)


# safetensors dtype names (the format's spec); a dtype not here goes through safetensors.torch.save
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def encode_safetensors(payload: dict[str, torch.Tensor]) -> bytes:
    """The bytes ``safetensors.torch.save(payload)`` would give a reader (same format: an 8-byte
    little-endian header length, the JSON header with each tensor's dtype, shape and
    ``data_offsets``, padded with spaces to 8 bytes, then the tensors' bytes back to back, wider
    dtypes first so each is aligned), made
    here for the common dtypes on a little-endian host because ``save``'s Python side costs several
    times the encoding itself for the small values of a decode step. Contiguous CPU tensors."""
    if sys.byteorder != "little" or any(t.dtype not in _ST_DTYPES for t in payload.values()):
        from safetensors.torch import save

        return save(payload)
    header: dict[str, dict] = {}
    chunks: list = []
    offset = 0
    # safetensors' order: wider dtypes first, then by name, so every tensor's bytes are aligned
    for key, t in sorted(payload.items(), key=lambda kv: (-kv[1].element_size(), kv[0])):
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        size = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        chunks.append(data)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return b"".join([struct.pack("<Q", len(text)), text, *chunks])


def _local(t: torch.Tensor, key: str | None, layout: str) -> tuple[torch.Tensor, str | None, str]:
    """A DTensor value (captured outside the op, e.g. registered by hand) as its local shard + layout."""
    from .ops import dtensor_layout

    if is_dtensor(t):
        return local_tensor(t), key, dtensor_layout(t)
    return t, key, layout


def _tensor_info(key: str, value: torch.Tensor, layout: str) -> dict:
    """One tensor's entry in the step meta: key, dtype, (local) shape and, for a DTensor shard, its
    placements, mesh shape and dim names, global shape, offset and this rank's mesh coordinate."""
    info = {"key": key, "dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape)}
    if layout:
        info.update(json.loads(layout))
    return info


def meta_file_name(step: str, tp_rank: int) -> str:
    """Each tensor-parallel rank writes its own meta file (no rank overwrites another's):
    ``{step}_meta.json`` for rank 0, ``{step}_meta.rank{t}.json`` for the others."""
    return f"{step}_meta.json" if tp_rank == 0 else f"{step}_meta.rank{tp_rank}.json"


def meta_file_rank(step: str, name: str) -> int | None:
    """The tensor-parallel rank whose meta file ``name`` is in step folder ``step``, or None."""
    if name == f"{step}_meta.json":
        return 0
    m = _RANK_META.fullmatch(name)
    return int(m.group(2)) if m is not None and m.group(1) == step else None


def read_step_meta(step_dir: str | os.PathLike) -> dict:
    """The step's meta, merged from every rank's meta file: the lowest rank's fields, ``ranks``
    (every tensor-parallel rank that wrote, sorted), ``modules`` (all ranks', in order of first
    appearance), ``tensors`` (per module, the lowest rank's entries) and ``rank_tensors``
    (rank -> that rank's ``tensors``). Raises FileNotFoundError without any meta file, OSError /
    ValueError for an unreadable one (naming it)."""
    step_dir = Path(step_dir)
    docs: dict[int, dict] = {}
    for name in sorted(os.listdir(step_dir)):
        rank = meta_file_rank(step_dir.name, name)
        if rank is None:
            continue
        try:
            doc = json.loads((step_dir / name).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("modules"), list):
            raise ValueError(f"{name}: no 'modules' list")
        docs[rank] = doc
    if not docs:
        raise FileNotFoundError(f"no meta file in {step_dir}")
    merged = dict(docs[min(docs)])
    merged["ranks"] = sorted(docs)
    merged["modules"] = list(dict.fromkeys(m for r in sorted(docs) for m in docs[r]["modules"]))
    merged["rank_tensors"] = {r: docs[r].get("tensors") or {} for r in sorted(docs)}
    tensors: dict = {}
    for r in sorted(docs, reverse=True):
        tensors.update(docs[r].get("tensors") or {})
    merged["tensors"] = tensors
    return merged


def file_keys(entries: Sequence[tuple[torch.Tensor, str | None]]) -> list[tuple[str, int]]:
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
    return (named + [(f"other[{i}]", index) for i, index in enumerate(other)]
            + [(str(i), index) for i, index in enumerate(manual)])


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
            m = _RANK_FILE.fullmatch(name)
            if depth == 1 and m is not None and int(m.group(1)) != tp_rank:
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
            raise CaptureError(f"{str(path)!r} is a symbolic link graphpass did not create; refusing to write "
                               "through it: remove it or use a new capture_dir") from None
        if not os.path.isdir(path):
            raise CaptureError(f"{str(path)!r} exists and is not a directory: remove it or use a new "
                               "capture_dir") from None
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


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def _atomic(path: str | Path, data: bytes, created: list | None = None) -> None:
    """Write ``data`` onto ``path`` (:func:`graphpass.atomic_files.write_bytes_atomic`); ``path`` is
    appended to ``created`` when it did not exist before."""
    if write_bytes_atomic(path, data) and created is not None:
        created.append(path)
