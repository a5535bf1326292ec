"""The vLLM plugin: graphpass as vLLM's compiler, with tensor capture per engine step (docs/vllm.md).

vLLM's ``vllm.general_plugins`` entry point is ``graphpass = graphpass_vllm_plugin:register``, a module outside
this package that vLLM loads in every process it starts (the caller's, the engine core, each worker): it imports
nothing of graphpass unless an engine's ``additional_config`` has a ``"graphpass"`` key (this package's import
loads the compiler), and then calls :func:`check_and_update_config` and, in the caller,
:func:`create_engine_config` here. When vLLM builds its config (before any worker starts), :func:`update_config`:

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

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ...errors import ConfigError, GraphpassError
from .config import KEY, PREFIX, VllmPluginConfig, parse
from .worker_errors import graphpass_error_in, new_report_path

log = logging.getLogger("graphpass.integrations.vllm")

BACKEND = "graphpass.integrations.vllm.backend.vllm_backend"
WORKERS = {"vllm.v1.worker.cpu_worker.CPUWorker": "graphpass.integrations.vllm.worker.GraphpassCPUWorker"}


def register() -> None:
    """vLLM's entry point, as :func:`graphpass_vllm_plugin.register` (which vLLM calls: it imports nothing of graphpass
    until an engine asks for it). Safe to call more than once."""
    import graphpass_vllm_plugin

    graphpass_vllm_plugin.register()


def check_and_update_config(func: Any, cls: Any, vllm_config: Any) -> None:
    """The platform's ``check_and_update_config`` (``func``) for an engine whose ``additional_config`` has
    ``"graphpass"``: the settings parsed before vLLM changes anything, then :func:`update_config`."""
    settings = parse(vllm_config.additional_config)
    func(cls, vllm_config)
    if settings is not None:
        update_config(vllm_config, settings)


def create_engine_config(create: Any, engine_args: Any, *args: Any, **kwargs: Any) -> Any:
    """``EngineArgs.create_engine_config`` (``create``) in the caller, for an engine with graphpass: the settings
    checked before vLLM's own config (a pydantic dataclass, which would wrap a ``ConfigError`` into its
    ``ValidationError``), so a bad setting reaches the caller as a :class:`graphpass.ConfigError` naming it before
    any engine process starts (issue 36, item 6); the engine's run id and its error-report file (where its
    workers write a graphpass error for the caller: :mod:`.worker_errors`) added to its ``additional_config``."""
    settings = parse(getattr(engine_args, "additional_config", None))
    if settings is None:
        return create(engine_args, *args, **kwargs)
    import graphpass_vllm_plugin

    graphpass_vllm_plugin.wrap_clients()  # this process starts a graphpass engine: its errors come through here
    _check_engine_args(engine_args, settings)
    if settings.tensor_capture is not None:
        engine_args.additional_config = _with_run(engine_args.additional_config, settings.tensor_capture)
    if settings.report is None:
        engine_args.additional_config = {
            **engine_args.additional_config,
            KEY: {**engine_args.additional_config[KEY], "report": new_report_path()},
        }
    try:
        return create(engine_args, *args, **kwargs)
    except Exception as exc:  # vLLM's pydantic config wraps a ConfigError of update_config: unwrap it
        err = _graphpass_error_of(exc)
        if err is None or err is exc:
            raise
        raise err from exc


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


def _check_engine_args(engine_args: Any, settings: VllmPluginConfig) -> None:
    """What the caller's ``EngineArgs`` already say against ``settings``: compilation turned off, or
    ``draft_modules`` without a speculative config whose method runs a draft model (a dict without ``method``
    is left to :func:`update_config`, once vLLM has resolved it)."""
    for flag in ("enforce_eager", "enable_lora"):
        if getattr(engine_args, flag, False):
            raise ConfigError(
                flag,
                True,
                f"graphpass ({PREFIX}) needs vLLM to compile the model, and "
                f"{flag}=True turns compilation off: leave it out, or leave graphpass out",
            )
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
        raise ConfigError(
            "compilation_config.mode",
            str(comp.mode),
            f"graphpass ({PREFIX}) needs vLLM to compile "
            "the model, but compilation is off (enforce_eager=True, a LoRA adapter, or "
            "compilation_config mode 0): turn it back on",
        )
    if comp.mode != CompilationMode.DYNAMO_TRACE_ONCE or comp.backend != BACKEND:
        log.info(
            "vLLM compiles with graphpass: compilation mode DYNAMO_TRACE_ONCE (was %s), backend %s (was %r)",
            comp.mode,
            BACKEND,
            comp.backend,
        )
    comp.mode = CompilationMode.DYNAMO_TRACE_ONCE
    comp.backend = BACKEND  # the compile cache is turned off by the worker, in its own process (worker.py)
    parallel = vllm_config.parallel_config
    worker = WORKERS.get(parallel.worker_cls)
    if worker is None and parallel.worker_cls not in WORKERS.values():
        raise ConfigError(
            PREFIX,
            "worker_cls",
            f"graphpass inside vLLM is supported with vLLM's CPU worker only; this engine uses {parallel.worker_cls!r}",
        )
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
            runs = ", ".join(
                f"run {r}: {n} meta file(s)" if r != "?" else f"{n} meta file(s) of a run with no id"
                for r, n in sorted(found.items())
            )
            raise ConfigError(
                f"{PREFIX}.tensor_capture.capture_dir",
                str(root),
                f"holds the captures of another run ({runs}): give an empty or new folder, or "
                "remove them; two runs in one folder would be compared as one",
            )
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
        raise ConfigError(
            f"{PREFIX}.tensor_capture.draft_modules",
            list(draft_modules),
            f"captures the draft model of speculative decoding, but this engine has {why}: give "
            f"speculative_config a draft model (method one of {', '.join(DRAFT_METHODS)}; "
            "'draft_model' is the tested one) or leave draft_modules out",
        )
