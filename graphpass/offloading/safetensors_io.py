"""safetensors files for offloaded weights: read the header, check it, read one tensor's bytes
straight into a destination tensor, and write files atomically.

Reading never maps the file: a weight is read with ``os.preadv`` into memory the caller owns, so
the process's resident memory holds only what the caller keeps (an ``mmap`` would leave every
page it touched counted in the process's RSS). Files written here are ordinary safetensors files
that ``safetensors.safe_open`` reads, and files written by ``safetensors`` / transformers /
accelerate are read here.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from .. import atomic_files, progress
from ..errors import OffloadError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes lie: ``path`` from byte ``offset``, ``nbytes`` long."""

    name: str
    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: str | os.PathLike) -> dict[str, TensorLocation]:
    """Parse one safetensors file's header; raise :class:`OffloadError` for a foreign or truncated file."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise OffloadError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or n > _MAX_HEADER or 8 + n > size:
                raise OffloadError(
                    f"{path}: not a safetensors file (header length {n} does not fit a {size}-byte file)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise OffloadError(f"{path}: cannot read the checkpoint file: {exc}") from None
    header = _parse_header(path, raw)
    base = 8 + n
    out: dict[str, TensorLocation] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise OffloadError(f"{path}: tensor {name!r}: malformed or unsupported header entry {info!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise OffloadError(
                f"{path}: tensor {name!r}: header says {end - begin} bytes for shape {list(shape)} {dtype} ({nbytes} bytes)"
            )
        if base + end > size:
            raise OffloadError(
                f"{path}: tensor {name!r} is truncated: its bytes end at {base + end} but the file has {size} bytes"
            )
        out[name] = TensorLocation(name, path, base + begin, nbytes, dtype, shape)
    _refuse_overlaps(path, out)
    return out


def _parse_header(path: str, raw: bytes) -> dict:
    """The header's JSON object; a key given twice (at any level) is refused, as safetensors does."""
    twice: list[str] = []

    def pairs(items: list) -> dict:
        seen: dict = {}
        for k, v in items:
            if k in seen:
                twice.append(k)
            seen[k] = v
        return seen

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=pairs)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise OffloadError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise OffloadError(f"{path}: not a safetensors file (its header is not a JSON object)")
    if twice:
        raise OffloadError(
            f"{path}: invalid safetensors header: key(s) {sorted(set(twice))} given more than once "
            f"(safetensors refuses such a file)"
        )
    return header


def _refuse_overlaps(path: str, tensors: dict[str, TensorLocation]) -> None:
    """Two tensors whose byte ranges overlap (safetensors refuses such a file): an error naming both."""
    spans = sorted((loc.offset, loc.offset + loc.nbytes, name) for name, loc in tensors.items() if loc.nbytes)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise OffloadError(
                f"{path}: invalid safetensors header: the bytes of tensors {first!r} and {second!r} "
                f"overlap (safetensors refuses such a file)"
            )


def checkpoint_files(checkpoint: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """The safetensors files of a checkpoint: a file, a list of files, or a folder (index json or *.safetensors)."""
    if isinstance(checkpoint, (str, os.PathLike)):
        p = Path(checkpoint)
        if p.is_dir():
            indexes = sorted(p.glob("*.safetensors.index.json"))
            if len(indexes) > 1:
                raise OffloadError(
                    f"checkpoint folder {p} holds {len(indexes)} safetensors indexes "
                    f"({', '.join(i.name for i in indexes)}): which one is meant is unclear; remove the "
                    f"others, or pass the files as a list"
                )
            if indexes:
                files = _index_files(p, indexes[0])
            else:
                files = [str(f) for f in sorted(p.glob("*.safetensors"))]
            if not files:
                raise OffloadError(f"checkpoint folder {p} holds no .safetensors file")
            return files
        return [str(p)]
    files = [os.fspath(f) for f in checkpoint]
    if not files:
        raise OffloadError("checkpoint: an empty list of files")
    return files


def _index_files(folder: Path, index: Path) -> list[str]:
    """The files an index's ``weight_map`` names, each inside ``folder`` (a ``..`` or absolute
    entry is refused: an index never makes graphpass read a file outside its folder)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        raise OffloadError(f"{index}: not a safetensors index (no 'weight_map')") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise OffloadError(
            f"{index}: not a safetensors index: its 'weight_map' must map tensor names to file "
            f"names, found {type(weight_map).__name__}; fix or remove the index file"
        )
    for name, f in weight_map.items():
        if not f or os.path.isabs(f) or ".." in Path(f).parts:
            raise OffloadError(
                f"{index}: tensor {name!r} is mapped to {f!r}, outside the checkpoint folder: an index "
                f"names files in its own folder"
            )
    return [str(folder / f) for f in dict.fromkeys(weight_map.values())]


def index_checkpoint(checkpoint) -> dict[str, TensorLocation]:
    """Every tensor of every file of ``checkpoint`` by name; a name in two files is an error."""
    out: dict[str, TensorLocation] = {}
    for f in checkpoint_files(checkpoint):
        if not os.path.exists(f):
            raise OffloadError(f"checkpoint file {f} does not exist")
        for name, loc in read_header(f).items():
            if name in out:
                raise OffloadError(f"tensor {name!r} appears in two checkpoint files: {out[name].path} and {f}")
            out[name] = loc
    return out


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def read_into(fd: int, loc: TensorLocation, dst: torch.Tensor) -> None:
    """Read ``loc``'s bytes into the contiguous CPU tensor ``dst`` (no mapping, no extra copy)."""
    view = byte_view(dst)
    if len(view) != loc.nbytes:
        raise OffloadError(f"tensor {loc.name!r}: destination holds {len(view)} bytes, the file {loc.nbytes}")
    done = 0
    while done < loc.nbytes:
        got = os.preadv(fd, [view[done:]], loc.offset + done)
        if got <= 0:
            raise OffloadError(
                f"tensor {loc.name!r}: {loc.path} ended after {done} of its {loc.nbytes} bytes (file truncated since it was opened?)"
            )
        done += got


def write_file(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    progress_desc: str | None = None,
) -> None:
    """Write ``tensors`` as one safetensors file, streaming each tensor's bytes (no whole-file buffer).
    With ``progress_desc``, a bar of the tensor bytes written (:func:`graphpass.progress.bar`: on a
    terminal only), advanced per tensor.

    The file appears under its name only once complete (:func:`graphpass.atomic_files.write_atomic`:
    a temporary file created exclusively in the same folder, flushed, then renamed), so a crash never
    leaves a half-written file under that name and a link planted in the folder is never followed.
    """
    path = os.fspath(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    order = []
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise OffloadError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        order.append((name, t))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)

    def write(fd: int) -> None:
        atomic_files.write_all(fd, struct.pack("<Q", len(raw)))
        atomic_files.write_all(fd, raw)
        with (
            progress.bar(offset, progress_desc, unit="B", unit_scale=True)
            if progress_desc
            else progress.silent() as shown
        ):
            for _name, t in order:
                cpu = t.detach().to("cpu").contiguous()
                atomic_files.write_all(fd, byte_view(cpu))
                shown.update(cpu.numel() * cpu.element_size())
                del cpu

    try:
        atomic_files.write_atomic(
            path, write, fsync=True
        )  # on failure the temporary file is removed: nothing partial is left
    except OSError as exc:
        raise OffloadError(
            f"cannot write the offload weights file {path}: {exc.strerror or exc}; free space there or choose "
            f"another disk_path (no partial file was left)"
        ) from exc
