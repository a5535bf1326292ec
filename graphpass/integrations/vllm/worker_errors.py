"""graphpass's errors in a vLLM worker, raised again in the caller's process.

Some settings only a worker can check: ``modules`` against the served model's module names (vLLM builds the
model in the worker), the draft model's ``draft_modules``, ``options`` that need the traced graph (``traps``
matching nothing). Some problems only arise while serving (a capture step that cannot be written). vLLM reports
a worker that fails at start-up to its caller as ``RuntimeError: Engine core initialization failed. See root
cause above``, and one that fails while serving as ``EngineDeadError``: the reason stays in the worker's log.

So the caller gives each engine a report file (``additional_config.graphpass.report``, a path in the caller's
temporary folder, set by the plugin when the caller's ``EngineArgs`` make the config; nothing is created there
until a worker has something to report). A worker that stops on a :class:`graphpass.GraphpassError` writes it
there (JSON: the class name, the ``ConfigError`` key, value and problem, the message; atomically, never followed
through a link), its ``ConfigError`` keys first made the config path of the setting
(``modules`` -> ``additional_config.graphpass.tensor_capture.modules``). The caller, where vLLM raises its own
error (:func:`raise_reported`), raises the same graphpass class with the same message instead, ``from`` vLLM's
error, and removes the file. Only classes of :mod:`graphpass.errors` are rebuilt; the file is never unpickled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import uuid
from typing import Any, Iterator

from ... import errors
from ...atomic_files import write_bytes_atomic
from .config import KEY, PREFIX

log = logging.getLogger("graphpass.integrations.vllm")

# what a worker's ModelCapture / graphpass.backend call a setting -> its path in additional_config, per section
SECTIONS = {
    "options": {},  # graphpass.backend's own keys: additional_config.graphpass.options.<key>
    "tensor_capture": {
        "modules": "tensor_capture.modules",
        "capture_filter": "tensor_capture.capture_filter",
        "run": "tensor_capture.run",
    },
    "draft": {"modules": "tensor_capture.draft_modules"},
}


def new_report_path() -> str:
    """A path for one engine's report file, in the caller's temporary folder (not created)."""
    return os.path.join(tempfile.gettempdir(), f"graphpass-vllm-{uuid.uuid4().hex}.error.json")


def in_config_terms(err: errors.GraphpassError, section: str) -> errors.GraphpassError:
    """``err`` with a ``ConfigError``'s key made the path of the setting in ``additional_config`` (``modules`` of
    the draft model's capture -> ``additional_config.graphpass.tensor_capture.draft_modules``); other errors, and a
    key already a path, as they are."""
    if not isinstance(err, errors.ConfigError) or str(err.key).startswith(PREFIX):
        return err
    names = SECTIONS.get(section, {})
    path = f"{PREFIX}.{names[err.key]}" if err.key in names else f"{PREFIX}.{section}.{err.key}"
    try:
        return _plain_class(err)(path, err.value, err.problem)
    except TypeError:  # a subclass with another signature: keep it, the message names the key
        return err


def _plain_class(err: errors.GraphpassError) -> type:
    """``err``'s class as :mod:`graphpass.errors` defines it (not the twin :func:`graphpass.errors.surface` makes
    for Dynamo), or the nearest one it has."""
    for cls in type(err).__mro__:
        if getattr(errors, cls.__name__, None) is cls:
            return cls
    return errors.GraphpassError


def graphpass_error_in(exc: BaseException | None) -> errors.GraphpassError | None:
    """The first :class:`graphpass.GraphpassError` in ``exc`` or its causes and contexts (vLLM and Dynamo wrap)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, errors.GraphpassError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def reported(vllm_config: Any, section: str) -> Iterator[None]:
    """In a worker: a graphpass error raised inside is written to the engine's report file (in config terms,
    ``section`` of the settings), then raised on as it was."""
    try:
        yield
    except BaseException as exc:
        err = graphpass_error_in(exc)
        path = _report_path(vllm_config)
        if err is not None and path is not None:
            write_report(path, in_config_terms(err, section), f"{PREFIX}.{section}")
        raise


def write_report(path: str, err: errors.GraphpassError, setting: str = PREFIX) -> None:
    """Write ``err`` to the report file ``path`` (the first report of an engine is kept: later ones are its
    consequences, or another rank's copy); ``setting``: the config path of what the worker was doing."""
    if os.path.lexists(path):
        return
    doc = {"class": _plain_class(err).__name__, "message": str(err), "pid": os.getpid(), "setting": setting}
    if isinstance(err, errors.ConfigError):
        doc.update(key=str(err.key), value=_jsonable(err.value), problem=str(err.problem))
    try:
        write_bytes_atomic(path, json.dumps(doc).encode())
    except OSError as exc:  # the worker's own error still goes up as it is
        log.warning("graphpass could not write its error report %s: %s", path, exc)


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _report_path(vllm_config: Any) -> str | None:
    gp = (getattr(vllm_config, "additional_config", None) or {}).get(KEY)
    path = gp.get("report") if isinstance(gp, dict) else None
    return path if isinstance(path, str) and path else None


def read_report(vllm_config: Any) -> errors.GraphpassError | None:
    """In the caller: the graphpass error a worker of this engine reported (the file is removed), or None."""
    path = _report_path(vllm_config)
    if path is None or not os.path.isfile(path) or os.path.islink(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        os.unlink(path)
    except (OSError, ValueError) as exc:
        log.warning("graphpass could not read the error report %s of a vLLM worker: %s", path, exc)
        return None
    return _rebuilt(doc) if isinstance(doc, dict) else None


def _rebuilt(doc: dict) -> errors.GraphpassError:
    """The error a report describes: its class if :mod:`graphpass.errors` has it, else a GraphpassError."""
    name = doc.get("class")
    cls = getattr(errors, name, None) if isinstance(name, str) and name in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, errors.GraphpassError)):
        cls = errors.GraphpassError
    if issubclass(cls, errors.ConfigError) and "key" in doc:
        return cls(doc["key"], doc.get("value"), str(doc.get("problem", "")))
    message = (
        f"{doc.get('message', '')} [raised in a vLLM worker of this engine (pid {doc.get('pid')}), "
        f"for {doc.get('setting') or PREFIX}]"
    )
    try:
        return cls(message)
    except TypeError:  # a class with another signature
        return errors.GraphpassError(message)


def raise_reported(vllm_config: Any, exc: BaseException) -> None:
    """In the caller, where vLLM raises ``exc`` for a failed engine: raise the graphpass error a worker reported
    instead (``from exc``); return if there is none."""
    err = read_report(vllm_config)
    if err is not None:
        raise err from exc
