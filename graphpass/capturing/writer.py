"""``CaptureWriter``: writes one step's captured tensors as safetensors files (write, then rename)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import CaptureError
from ..patterns import compile_patterns

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]]+$")


def _check_component(value: str, what: str) -> str:
    if not value or value in (".", "..") or not _SAFE_NAME.match(value):
        raise CaptureError(f"{what} {value!r} cannot be used as a directory name under capture_dir")
    return value


class CaptureWriter:
    """Writes one step's captures under ``capture_dir``; every file lands by write-then-rename."""

    def __init__(
        self,
        capture_dir: str | os.PathLike,
        subdirectory: str | None = None,
        dp_rank: int = 0,
        tp_rank: int = 0,
        capture_filter: Sequence[str] | None = None,
    ) -> None:
        self.capture_dir = Path(capture_dir)
        if subdirectory is not None:
            for part in Path(subdirectory).parts:
                _check_component(part, "subdirectory part")
            if Path(subdirectory).is_absolute():
                raise CaptureError(f"subdirectory {subdirectory!r} must be relative to capture_dir")
        self.subdirectory = subdirectory
        self.dp_rank = int(dp_rank)
        self.tp_rank = int(tp_rank)
        self.filter = compile_patterns(list(capture_filter), "capture_filter") if capture_filter is not None else None
        self._counts: dict[str, int] = {}
        self._check_writable()

    def _check_writable(self) -> None:
        try:
            self.capture_dir.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".graphpass-probe-", dir=self.capture_dir)
            os.close(fd)
            os.unlink(probe)
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

    def write(self, tensors: Sequence[tuple[str, torch.Tensor]], *, is_prefill: bool, size: int, meta: dict) -> list[Path]:
        """Write ``tensors`` (name, tensor pairs in execution order) as one step. Returns the step dirs."""
        from safetensors.torch import save_file

        step = self.step_name(is_prefill, size)
        grouped: dict[str, list[torch.Tensor]] = {}
        for name, t in tensors:
            _check_component(name, "capture name")
            if self.filter is not None and not any(p.matches(name) for p in self.filter):
                continue
            grouped.setdefault(name, []).append(t)
        root = self.capture_dir.resolve()
        by_base: dict[Path, list[str]] = {}
        for name in grouped:
            by_base.setdefault(self._base(name), []).append(name)
        written: list[Path] = []
        for base, names in by_base.items():
            step_dir = base / step
            if not step_dir.resolve().is_relative_to(root):
                raise CaptureError(f"capture path {step_dir} would leave capture_dir")
            step_dir.mkdir(parents=True, exist_ok=True)
            info: dict[str, list[dict]] = {}
            for name in names:
                mod_dir = step_dir / name
                if not mod_dir.resolve().is_relative_to(root):
                    raise CaptureError(f"capture name {name!r} would leave capture_dir")
                mod_dir.mkdir(exist_ok=True)
                payload = {str(i): t.detach().to("cpu").contiguous() for i, t in enumerate(grouped[name])}
                _atomic(mod_dir / f"rank{self.tp_rank}.safetensors", lambda p, d=payload: save_file(d, str(p)))
                info[name] = [{"key": k, "dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
                              for k, v in payload.items()]
            doc = dict(meta, step=step, phase="prefill" if is_prefill else "decode", size=size, modules=names,
                       tensors=info, dp_rank=self.dp_rank, tp_rank=self.tp_rank)
            _atomic(step_dir / f"{step}_meta.json", lambda p, d=doc: p.write_text(json.dumps(d, indent=2, default=_jsonable)))
            written.append(step_dir)
        phase = "prefill" if is_prefill else "decode"
        self._counts[phase] = self._counts.get(phase, 0) + 1
        return written


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
