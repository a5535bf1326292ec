"""The graphpass Dynamo backend: run the pipeline over each graph, then hand it to the delegate.

``torch.compile(model, backend="graphpass", options={...})`` finds :func:`graphpass_backend` through
the ``torch_dynamo_backends`` entry point; ``graphpass.backend(**options)`` builds a configured
:class:`GraphpassBackend` to pass as ``backend=`` (or as another graphpass's ``then=``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .analysis import GraphAnalysis
from .config import GraphpassConfig
from .errors import GraphpassError, surface
from .pipeline import PIPELINE, run_pipeline, with_post_grad_passes
from .roots import dynamo_roots
from .static_shapes.scan_trace import install as install_scan_trace


@dataclass
class CompiledGraph:
    """What graphpass did to one Dynamo graph (one per graph, several with graph breaks)."""

    index: int
    analysis: GraphAnalysis
    log: list[str]
    gm: torch.fx.GraphModule
    delegate: str
    example_inputs: list = field(default_factory=list, repr=False)
    pass_seconds: float = 0.0  # wall time of the graphpass pipeline on this graph
    runner: Any = None  # what runs the graph when graphpass wraps it (a static_shapes BucketDispatcher)


class GraphpassBackend:
    """A configured graphpass backend. Calling it compiles one Dynamo graph."""

    __name__ = "graphpass"

    def __init__(self, options: dict | None = None, record: bool = True) -> None:
        self.config = GraphpassConfig.from_options(options)  # validated now, before any compile
        if self.config.static_shapes is not None:
            install_scan_trace()  # transformers imported since graphpass was: its substitute too
        self.options = dict(options or {})
        self.graphs: list[CompiledGraph] = []  # one record per compiled graph, this instance only
        self._record = record

    def graphpass_pads_to_buckets(self, _options: dict | None = None) -> bool:
        """Whether this backend pads to buckets (read by :mod:`.static_shapes.scan_trace` while Dynamo traces)."""
        return self.config.static_shapes is not None

    def __repr__(self) -> str:
        return f"graphpass.backend({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"

    def config_for(self, options: dict | None = None, mode: str | None = None) -> GraphpassConfig:
        if not options and mode is None:
            return self.config
        merged = dict(options or {})
        if mode is not None:
            merged["mode"] = mode
        return GraphpassConfig.from_options(self.options, **merged)

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        options: dict | None = None,
        mode: str | None = None,
    ) -> Callable:
        try:
            config = self.config_for(options, mode)
            return self._compile(gm, example_inputs, config)
        except GraphpassError as err:
            raise surface(err) from err.__cause__

    def transform(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: GraphpassConfig):
        """Run the pipeline over ``gm`` in place and record it; compiles nothing."""
        from .capturing import specs_for

        t0 = time.perf_counter()
        roots = dynamo_roots(gm)
        captures = [spec for model in roots.whole_models() for spec in specs_for(model)]
        name = f"graph {len(self.graphs)} ({getattr(roots, 'frame_name', '') or 'frame'})"
        ctx = run_pipeline(gm, example_inputs, config, roots=roots, captures=captures, passes=PIPELINE, graph_name=name)
        seconds = time.perf_counter() - t0
        record = CompiledGraph(
            index=len(self.graphs),
            analysis=ctx.analysis,
            log=ctx.log,
            gm=gm,
            delegate=_delegate_name(config.then),
            example_inputs=list(example_inputs),
            pass_seconds=seconds,
        )
        if self._record:
            self.graphs.append(record)
        return ctx, record

    def _compile(self, gm, example_inputs, config: GraphpassConfig) -> Callable:
        from graphpass.backends import resolve_delegate

        from .delegation import compile_with_delegate

        from .capturing import note_traced

        # the inductor delegate gets the pipeline's aten-level passes here, at the top: delegation never imports them
        delegate = resolve_delegate(config.then, mode=config.mode, options=config.delegate_options)
        delegate = with_post_grad_passes(delegate)
        ctx, record = self.transform(gm, example_inputs, config)
        for model in ctx.roots.whole_models():
            note_traced(model)
        plan = ctx.analysis.bucket_plan
        if plan is not None and plan.active:
            from .static_shapes.dispatcher import BucketDispatcher

            record.runner = BucketDispatcher(gm, plan, config.static_shapes, delegate, ctx.log)
            return record.runner
        if plan is not None:
            import warnings

            msg = f"graphpass static_shapes: not padding this graph, it runs with dynamic shapes: {plan.refused[0]}"
            warnings.warn(msg, stacklevel=2)
            ctx.log.append(msg)
        return compile_with_delegate(gm, example_inputs, delegate, graph_name=f"graph {record.index}")


def _delegate_name(then: Any) -> str:
    if isinstance(then, str):
        return then
    return getattr(then, "__name__", None) or getattr(then, "name", None) or type(then).__name__


def backend(**options: Any) -> GraphpassBackend:
    """``torch.compile(model, backend=graphpass.backend(then="aot_eager", traps=["layers.*"]))``.

    Takes the same keys as ``options=`` (see :class:`graphpass.config.GraphpassConfig`) and
    validates them now.
    """
    return GraphpassBackend(options)


def graphpass_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict | None = None,
    mode: str | None = None,
) -> Callable:
    """Entry point registered under ``torch_dynamo_backends`` as ``"graphpass"``."""
    try:
        instance = GraphpassBackend(options, record=False)
    except GraphpassError as err:
        raise surface(err) from None
    return instance(gm, example_inputs, mode=mode)


def _string_backend_pads(options: dict | None = None) -> bool:
    """``backend="graphpass", options=...``: whether those options pad to buckets (for
    :mod:`.static_shapes.scan_trace`; invalid options answer False, the compile itself reports them)."""
    try:
        return GraphpassConfig.from_options(options).static_shapes is not None
    except GraphpassError:
        return False


graphpass_backend.graphpass_pads_to_buckets = _string_backend_pads  # type: ignore[attr-defined]
