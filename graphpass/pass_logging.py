"""``GRAPHPASS_LOG``: the pipeline's logging turned on without code, the way ``TORCH_LOGS`` does for Dynamo.

Every pass reports to ``logging.getLogger("graphpass.passes.<name>")`` at DEBUG (its wall time and what
it changed; :func:`graphpass.passes.base.run_pass`); ``graphpass.graphs`` carries the graphs themselves.
``GRAPHPASS_LOG=+passes`` (each pass), ``passes`` (one line per graph), ``+graphs`` (each graph before and
after each pass), ``graphs`` (each graph after the pipeline), ``all``; comma-separated.
:func:`graphpass.pipeline.run_pipeline` applies it (:func:`configure_logging_from_env`) before each graph.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

# Logging configuration is process-wide by nature (the logging module's loggers are); this records
# which GRAPHPASS_LOG value it was configured for and exactly what graphpass itself set (its own
# handler, and each level it set with the level the logger had before), under a lock. graphpass
# never changes a level or a handler it did not set: with GRAPHPASS_LOG unset nothing is touched,
# and when the value changes graphpass undoes only its own settings, and only where the logger
# still holds what graphpass put there (an application that set a level since keeps it).
_LOG_LOCK = threading.Lock()
_LOG_STATE: dict[str, Any] = {"value": "", "handler": None, "levels": {}}
_TOPICS = {"passes": "graphpass", "graphs": "graphpass.graphs", "all": "graphpass"}


def configure_logging_from_env() -> None:
    """Apply ``GRAPHPASS_LOG`` (see the module docstring); unknown topics are ignored with a warning."""
    value = os.environ.get("GRAPHPASS_LOG", "")
    if value == _LOG_STATE["value"]:
        return
    with _LOG_LOCK:
        if value == _LOG_STATE["value"]:
            return
        _undo_own_logging()
        levels = _levels_for(value)
        if levels:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            root = logging.getLogger("graphpass")
            root.addHandler(handler)
            _LOG_STATE["handler"] = handler
            for name in ("graphpass", "graphpass.graphs"):
                logger = logging.getLogger(name)
                level = levels.get(name, logging.WARNING)
                _LOG_STATE["levels"][name] = (logger.level, level)
                logger.setLevel(level)
        _LOG_STATE["value"] = value


def _levels_for(value: str) -> dict[str, int]:
    """The logger levels a ``GRAPHPASS_LOG`` value asks for, by logger name."""
    levels: dict[str, int] = {}
    for token in (t.strip() for t in value.split(",")):
        if not token:
            continue
        topic = token.lstrip("+")
        if topic not in _TOPICS:
            import warnings

            warnings.warn(f"GRAPHPASS_LOG: unknown topic {topic!r} (known: {', '.join(sorted(_TOPICS))})", stacklevel=3)
            continue
        level = logging.DEBUG if token.startswith("+") else logging.INFO
        levels[_TOPICS[topic]] = min(levels.get(_TOPICS[topic], logging.WARNING), level)
        if topic == "all":
            levels["graphpass.graphs"] = level
    return levels


def _undo_own_logging() -> None:
    """Remove the handler graphpass added and restore the levels it set, where still its own."""
    handler = _LOG_STATE["handler"]
    if handler is not None:
        logging.getLogger("graphpass").removeHandler(handler)
        _LOG_STATE["handler"] = None
    for name, (before, ours) in _LOG_STATE["levels"].items():
        logger = logging.getLogger(name)
        if logger.level == ours:
            logger.setLevel(before)
    _LOG_STATE["levels"] = {}
