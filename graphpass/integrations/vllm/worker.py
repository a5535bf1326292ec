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
- capture is enabled only after vLLM's warm-up (``compile_or_warm_up_model``). Enabling it changes
  no graph: the capture nodes are compiled in from the first (warm-up) compilation.

The class is made on first access (``module.__getattr__``), so this module imports without vLLM
(graphpass's own checks import every module).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from .config import parse
from .steps import engine_step

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

    def determine_available_memory(self) -> int:
        with _current(self):  # vLLM's CPU worker compiles here (warm-up)
            return super().determine_available_memory()

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        with _current(self):
            return super().execute_model(*args, **kwargs)

    def graphpass_stats(self) -> dict:
        """For ``llm.collective_rpc("graphpass_stats")``: Dynamo's graphs compiled in this worker so far
        (``unique_graphs``) and whether capture is enabled."""
        from torch._dynamo.utils import counters

        return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
                "capture_enabled": bool(self.graphpass_capture is not None and self.graphpass_capture.enabled)}

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        settings = parse(self.vllm_config.additional_config)
        if settings is None or settings.tensor_capture is None:
            return
        import graphpass

        tc = settings.tensor_capture
        dp_rank, tp = _ranks(self.vllm_config)
        runner = self.model_runner
        self.graphpass_capture = graphpass.ModelCapture(
            runner.model, modules=list(tc.modules), capture_dir=tc.capture_dir,
            capture_filter=list(tc.capture_filter) if tc.capture_filter else None, dp_rank=dp_rank, tp_rank=tp)
        runner._model_forward = _stepping(runner, runner._model_forward, self.graphpass_capture)
        log.info("graphpass captures %s of %s into %s (dp%d)", list(tc.modules), type(runner.model).__name__,
                 tc.capture_dir, dp_rank)

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        with _current(self):
            out = super().compile_or_warm_up_model(*args, **kwargs)
        if self.graphpass_capture is not None:
            self.graphpass_capture.enable()
        return out


def _current(worker: Any) -> Any:
    """``set_current_vllm_config(worker's config)``, unless it is current already."""
    import contextlib

    from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config

    if get_current_vllm_config_or_none() is worker.vllm_config:
        return contextlib.nullcontext()
    return set_current_vllm_config(worker.vllm_config)


def _stepping(runner: Any, forward: Any, capture: Any) -> Any:
    """``runner._model_forward`` wrapped: one capture step per call while capture is enabled. Each
    meta also gets ``model`` (model type and head sizes, for ``compare`` across engines) and
    ``input_ids``."""
    from graphpass.model_shape import ModelShape

    config = runner.vllm_config
    model = ModelShape.from_config(config.model_config.hf_config,
                                   int(config.parallel_config.tensor_parallel_size)).to_meta()

    @functools.wraps(forward)
    def model_forward(*args: Any, **kwargs: Any) -> Any:
        if not capture.enabled:
            return forward(*args, **kwargs)
        step = engine_step(runner, kwargs.get("positions"))
        extra = {"token_request": step.token_request, "engine": "vllm", "model": model}
        ids = kwargs.get("input_ids")
        if ids is not None:  # the token fed at each row (compare checks them against the reference's)
            extra["input_ids"] = ids.detach().reshape(-1)[: len(step.token_request)].tolist()
        with capture.step(positions=step.positions, is_prefill=step.is_prefill, req_ids=step.req_ids,
                          extra_meta=extra):
            return forward(*args, **kwargs)

    return model_forward
