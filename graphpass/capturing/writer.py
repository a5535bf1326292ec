"""``CaptureWriter``: writes one step's captured tensors as safetensors files (write, then rename).

Rules for what lands on disk (docs/capture.md, "What a run leaves on disk"):

* every file is created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``) in a new hidden folder
  (random name) beside its step folder, which is then renamed onto the step folder (or each file
  into place, when the step folder exists); nothing is written through a symbolic link, and no
  folder below ``capture_dir`` may be a link;
* a step folder that already holds files of an earlier run is refused (``CaptureError``), so two
  runs never mix; other tensor-parallel ranks' ``rank{r}.safetensors`` files and the shared meta
  file are not "an earlier run";
* a write that fails (disk full, permissions) raises ``CaptureError`` naming the path and removes
  what this step had already written, temporary files included.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import torch

from ..atomic_files import probe_writable
from ..capture_format import MAX_TP_SIZE, dp_folder, read_step_meta  # noqa: F401 (read_step_meta re-exported)
from ..errors import CaptureError, ConfigError
from ..patterns import compile_patterns
from .step_files import StepFiles, _file_parts, file_keys, meta_file_name, meta_file_rank, plan_step  # noqa: F401 (re-exported)
from ..tensor_utils import is_dtensor, local_tensor

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-\[\]]+")  # always fullmatch: `$` would accept a trailing newline
NAME_MAX = 255  # bytes in one path component (Linux, macOS, Windows)


def _check_component(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or value in (".", "..") or _SAFE_NAME.fullmatch(value) is None:
        raise CaptureError(
            f"{what} {value!r} cannot be used as a directory name under capture_dir "
            "(allowed: letters, digits, '_', '.', '-', '[', ']')"
        )
    if len(value) > NAME_MAX:
        raise CaptureError(
            f"{what} {value[:40]!r}... is {len(value)} characters long; a file or folder name may "
            f"have at most {NAME_MAX}: use a shorter name"
        )
    return value


def check_rank(value: Any, key: str) -> int:
    """``dp_rank`` / ``tp_rank``: a non-bool int >= 0 whose file name fits."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ConfigError(key, value, "must be an int >= 0 (the data / tensor parallel rank of this process)")
    value = int(value)
    if len(f"rank{value}.safetensors") > NAME_MAX:
        raise ConfigError(key, value, f"too large: its file name would exceed {NAME_MAX} bytes")
    return value


