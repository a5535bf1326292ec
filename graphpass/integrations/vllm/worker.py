"""vLLM's CPU worker with graphpass: ``parallel_config.worker_cls`` when ``additional_config`` has "graphpass".

- it runs vLLM's compilation (warm-up) and its steps inside ``set_current_vllm_config``, so that
  :func:`.backend.vllm_backend` reads the ``options`` (vLLM's CPU worker does not set it there);
- after the model is loaded (before vLLM's warm-up compiles it), a :class:`graphpass.ModelCapture`
  of the served model (``model_runner.model``, module names as vLLM's: ``model.layers.0``) with the
  ``tensor_capture`` settings, laid out per data-parallel rank (``dp{d}``) and tensor-parallel rank
  (``rank{r}``, from vLLM's tensor-parallel group);
- each ``_model_forward`` of the runner (one per engine step; vLLM's warm-up and profile runs call
  the model directly, so they are never steps) runs inside ``capture.step(...)`` named and described
  by :func:`.steps.engine_step`;
- with ``draft_modules`` (speculative decoding with a draft model), a second ModelCapture of the
  drafter's model (``model_runner.drafter.model``) writes under ``capture_dir/draft/``: each forward of
  the draft model is one step (:func:`.steps.draft_step`; the drafter runs it once over the target
  step's tokens, then once per further speculative token), its meta with ``draft_pass`` (0, 1, ...)
  and ``target_step_index`` (the ``step_index`` of the target step it drafts after);
- capture is enabled only after vLLM's warm-up (``compile_or_warm_up_model``). Enabling it changes
  no graph: the capture nodes are compiled in from the first (warm-up) compilation.

The class is made on first access (``module.__getattr__``), so this module imports without vLLM
(graphpass's own checks import every module).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ...capture_format import VLLM_ENGINE, EngineStepMeta
from ...errors import ConfigError
from .config import PREFIX, parse
from .steps import EngineStep, draft_step, engine_step, forward_query_starts, parent_of, prefix_cached
from .worker_errors import reported

log = logging.getLogger("graphpass.integrations.vllm")


def _ranks(vllm_config: Any) -> tuple[int, Any]:
    """``(dp_rank, tp)``: vLLM's data-parallel rank, and its tensor-parallel group (a ProcessGroup:
    ModelCapture takes the rank and the size from it), or 0 without one."""
    from vllm.distributed import parallel_state

    dp_rank = int(vllm_config.parallel_config.data_parallel_rank or 0)
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        return dp_rank, parallel_state.get_tp_group().cpu_group
    return dp_rank, 0


def __getattr__(name: str) -> Any:
    if name == "GraphpassCPUWorker":
        return _worker_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _worker_class() -> type:
    from vllm.v1.worker.cpu_worker import CPUWorker

    return type("GraphpassCPUWorker", (_GraphpassWorkerMixin, CPUWorker), {"__module__": __name__})


class _GraphpassWorkerMixin:
    """vLLM's CPU worker, capturing each engine step with graphpass (see the module docstring)."""

    graphpass_capture: Any = None
    graphpass_draft_capture: Any = None
    graphpass_steps: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM's compile cache off in this worker's process (a graph loaded from it was never given to graphpass),
        # set here, before the model is built and before vLLM caches its environment, never in the caller's
        # process: a later engine there keeps its cache (issue 36, item 8)
        os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        super().__init__(*args, **kwargs)

    def determine_available_memory(self) -> int:
        # vLLM's CPU worker compiles here (warm-up): graphpass's errors reach the caller (worker_errors.py)
        with _current(self), reported(self.vllm_config, "options"):
            return super().determine_available_memory()

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        steps = getattr(self, "graphpass_steps", None)
        if steps is not None:  # what this engine step's scheduler served from the prefix cache (steps.py)
            steps.cached = prefix_cached(args[0] if args else kwargs.get("scheduler_output"))
        with _current(self), reported(self.vllm_config, "tensor_capture"):
            return super().execute_model(*args, **kwargs)

    def graphpass_stats(self) -> dict:
        """For ``llm.collective_rpc("graphpass_stats")``: Dynamo's graphs compiled in this worker so far
        (``unique_graphs``) and whether capture is enabled."""
        from torch._dynamo.utils import counters

        from vllm import envs

        return {
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "compile_cache_disabled": bool(envs.VLLM_DISABLE_COMPILE_CACHE),
            "capture_enabled": bool(self.graphpass_capture is not None and self.graphpass_capture.enabled),
            "draft_capture_enabled": bool(
                self.graphpass_draft_capture is not None and self.graphpass_draft_capture.enabled
            ),
        }

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        settings = parse(self.vllm_config.additional_config)
        if settings is None or settings.tensor_capture is None:
            return
        import graphpass

        tc = settings.tensor_capture
        dp_rank, tp = _ranks(self.vllm_config)
        runner = self.model_runner
        with reported(self.vllm_config, "tensor_capture"):  # modules matching nothing: at the caller, by its path
            self.graphpass_capture = graphpass.ModelCapture(
                runner.model,
                modules=list(tc.modules),
                capture_dir=tc.capture_dir,
                capture_filter=list(tc.capture_filter) if tc.capture_filter else None,
                dp_rank=dp_rank,
                tp_rank=tp,
                run=tc.run,
            )
            _check_filter(runner.model, tc.modules, tc.capture_filter)
        state = self.graphpass_steps = _Steps()
        runner._model_forward = _stepping(runner, runner._model_forward, self.graphpass_capture, state)
        log.info(
            "graphpass captures %s of %s into %s (dp%d)",
            list(tc.modules),
            type(runner.model).__name__,
            tc.capture_dir,
            dp_rank,
        )
        if tc.draft_modules:
            with reported(self.vllm_config, "draft"):
                draft = _draft_model(runner)
                self.graphpass_draft_capture = graphpass.ModelCapture(
                    draft,
                    modules=list(tc.draft_modules),
                    capture_dir=tc.capture_dir,
                    subdirectory="draft",
                    dp_rank=dp_rank,
                    tp_rank=tp,
                    run=tc.run,
                )
            draft.forward = _draft_stepping(runner, draft.forward, self.graphpass_draft_capture, state)
            log.info("graphpass captures the draft model's %s into %s/draft", list(tc.draft_modules), tc.capture_dir)

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        with _current(self), reported(self.vllm_config, "options"):
            out = super().compile_or_warm_up_model(*args, **kwargs)
        for capture in (self.graphpass_capture, self.graphpass_draft_capture):
            if capture is not None:
                capture.enable()
        return out


