"""graphpass's vLLM plugin entry point (``vllm.general_plugins``: ``graphpass = graphpass_vllm_plugin:register``).

vLLM loads its general plugins in every process it starts (the caller's, the engine core, each worker), whether or
not an engine asks for graphpass. So this module imports nothing of graphpass (nor any module of vLLM that the
process has not loaded), and :func:`register` only wraps a few places of vLLM with a check of whether the engine's ``additional_config`` has a ``"graphpass"`` key. Only for an
engine that has one is :mod:`graphpass.integrations.vllm` imported, which does the work (docs/vllm.md):

- the platform's ``check_and_update_config`` (vLLM's config, in every process that builds one): graphpass becomes
  the compiler and the workers capture;
- ``EngineArgs.create_engine_config`` (the caller): the settings checked before vLLM's pydantic config could wrap
  their ``ConfigError``, the engine's run id and error-report file;
- ``EngineCoreClient.make_client`` / ``make_async_mp_client`` and the clients' ``get_output`` /
  ``call_utility`` (the caller), on an exception only: a graphpass error a worker reported is raised instead of
  vLLM's own. Installed by :func:`wrap_clients` when the caller makes a graphpass engine's config.

Kept outside the ``graphpass`` package: importing any module of it runs ``graphpass/__init__``, which loads the
whole compiler (about 1.5 s in a vLLM process, each process). Every wrapper is installed once per process.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

KEY = "graphpass"


def configured(additional_config: Any) -> bool:
    """Whether an engine's ``additional_config`` asks for graphpass (a ``"graphpass"`` key)."""
    return hasattr(additional_config, "keys") and KEY in additional_config


def register() -> None:
    """vLLM's entry point: install the wrappers (see the module docstring). Safe to call more than once."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    original = platform.__dict__.get("check_and_update_config")
    if original is not None and not getattr(original.__func__, "_graphpass", False):
        func = original.__func__

        @functools.wraps(func)
        def check_and_update_config(cls: Any, vllm_config: Any) -> Any:
            if not configured(getattr(vllm_config, "additional_config", None)):
                return func(cls, vllm_config)
            from graphpass.integrations import vllm as plugin

            return plugin.check_and_update_config(func, cls, vllm_config)

        check_and_update_config._graphpass = True
        platform.check_and_update_config = classmethod(check_and_update_config)
    _wrap_engine_args()


def _wrap_engine_args() -> None:
    """Wrap ``EngineArgs.create_engine_config`` in a process that has vLLM's ``arg_utils`` loaded: the caller's (vLLM
    loads the plugins there from ``EngineArgs`` itself). The engine core and the workers build no engine config, and
    importing ``arg_utils`` there would cost seconds."""
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    EngineArgs = getattr(arg_utils, "EngineArgs", None)
    if EngineArgs is None:
        return
    create = EngineArgs.__dict__.get("create_engine_config")
    if create is None or getattr(create, "_graphpass", False):
        return

    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not configured(getattr(self, "additional_config", None)):
            return create(self, *args, **kwargs)
        from graphpass.integrations import vllm as plugin

        return plugin.create_engine_config(create, self, *args, **kwargs)

    create_engine_config._graphpass = True
    EngineArgs.create_engine_config = create_engine_config


def wrap_clients() -> None:
    """Wrap vLLM's engine-core clients (see the module docstring). Called by graphpass when the caller makes the
    config of an engine with graphpass: only a process that starts such an engine loads ``core_client`` for it."""
    try:
        from vllm.v1.engine import core_client
    except ImportError:
        return
    for name in ("make_client", "make_async_mp_client"):
        _wrap(core_client.EngineCoreClient, name, _config_arg, static=True)
    for cls_name, name in (
        ("SyncMPClient", "get_output"),
        ("SyncMPClient", "call_utility"),
        ("AsyncMPClient", "get_output_async"),
        ("AsyncMPClient", "call_utility_async"),
    ):
        cls = getattr(core_client, cls_name, None)
        if cls is not None:
            _wrap(cls, name, lambda args, kwargs: getattr(args[0], "vllm_config", None))


def _config_arg(args: tuple, kwargs: dict) -> Any:
    """The ``vllm_config`` argument of ``EngineCoreClient.make_client`` / ``make_async_mp_client``."""
    if "vllm_config" in kwargs:
        return kwargs["vllm_config"]
    return next((a for a in args if hasattr(a, "additional_config")), None)


def _reraise(config: Any, exc: BaseException) -> None:
    """For an engine with graphpass: raise the graphpass error one of its workers reported, ``from exc``."""
    if configured(getattr(config, "additional_config", None)):
        from graphpass.integrations.vllm.worker_errors import raise_reported

        raise_reported(config, exc)


def _wrap(owner: type, name: str, config_of: Callable[[tuple, dict], Any], static: bool = False) -> None:
    """``owner.name`` wrapped: an exception it raises becomes the graphpass error a worker of the engine
    (``config_of(args, kwargs)``: its vLLM config) reported, if any."""
    func = owner.__dict__.get(name)
    func = func.__func__ if isinstance(func, staticmethod) else func
    if func is None or getattr(func, "_graphpass", False):
        return
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return await func(*args, **kwargs)
            except Exception as exc:
                _reraise(config_of(args, kwargs), exc)
                raise
    else:

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except Exception as exc:
                _reraise(config_of(args, kwargs), exc)
                raise

    wrapper._graphpass = True
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)