def check_tp_size(value: Any, tp_rank: int) -> int | None:
    """``tp_size``: None (unknown) or a non-bool int > ``tp_rank`` and <= :data:`MAX_TP_SIZE`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not tp_rank < int(value) <= MAX_TP_SIZE:
        raise ConfigError(
            "tp_size",
            value,
            f"must be None or an int in ({tp_rank}, {MAX_TP_SIZE}] (the number of "
            f"tensor-parallel ranks; this writer's tp_rank is {tp_rank})",
        )
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
            raise CaptureError(
                f"capture_dir {text[:60]!r}...: the component {part[:40]!r}... is longer than "
                f"{NAME_MAX} bytes, which no file system allows: use a shorter path"
            )
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
        if capture_filter is not None and (
            isinstance(capture_filter, str) or not isinstance(capture_filter, (list, tuple))
        ):
            raise ConfigError("capture_filter", capture_filter, "expected a list of module patterns or None")
        self.filter = compile_patterns(list(capture_filter), "capture_filter") if capture_filter is not None else None
        self._counts: dict[str, int] = {}
        self._index = 0  # steps named, whatever their phase: the meta's step_index (execution order)
        self._files = StepFiles(self.capture_dir, self.tp_rank)  # claims the step folders it writes
        self._routes: dict[str, str] = {}  # capture name -> its dp folder ("": left out by capture_filter)
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
        return base / dp_folder(self.dp_rank)

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
        bases = dict.fromkeys(base for base in map(self.route, dict.fromkeys(names)) if base)
        return [Path(base, step) for base in bases]

    def write_reserved(
        self, tensors: Sequence[tuple], *, step: str, index: int, is_prefill: bool, size: int, meta: dict
    ) -> list[Path]:
        """:meth:`write` under a name taken earlier with :meth:`reserve` (the write-behind thread)."""
        with self._lock:
            return self._write(tensors, step=step, index=index, is_prefill=is_prefill, size=size, meta=meta)

    def _write(
        self, tensors: Sequence[tuple], *, step: str, index: int, is_prefill: bool, size: int, meta: dict
    ) -> list[Path]:
        plan, buffers = self.plan(tensors, step=step, index=index, is_prefill=is_prefill, size=size, meta=meta)
        return [Path(d) for d in self._files.emit(plan, [host_bytes(b) for b in buffers])]

    def plan(
        self, tensors: Sequence[tuple], *, step: str, index: int, is_prefill: bool, size: int, meta: dict
    ) -> tuple[dict, list]:
        """The step plan :meth:`StepFiles.emit <graphpass.capturing.step_files.StepFiles.emit>` writes
        (:func:`~graphpass.capturing.step_files.plan_step`) and its buffers: contiguous host tensors
        (the values' bytes) and, for a file holding a dtype the plain encoder does not know, that
        file's bytes as ``safetensors.torch.save`` encodes them. Raises ``CaptureError`` for a value
        whose name cannot be a folder name."""
        records, buffers = self.records(tensors)
        meta = json.loads(json.dumps(meta, default=_jsonable))
        plan = plan_step(
            records,
            step=step,
            index=index,
            is_prefill=is_prefill,
            size=size,
            meta=meta,
            dp_rank=self.dp_rank,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        for base in plan["bases"]:
            for f in base["files"]:
                if f.pop("encode", False):
                    from safetensors.torch import save

                    buffers.append(save({t["key"]: buffers[t["src"]] for t in f["tensors"]}))
                    f["blob"] = len(buffers) - 1
        return dict(plan, root=os.fspath(self.capture_dir), tp_rank=self.tp_rank), buffers

    def records(self, tensors: Sequence[tuple]) -> tuple[list[list], list[torch.Tensor]]:
        """The planner's records (:data:`~graphpass.capturing.step_files.RECORD`) of the values
        this writer keeps (``capture_filter``), and their contiguous host tensors."""
        records: list[list] = []
        buffers: list[torch.Tensor] = []
        for entry in tensors:
            name, t, key, layout = (*entry, None, "")[:4] if len(entry) == 2 else (*entry, "")[:4]
            base = self.route(name)
            if base is None:
                continue
            if type(t) is not torch.Tensor:
                t, key, layout = _local(t, key, layout)
            if t.requires_grad:
                t = t.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            if not t.is_contiguous():
                t = t.contiguous()
            records.append(
                [
                    name,
                    base,
                    key,
                    layout,
                    plain_dtype(t),
                    _META_DTYPES.get(t.dtype) or _meta_dtype(t),
                    list(t.shape),
                    t.numel() * t.element_size(),
                    t.element_size(),
                    len(buffers),
                ]
            )
            buffers.append(t)
        return records, buffers

    def route(self, name: str) -> str | None:
        """The folder ``name``'s step folders go in (``capture_dir[/subdirectory]/dp{d}``), or None when
        ``capture_filter`` leaves it out; checks the name (``CaptureError``). Kept per name."""
        hit = self._routes.get(name)
        if hit is None:
            _check_component(name, "capture name")
            keep = self.filter is None or any(p.matches(name) for p in self.filter)
            if len(self._routes) >= 4096:
                self._routes.clear()
            hit = self._routes[name] = os.fspath(self._base(name)) if keep else ""
        return hit or None


# safetensors dtype names (the format's spec); a dtype not here goes through safetensors.torch.save
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def encode_safetensors(payload: dict[str, torch.Tensor]) -> bytes:
    """The bytes ``safetensors.torch.save(payload)`` would give a reader (same format: an 8-byte
    little-endian header length, the JSON header with each tensor's dtype, shape and
    ``data_offsets``, padded with spaces to 8 bytes, then the tensors' bytes back to back, wider
    dtypes first so each is aligned: :func:`graphpass.capturing.step_files.safetensors_header`),
    made here for the common dtypes on a little-endian host because ``save``'s Python side costs
    several times the encoding itself for the small values of a decode step. Contiguous CPU tensors."""
    if any(plain_dtype(t) is None for t in payload.values()):
        from safetensors.torch import save

        return save(payload)
    tensors = [
        {
            "key": k,
            "dtype": plain_dtype(t),
            "shape": list(t.shape),
            "nbytes": t.numel() * t.element_size(),
            "esize": t.element_size(),
            "src": i,
        }
        for i, (k, t) in enumerate(payload.items())
    ]
    buffers = [host_bytes(t) for t in payload.values()]
    return b"".join(bytes(p) for p in _file_parts({"tensors": tensors}, buffers))


_META_DTYPES = {d: str(d).replace("torch.", "") for d in _ST_DTYPES}


def _meta_dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def plain_dtype(t: torch.Tensor) -> str | None:
    """The safetensors name of ``t``'s dtype when the plain encoder writes it, else None."""
    return _ST_DTYPES.get(t.dtype) if sys.byteorder == "little" else None


def host_bytes(b: Any) -> Any:
    """A plan buffer as bytes-like: a contiguous host tensor's memory (no copy), or ``b`` itself."""
    if isinstance(b, torch.Tensor):
        return b.reshape(-1).view(torch.uint8).numpy() if b.numel() else b""
    return b


def _local(t: torch.Tensor, key: str | None, layout: str) -> tuple[torch.Tensor, str | None, str]:
    """A DTensor value (captured outside the op, e.g. registered by hand) as its local shard + layout."""
    from .ops import dtensor_layout

    if is_dtensor(t):
        return local_tensor(t), key, dtensor_layout(t)
    return t, key, layout


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)