def _check_filter(model: Any, modules: tuple[str, ...], capture_filter: tuple[str, ...] | None) -> None:
    """Each ``capture_filter`` pattern must match a module ``modules`` selects: one that matches none writes
    nothing (a misspelt filter would serve a run whose steps hold no tensors)."""
    if not capture_filter:
        return
    from graphpass.patterns import check_all_match, compile_patterns

    selecting = compile_patterns(list(modules), "modules")
    selected = [n for n, _ in model.named_modules() if n and any(p.matches(n) for p in selecting)]
    check_all_match(compile_patterns(list(capture_filter), "capture_filter"), selected, "capture_filter")


def _current(worker: Any) -> Any:
    """``set_current_vllm_config(worker's config)``, unless it is current already."""
    import contextlib

    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config

    if get_current_vllm_config_or_none() is worker.vllm_config:
        return contextlib.nullcontext()
    return set_current_vllm_config(worker.vllm_config)


class _Steps:
    """One worker's last captured target step (its EngineStep and ``step_index``) and the draft passes
    since, shared by the target's and the draft model's wrappers."""

    def __init__(self) -> None:
        self.target: EngineStep | None = None
        self.target_index = -1
        self.draft_pass = 0
        self.cached: dict[str, int] = {}  # request id -> positions its scheduler served from the prefix cache


def _draft_model(runner: Any) -> Any:
    """The drafter's model (speculative decoding), or a ConfigError: ``draft_modules`` needs one."""
    import torch

    model = getattr(getattr(runner, "drafter", None), "model", None)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"{PREFIX}.tensor_capture.draft_modules",
            None,
            f"this engine's speculative decoding has no draft model to capture (drafter "
            f"{type(getattr(runner, 'drafter', None)).__name__}): leave draft_modules out",
        )
    return model


def _meta(step: EngineStep, kwargs: dict, model: dict, **more: Any) -> dict:
    """The extra meta of a step (:class:`graphpass.capture_format.EngineStepMeta`): ``token_request``,
    ``engine``, ``model`` (model type and head sizes, for ``compare`` across engines), ``input_ids`` (the
    token fed at each row) and ``more`` of its fields."""
    ids = kwargs.get("input_ids")
    if ids is not None:
        ids = ids.detach().reshape(-1)[: len(step.token_request)].tolist()
    return EngineStepMeta(VLLM_ENGINE, step.token_request, model=model, input_ids=ids, **more).to_dict()


def _stepping(runner: Any, forward: Any, capture: Any, state: _Steps) -> Any:
    """``runner._model_forward`` wrapped: one capture step per call while capture is enabled."""
    from graphpass.model_shape import ModelShape

    config = runner.vllm_config
    model = ModelShape.from_config(
        config.model_config.hf_config, int(config.parallel_config.tensor_parallel_size)
    ).to_meta()

    @functools.wraps(forward)
    def model_forward(*args: Any, **kwargs: Any) -> Any:
        if not capture.enabled:
            return forward(*args, **kwargs)
        step = engine_step(runner, kwargs.get("positions"))
        extra = _meta(
            step,
            kwargs,
            model,
            prefix_cached=[state.cached.get(r, 0) for r in step.req_ids],
            parents=[parent_of(r) for r in step.req_ids],
        )
        with capture.step(positions=step.positions, is_prefill=step.is_prefill, req_ids=step.req_ids, extra_meta=extra):
            out = forward(*args, **kwargs)
        state.target, state.target_index, state.draft_pass = step, state.target_index + 1, 0
        return out

    return model_forward


def _draft_stepping(runner: Any, forward: Any, capture: Any, state: _Steps) -> Any:
    """The draft model's ``forward`` wrapped: one capture step (under ``draft/``) per call while capture
    is enabled, described by :func:`.steps.draft_step`."""
    from graphpass.model_shape import ModelShape

    spec = runner.vllm_config.speculative_config
    model = ModelShape.from_config(
        spec.draft_model_config.hf_config, int(spec.draft_parallel_config.tensor_parallel_size)
    ).to_meta()

    @functools.wraps(forward)
    def draft_forward(*args: Any, **kwargs: Any) -> Any:
        if not capture.enabled:
            return forward(*args, **kwargs)
        step = draft_step(runner, kwargs.get("positions"), forward_query_starts(), state.target, state.draft_pass)
        extra = _meta(step, kwargs, model, draft_pass=state.draft_pass, target_step_index=state.target_index)
        state.draft_pass += 1
        with capture.step(positions=step.positions, is_prefill=step.is_prefill, req_ids=step.req_ids, extra_meta=extra):
            return forward(*args, **kwargs)

    return draft_forward
