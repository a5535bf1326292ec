"""The vLLM plugin: graphpass as vLLM's compiler, with tensor capture per engine step (docs/vllm.md).

Registered as ``graphpass = graphpass.integrations.vllm:register`` under vLLM's
``vllm.general_plugins`` entry point, so vLLM calls :func:`register` in every process it starts
(the caller's, the engine core, each worker). It does nothing unless the engine's
``additional_config`` has a ``"graphpass"`` key; then, when vLLM builds its config (before any
worker starts), :func:`update_config`:

- checks the settings (:mod:`.config`; a ``ConfigError`` naming the key, before serving);
- makes graphpass the compiler: ``compilation_config.mode = DYNAMO_TRACE_ONCE`` (one Dynamo graph of
  the whole model) and ``backend`` = :func:`graphpass.integrations.vllm.backend.vllm_backend`,
  which vLLM resolves by qualified name in each worker (vLLM's CPU platform would otherwise replace
  any backend with inductor);
- runs the workers as :class:`.worker.GraphpassCPUWorker`, which passes the ``options`` to graphpass
  and, with ``tensor_capture``, captures each engine step (:mod:`.steps`), and which turns vLLM's compile
  cache off in its own process (``VLLM_DISABLE_COMPILE_CACHE=1``; a graph loaded from that cache was never given
  to graphpass), never in the caller's, so a later engine of the caller keeps its cache.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ...errors import ConfigError, GraphpassError
from .config import KEY, PREFIX, VllmPluginConfig, parse
from .worker_errors import graphpass_error_in, new_report_path, raise_reported

log = logging.getLogger("graphpass.integrations.vllm")

BACKEND = "graphpass.integrations.vllm.backend.vllm_backend"
WORKERS = {"vllm.v1.worker.cpu_worker.CPUWorker": "graphpass.integrations.vllm.worker.GraphpassCPUWorker"}


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: wrap the current platform's
    ``check_and_update_config`` with :func:`update_config`. Safe to call more than once."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    original = platform.__dict__.get("check_and_update_config")
    if original is None or getattr(original.__func__, "_graphpass", False):
        return
    func = original.__func__

    @functools.wraps(func)
    def check_and_update_config(cls, vllm_config: Any) -> None:
        settings = parse(vllm_config.additional_config)  # before vLLM changes anything
        func(cls, vllm_config)
        if settings is not None:
            update_config(vllm_config, settings)

    check_and_update_config._graphpass = True
    platform.check_and_update_config = classmethod(check_and_update_config)
    _check_in_the_caller()
    _errors_reach_the_caller()


def _check_in_the_caller() -> None:
    """Check the settings when the caller's ``EngineArgs`` make the engine's config, before vLLM's own (a pydantic
    dataclass, which would wrap a ``ConfigError`` into its ``ValidationError``): a bad setting reaches the caller
    as a :class:`graphpass.ConfigError` naming it, before any engine process starts (issue 36, item 6)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    create = EngineArgs.__dict__.get("create_engine_config")
    if create is None or getattr(create, "_graphpass", False):
        return

    @functools.wraps(create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        settings = parse(getattr(self, "additional_config", None))
        if settings is None:
            return create(self, *args, **kwargs)
        _check_engine_args(self, settings)
        if settings.tensor_capture is not None:
            self.additional_config = _with_run(self.additional_config, settings.tensor_capture)
        if settings.report is None:  # where the engine's workers report graphpass's errors (worker_errors.py)
            self.additional_config = {**self.additional_config,
                                      KEY: {**self.additional_config[KEY], "report": new_report_path()}}
        try:
            return create(self, *args, **kwargs)
        except Exception as exc:  # vLLM's pydantic config wraps a ConfigError of update_config: unwrap it
            err = _graphpass_error_of(exc)
            if err is None or err is exc:
                raise
            raise err from exc

    create_engine_config._graphpass = True
    EngineArgs.create_engine_config = create_engine_config


def _graphpass_error_of(exc: BaseException) -> GraphpassError | None:
    """The graphpass error inside ``exc``: in its causes, or one of pydantic's ``ValidationError`` entries (a
    ``ValueError`` raised while vLLM's config validates keeps the original in the entry's ``ctx``)."""
    err = graphpass_error_in(exc)
    if err is not None:
        return err
    try:
        entries = exc.errors() if callable(getattr(exc, "errors", None)) else []
    except Exception:  # not pydantic's
        entries = []
    for entry in entries if isinstance(entries, list) else []:
        inner = (entry.get("ctx") or {}).get("error") if isinstance(entry, dict) else None
        if isinstance(inner, BaseException) and graphpass_error_in(inner) is not None:
            return graphpass_error_in(inner)
    return None


def _errors_reach_the_caller() -> None:
    """Where vLLM raises, in the caller, its own error for an engine that failed (start-up: ``RuntimeError``
    "Engine core initialization failed"; serving: ``EngineDeadError``), raise instead the graphpass error a
    worker of that engine reported, ``from`` vLLM's (:mod:`.worker_errors`)."""
    try:
        from vllm.v1.engine import core_client
    except ImportError:
        return
    for name in ("make_client", "make_async_mp_client"):
        _wrap(core_client.EngineCoreClient, name, lambda args, kwargs: _config_arg(args, kwargs), static=True)
    for cls_name, name in (("SyncMPClient", "get_output"), ("SyncMPClient", "call_utility"),
                           ("AsyncMPClient", "get_output_async"), ("AsyncMPClient", "call_utility_async")):
        cls = getattr(core_client, cls_name, None)
        if cls is not None:
            _wrap(cls, name, lambda args, kwargs: getattr(args[0], "vllm_config", None))


def _config_arg(args: tuple, kwargs: dict) -> Any:
    """The ``vllm_config`` argument of ``EngineCoreClient.make_client`` / ``make_async_mp_client``."""
    if "vllm_config" in kwargs:
        return kwargs["vllm_config"]
    return next((a for a in args if hasattr(a, "additional_config")), None)


def _wrap(owner: type, name: str, config_of: Any, static: bool = False) -> None:
    """``owner.name`` wrapped: an exception it raises becomes the graphpass error a worker reported, if any
    (``config_of(args, kwargs)``: the engine's vLLM config). Once per method."""
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
                raise_reported(config_of(args, kwargs), exc)
                raise
    else:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except Exception as exc:
                raise_reported(config_of(args, kwargs), exc)
                raise
    wrapper._graphpass = True
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def _check_engine_args(engine_args: Any, settings: VllmPluginConfig) -> None:
    """What the caller's ``EngineArgs`` already say against ``settings``: compilation turned off, or
    ``draft_modules`` without a speculative config whose method runs a draft model (a dict without ``method``
    is left to :func:`update_config`, once vLLM has resolved it)."""
    for flag in ("enforce_eager", "enable_lora"):
        if getattr(engine_args, flag, False):
            raise ConfigError(flag, True, f"graphpass ({PREFIX}) needs vLLM to compile the model, and "
                              f"{flag}=True turns compilation off: leave it out, or leave graphpass out")
    draft = settings.tensor_capture.draft_modules if settings.tensor_capture is not None else None
    spec = getattr(engine_args, "speculative_config", None)
    if draft and spec is None:
        _check_draft(None, draft)
    elif draft and isinstance(spec, dict) and "method" in spec:
        _check_draft(SimpleNamespace(method=spec["method"]), draft)


def update_config(vllm_config: Any, settings: VllmPluginConfig) -> None:
    """Make graphpass vLLM's compiler and its workers capture (see the module docstring)."""
    from vllm.config import CompilationMode

    comp = vllm_config.compilation_config
    if comp.mode == CompilationMode.NONE:
        raise ConfigError("compilation_config.mode", str(comp.mode), f"graphpass ({PREFIX}) needs vLLM to compile "
                          "the model, but compilation is off (enforce_eager=True, a LoRA adapter, or "
                          "compilation_config mode 0): turn it back on")
    if comp.mode != CompilationMode.DYNAMO_TRACE_ONCE or comp.backend != BACKEND:
        log.info("vLLM compiles with graphpass: compilation mode DYNAMO_TRACE_ONCE (was %s), backend %s (was %r)",
                 comp.mode, BACKEND, comp.backend)
    comp.mode = CompilationMode.DYNAMO_TRACE_ONCE
    comp.backend = BACKEND  # the compile cache is turned off by the worker, in its own process (worker.py)
    parallel = vllm_config.parallel_config
    worker = WORKERS.get(parallel.worker_cls)
    if worker is None and parallel.worker_cls not in WORKERS.values():
        raise ConfigError(PREFIX, "worker_cls", f"graphpass inside vLLM is supported with vLLM's CPU "
                          f"worker only; this engine uses {parallel.worker_cls!r}")
    parallel.worker_cls = worker or parallel.worker_cls
    if settings.tensor_capture is not None and settings.tensor_capture.draft_modules:
        _check_draft(vllm_config.speculative_config, settings.tensor_capture.draft_modules)


def _with_run(additional_config: Any, capture: Any) -> dict:
    """``additional_config`` (a copy) with the engine's run id in ``tensor_capture.run``, after checking that
    ``capture_dir`` holds no other run's steps: two runs in one folder would be compared as one (issue 36, items
    1 and 2). Every worker, on every rank, writes that id into each step's meta."""
    import uuid

    root = Path(capture.capture_dir)
    if root.is_dir():
        found = _runs_in(root)
        if found:
            runs = ", ".join(f"run {r}: {n} meta file(s)" if r != "?" else f"{n} meta file(s) of a run with no id"
                             for r, n in sorted(found.items()))
            raise ConfigError(f"{PREFIX}.tensor_capture.capture_dir", str(root),
                              f"holds the captures of another run ({runs}): give an empty or new folder, or "
                              "remove them; two runs in one folder would be compared as one")
    gp = dict(additional_config[KEY])
    gp["tensor_capture"] = {**gp["tensor_capture"], "run": capture.run or uuid.uuid4().hex[:16]}
    return {**additional_config, KEY: gp}


def _runs_in(root: Path) -> dict[str, int]:
    """Run id -> how many step meta files (``{step}_meta.json``, ``{step}_meta.rank{r}.json``) below ``root`` name
    it (``"?"``: a meta with no run id, or unreadable): what a capture folder already holds."""
    found: dict[str, int] = {}
    for meta in root.rglob("*_meta*.json"):
        try:
            run = json.loads(meta.read_text()).get("run")
        except (OSError, ValueError, AttributeError):
            run = None
        key = run if isinstance(run, str) else "?"
        found[key] = found.get(key, 0) + 1
    return found


# speculative decoding methods whose drafter runs a model of its own (vLLM's SpeculativeConfig.method)
DRAFT_METHODS = ("draft_model", "eagle", "eagle3", "mtp")


def _check_draft(spec: Any, draft_modules: tuple[str, ...]) -> None:
    """``draft_modules`` needs speculative decoding with a draft model (ngram and suffix decoding have none)."""
    method = getattr(spec, "method", None)
    if method not in DRAFT_METHODS:
        why = "no speculative_config" if spec is None else f"speculative_config method {method!r}, which runs no model"
        raise ConfigError(f"{PREFIX}.tensor_capture.draft_modules", list(draft_modules),
                          f"captures the draft model of speculative decoding, but this engine has {why}: give "
                          f"speculative_config a draft model (method one of {', '.join(DRAFT_METHODS)}; "
                          "'draft_model' is the tested one) or leave draft_modules out")
