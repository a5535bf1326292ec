"""The plugin's settings: ``LLM(..., additional_config={"graphpass": {...}})``, checked before serving.

::

    {"graphpass": {
        "options": {"then": "eager"},            # graphpass.backend(**options): delegate, traps, ...
        "tensor_capture": {"modules": ["model.layers.0-1"], "capture_dir": "caps",
                           "capture_filter": None, "draft_modules": None},
        "offload": {...},                         # refused on vLLM's CPU engine (packed oneDNN weights)
        "report": "/tmp/graphpass-vllm-....error.json",  # set by the plugin: where a worker's error goes
    }}

Every problem is a :class:`graphpass.errors.ConfigError` naming the key
(``additional_config.graphpass.tensor_capture.modules``), raised when vLLM builds its config, in the
process that creates the ``LLM``, before any worker starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from ...errors import ConfigError

KEY = "graphpass"
PREFIX = f"additional_config.{KEY}"
CAPTURE_KEYS = ("modules", "capture_dir", "capture_filter", "draft_modules", "run")
TOP_KEYS = ("options", "tensor_capture", "offload", "report")

# why offload is refused, and what avoids it (docs/vllm.md "Offload")
OFFLOAD_REFUSED = (
    "offload inside vLLM's CPU engine is not supported: vLLM's CPU linear layers repack their weights into "
    "oneDNN handles after loading (packed oneDNN weights, not torch parameters), so graphpass cannot see, "
    "move or reload them. Leave 'offload' out of additional_config.graphpass (serve the model without "
    "offload), or offload with graphpass.offload() outside vLLM, on a transformers model"
)


@dataclass(frozen=True)
class TensorCaptureConfig:
    """``tensor_capture``: which modules of the served model (``modules``, patterns as in
    ``ModelCapture``) are captured into ``capture_dir``; ``capture_filter``: which of them are written;
    ``draft_modules``: which modules of the draft model (speculative decoding) are captured, into
    ``capture_dir/draft``."""

    modules: tuple[str, ...]
    capture_dir: str
    capture_filter: tuple[str, ...] | None = None
    draft_modules: tuple[str, ...] | None = None
    run: str | None = None  # the engine's run id, in every step's meta (set by the plugin in the caller)


@dataclass(frozen=True)
class VllmPluginConfig:
    """``additional_config["graphpass"]``: ``options`` for ``graphpass.backend`` and ``tensor_capture``."""

    options: Mapping[str, Any]
    tensor_capture: TensorCaptureConfig | None
    report: str | None = None  # where a worker writes a graphpass error for the caller (set by the plugin)


def _patterns(key: str, value: Any, *, required: bool) -> tuple[str, ...] | None:
    if value is None and not required:
        return None
    if (
        isinstance(value, str)
        or not isinstance(value, (list, tuple))
        or not value
        or not all(isinstance(v, str) and v for v in value)
    ):
        raise ConfigError(f"{PREFIX}.tensor_capture.{key}", value, "must be a non-empty list of module patterns")
    return tuple(value)


def _capture(value: Any) -> TensorCaptureConfig | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{PREFIX}.tensor_capture", value, "must be a dict")
    unknown = sorted(set(value) - set(CAPTURE_KEYS))
    if unknown:
        raise ConfigError(f"{PREFIX}.tensor_capture", unknown, f"unknown keys; known: {', '.join(CAPTURE_KEYS)}")
    capture_dir = value.get("capture_dir")
    if not isinstance(capture_dir, (str, os.PathLike)) or not str(capture_dir):
        raise ConfigError(f"{PREFIX}.tensor_capture.capture_dir", capture_dir, "must be a folder path")
    if os.path.exists(capture_dir) and not os.path.isdir(capture_dir):
        raise ConfigError(
            f"{PREFIX}.tensor_capture.capture_dir",
            os.fspath(capture_dir),
            "is a file, not a folder: give a folder (it is made if missing)",
        )
    _check_makeable(os.path.abspath(os.fspath(capture_dir)))
    return TensorCaptureConfig(
        modules=_patterns("modules", value.get("modules"), required=True),
        # absolute: the workers may not share the caller's working folder
        capture_dir=os.path.abspath(os.fspath(capture_dir)),
        capture_filter=_patterns("capture_filter", value.get("capture_filter"), required=False),
        draft_modules=_patterns("draft_modules", value.get("draft_modules"), required=False),
        run=_run(value.get("run")),
    )


def _check_makeable(folder: str) -> None:
    """``folder`` exists, or its nearest existing parent is a folder this process may write into (the workers
    make it; a parent that is a file or read-only would stop them only when the model is loaded)."""
    parent = folder
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent == folder:
        return
    if not os.path.isdir(parent):
        raise ConfigError(
            f"{PREFIX}.tensor_capture.capture_dir", folder, f"cannot be made: {parent!r} is a file, not a folder"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{PREFIX}.tensor_capture.capture_dir", folder, f"cannot be made: the folder {parent!r} is not writable"
        )


def _run(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value or not value.isprintable()):
        raise ConfigError(f"{PREFIX}.tensor_capture.run", value, "must be a non-empty printable str (a run id)")
    return value


def parse(additional_config: Any) -> VllmPluginConfig | None:
    """The plugin's settings from vLLM's ``additional_config``; None when it has no ``"graphpass"`` key."""
    if not isinstance(additional_config, Mapping) or KEY not in additional_config:
        return None
    value = additional_config[KEY]
    if not isinstance(value, Mapping):
        raise ConfigError(PREFIX, value, "must be a dict")
    unknown = sorted(set(value) - set(TOP_KEYS))
    if unknown:
        raise ConfigError(PREFIX, unknown, f"unknown keys; known: {', '.join(TOP_KEYS)}")
    if value.get("offload") is not None:
        raise ConfigError(f"{PREFIX}.offload", value["offload"], OFFLOAD_REFUSED)
    options = value.get("options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{PREFIX}.options", options, "must be a dict of graphpass.backend options")
    from ...dynamo_backend import backend

    backend(**options)  # validates the options now (ConfigError naming the option)
    report = value.get("report")
    if report is not None and (not isinstance(report, str) or not os.path.isabs(report)):
        raise ConfigError(f"{PREFIX}.report", report, "must be an absolute file path (the plugin sets it)")
    return VllmPluginConfig(options=dict(options), tensor_capture=_capture(value.get("tensor_capture")), report=report)
