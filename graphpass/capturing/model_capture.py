"""Tensor capture for accuracy debugging: registry, writer and the user-facing ModelCapture.

``ModelCapture(compiled, modules=[...], capture_dir=...)`` attaches a capture spec to the model.
When graphpass compiles the model, the ``insert_capture_nodes`` pass puts a
``graphpass::capture`` node after every output tensor of every matching module. At run time the
node clones the value into this instance's :class:`TensorRegistry` only while the registry is
active in the current context (``setup_tensor_capture`` / ``step``) and enabled; otherwise it
returns at once. Toggling never recompiles. ``save_tensor_captures`` writes safetensors files
(atomically) and restores the previously active registry; saved with ``wait=False`` (every
``auto_steps`` step by default) the step is staged and written behind the compute
(:mod:`graphpass.capturing.staging`): ``flush()`` / ``disable()`` wait for it.

On disk::

    capture_dir/[subdirectory/]dp{d}/{prefill_s{N}|decode_b{B}}_{k}/{module}/rank{r}.safetensors
    capture_dir/[subdirectory/]dp{d}/{step}/{step}_meta.json
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import os
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ..capture_format import BUCKET, DROPPED_STEPS, GRAPHPASS_VERSION, OWN_META, POSITIONS, REQ_IDS, RUN, TORCH_VERSION
from ..dynamo_records import has_compiled_code
from ..errors import CaptureError, ConfigError
from ..version import __version__
from .auto_steps import AutoSteps, StepInfo
from .ops import ACTIVE_CAPTURES, capture_eager_outputs, capture_tensor, mark_output_keys
from .registry import CaptureSites, Switch, TensorRegistry
from .staging import StagingConfig, check_staging, make_write_behind, to_host
from .writer import CaptureWriter, _check_component
from ..patterns import ModulePattern, check_all_match, compile_patterns
from ..tensor_utils import dtensor_mesh

__all__ = ["TensorRegistry", "CaptureWriter", "ModelCapture", "CaptureSpec", "capture_tensor"]

log = logging.getLogger("graphpass.capturing")

AUTO = "auto"  # dp_rank / tp_rank default: from the mesh / process group (resolve_ranks)


@dataclass(frozen=True)
class CaptureSpec:
    """What the capture pass needs: which modules (relative to ``prefix``)."""

    patterns: tuple[ModulePattern, ...]
    prefix: str = ""  # FQN of the module ModelCapture was given, inside the model graphpass sees


def _unwrap(model: Any) -> torch.nn.Module:
    inner = getattr(model, "_orig_mod", model)
    if not isinstance(inner, torch.nn.Module):
        raise CaptureError(f"ModelCapture needs an nn.Module or a torch.compile'd module, got {type(model).__name__}")
    return inner


# model -> its live ModelCapture specs; weak keys, so nothing outlives the model or is shared by two.
_SPECS: "weakref.WeakKeyDictionary[torch.nn.Module, list[weakref.ref]]" = weakref.WeakKeyDictionary()
# models graphpass has already traced (a ModelCapture made after that would capture nothing); written
# only through note_traced. Weak keys: an entry lives as long as its model, and two models never share one.
TRACED: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()
# class -> how many distinct instances of it graphpass has traced (dead ones included): Dynamo runs a
# graph traced for one instance for any other instance of the class whose guards pass.
TRACED_CLASSES: "weakref.WeakKeyDictionary[type, int]" = weakref.WeakKeyDictionary()


def note_traced(model: torch.nn.Module) -> None:
    """Record that graphpass traced ``model`` (the backend calls this for every model a graph reads)."""
    if model not in TRACED:
        TRACED_CLASSES[type(model)] = TRACED_CLASSES.get(type(model), 0) + 1
    TRACED[model] = TRACED.get(model, 0) + 1


def _traced_other_instance(model: torch.nn.Module) -> bool:
    """Has graphpass traced another instance of ``model``'s class (alive or not)?"""
    return TRACED_CLASSES.get(type(model), 0) > (1 if model in TRACED else 0)


def _shared_graph_advice(model: torch.nn.Module) -> str:
    cls = type(model).__name__
    return (
        f"Dynamo runs a graph compiled for one {cls} instance for every other {cls} instance whose guards "
        "pass (parameters are graph inputs, nothing pins the instance), so this model may run a graph "
        "compiled for another instance, without capture nodes for the modules this ModelCapture selects. "
        f"Create a ModelCapture for every {cls} instance you want to capture before the first call of any "
        "of them, or call torch._dynamo.reset() first so the next call recompiles once"
    )


# This context's open capture steps, innermost last: (ModelCapture, its registry for this step).
# A ContextVar, so each thread / asyncio task has its own: one ModelCapture can step in several
# threads at once, each step with its own registry (no shared tokens, no mixed tensors).
_FRAMES: contextvars.ContextVar[tuple] = contextvars.ContextVar("graphpass_capture_frames", default=())


def specs_for(model: torch.nn.Module) -> list[CaptureSpec]:
    """The capture specs attached to ``model`` or any of its submodules, prefixed with their FQN,
    and those of ModelCaptures waiting for their first call on another instance of the same class
    as ``model`` or one of its submodules: Dynamo will run the graph compiled now for that
    instance too, so it needs their capture nodes (the op sends each value to the model that ran)."""
    out = []
    pending = _pending_by_class()
    for fqn, mod in model.named_modules():
        refs = list(_SPECS.get(mod, []))
        refs += [ref for ref in pending.get(type(mod), []) if ref() is not None and ref().model is not mod]
        for ref in refs:
            mc = ref()
            if mc is not None:
                spec = CaptureSpec(mc.patterns, prefix=fqn)
                if spec not in out:
                    out.append(spec)
    return out


def _pending_by_class() -> dict[type, list[weakref.ref]]:
    """class -> live ModelCaptures whose model graphpass has not traced yet."""
    out: dict[type, list[weakref.ref]] = {}
    for mod, refs in list(_SPECS.items()):
        if mod not in TRACED:
            out.setdefault(type(mod), []).extend(refs)
    return out


def _has_compiled_code(model) -> bool:
    return has_compiled_code(model, unknown=True)  # cannot tell: assume compiled, the safe answer


class ModelCapture:
    """Capture chosen module outputs of a model compiled with graphpass. See the module docstring."""

    def __init__(
        self,
        model: Any,
        modules: Sequence[str],
        capture_dir: str | os.PathLike = "captures",
        capture_filter: Sequence[str] | None = None,
        subdirectory: str | None = None,
        dp_rank: Any = AUTO,
        tp_rank: Any = AUTO,
        mesh: Any = None,
        dp_dim: str = "dp",
        tp_dim: str = "tp",
        staging: StagingConfig | dict | None = None,
        run: str | None = None,
    ) -> None:
        self.staging = check_staging(staging)
        # the run this capture's steps belong to, in every step's meta ("run"): compare refuses a folder whose
        # steps come from more than one (an engine gives all its ranks one; default: a new id per ModelCapture)
        if run is not None and (not isinstance(run, str) or not run or not run.isprintable()):
            raise ConfigError("run", run, "must be a non-empty printable str")
        self.run = run if run is not None else uuid.uuid4().hex[:16]
        self.model = _unwrap(model)
        # what the user calls: the torch.compile wrapper if given one (auto_steps hooks it, outside the graph)
        self._called = model if isinstance(model, torch.nn.Module) else self.model
        self.patterns = compile_patterns(modules, "modules")
        names = [n for n, _ in self.model.named_modules() if n]
        check_all_match(self.patterns, names, "modules")
        selected = [n for n in names if any(p.matches(n) for p in self.patterns)]
        for name in selected:  # the folder names capture will use: fail now, not mid-run
            _check_component(name, "module name")
        if self.model in TRACED and _has_compiled_code(self.model):
            raise CaptureError(
                "ModelCapture was created after graphpass already compiled this model, so its graphs hold no "
                "capture nodes: create ModelCapture right after torch.compile and before the first call "
                "(or call torch._dynamo.reset() first to recompile)"
            )
        if _traced_other_instance(self.model) and _has_compiled_code(self.model):
            raise CaptureError(
                f"ModelCapture was created after graphpass already compiled another {type(self.model).__name__} "
                f"instance. {_shared_graph_advice(self.model)}"
            )
        tp_size = resolve_tp_size(self.model, tp_rank, mesh, dp_dim, tp_dim)
        dp_rank, tp_rank = resolve_ranks(self.model, dp_rank, tp_rank, mesh, dp_dim, tp_dim)
        self.writer = CaptureWriter(capture_dir, subdirectory, dp_rank, tp_rank, capture_filter, tp_size)
        self._switch = Switch(False)  # enable()/disable() apply to every thread's registry
        self._sites = CaptureSites()  # resolved capture sites, shared by this capture's registries only
        self._registry = self._new_registry()  # outside any step
        self._behind = make_write_behind(self.staging, self.writer)
        weakref.finalize(self, self._behind.close)  # on collection and at interpreter exit: flush
        _SPECS.setdefault(self.model, []).append(weakref.ref(self))
        _mark_classes(self, [type(self.model.get_submodule(n)) for n in selected])

    # -- seed API ------------------------------------------------------------------------------
    @property
    def registry(self) -> TensorRegistry:
        """This context's registry: the innermost open step's of this capture in this thread / task."""
        return self._current()

    def _current(self) -> TensorRegistry:
        for owner, reg in reversed(_FRAMES.get()):
            if owner is self:
                return reg
        return self._registry

    def _new_registry(self) -> TensorRegistry:
        return TensorRegistry(patterns=self.patterns, switch=self._switch, model=self.model, sites=self._sites)

    def enable(self) -> None:
        self._registry.configure(enabled=True)

    def disable(self) -> None:
        """Stop capturing; returns once every step saved so far is on disk (see :meth:`flush`)."""
        self._registry.configure(enabled=False)
        self.flush()

    def flush(self) -> None:
        """Wait until every step saved so far is on disk. Raises ``CaptureError`` for a step written
        in the background that failed since the last flush (its files were rolled back)."""
        self._behind.flush()

    @property
    def dropped_steps(self) -> int:
        """Steps dropped because the writer fell behind (``StagingConfig(when_full="drop")``)."""
        return self._behind.dropped

    @property
    def pending_steps(self) -> int:
        """Steps saved and not yet on disk."""
        return self._behind.pending

    @property
    def enabled(self) -> bool:
        return self._registry.enabled

    def register_clear_hook(self, compiled: Any) -> Any:
        """Clear this registry before every forward of ``compiled`` (a pre-forward hook on the wrapper)."""
        return compiled.register_forward_pre_hook(lambda *_: self._current().clear())

    def setup_tensor_capture(self) -> None:
        """Make a fresh registry of this capture the active one in the current context (thread / task)."""
        reg = self._new_registry()
        ACTIVE_CAPTURES.set(ACTIVE_CAPTURES.get() + (reg,))
        _FRAMES.set(_FRAMES.get() + ((self, reg),))

    def open_auto_step(self) -> None:
        """A step :class:`AutoSteps` opens (user code, outside any compile): sweep an idle marking
        hook, then :meth:`setup_tensor_capture`."""
        sweep_marking_hook()
        self.setup_tensor_capture()

    def _restore(self) -> None:
        """Close this context's innermost step of this capture: its registry stops being active."""
        frames = _FRAMES.get()
        for i in range(len(frames) - 1, -1, -1):
            if frames[i][0] is self:
                reg = frames[i][1]
                _FRAMES.set(frames[:i] + frames[i + 1 :])
                ACTIVE_CAPTURES.set(tuple(r for r in ACTIVE_CAPTURES.get() if r is not reg))
                return

    def save_tensor_captures(
        self,
        positions: Any = None,
        is_prefill: bool = True,
        req_ids: Sequence[str] | None = None,
        extra_meta: Mapping[str, Any] | None = None,
        wait: bool = True,
    ) -> list[Path]:
        """Write what was captured since ``setup_tensor_capture`` and restore the previous registry.
        ``extra_meta``: more JSON-able fields for the step's meta file (an engine's per-token request
        index, ...); they cannot replace the fields graphpass writes. ``wait=False``: stage the step
        and return at once (written behind the compute; the step dirs it will have are returned)."""
        return self._save_step(positions, is_prefill, req_ids, extra_meta=extra_meta, wait=wait)

    def _save_step(
        self,
        positions: Any = None,
        is_prefill: bool = True,
        req_ids: Sequence[str] | None = None,
        size: int | None = None,
        extra_meta: Mapping[str, Any] | None = None,
        wait: bool = True,
    ) -> list[Path]:
        """``save_tensor_captures``; ``size``: the step's N / B when the caller knows it (auto steps)."""
        reg = self._current()
        try:
            if not reg.enabled:
                return []
            self._check_step(reg)
            tensors = reg.get_all_entries()
            bucket = reg.bucket
            if bucket is not None and is_prefill:
                size = bucket
            elif size is None:
                size = _step_size(positions, is_prefill, req_ids, tensors)
            meta = {
                **_check_extra_meta(extra_meta),
                REQ_IDS: list(req_ids) if req_ids is not None else [],
                POSITIONS: positions,
                RUN: self.run,
                GRAPHPASS_VERSION: __version__,
                TORCH_VERSION: torch.__version__,
                BUCKET: bucket,
                DROPPED_STEPS: self._behind.dropped,
            }
        finally:
            reg.clear()
            self._restore()
        if not wait and self._behind.carries(tensors):
            return self._stage(tensors, is_prefill, size, meta)
        self._behind.wait_idle()  # earlier steps first: "on disk when this returns" holds for all
        written = self.writer.write(tensors, is_prefill=is_prefill, size=size, meta=meta)
        self._behind.raise_errors()
        return written

    def _stage(self, tensors: list, is_prefill: bool, size: int, meta: dict) -> list[Path]:
        """Hand a step to the write-behind ring (:mod:`graphpass.capturing.staging`)."""
        tensors = [(name, to_host(t), key, layout) for name, t, key, layout in tensors]
        positions = meta[POSITIONS]
        if isinstance(positions, torch.Tensor):
            meta[POSITIONS] = to_host(positions.detach()).clone()  # the caller may reuse its tensor
        reserved: list = []

        def job() -> tuple:
            step, index = self.writer.reserve(is_prefill, size)
            reserved.append(step)
            return tensors, dict(step=step, index=index, is_prefill=is_prefill, size=size, meta=meta)

        outcome = self._behind.submit(self._behind.nbytes(tensors), job)
        if outcome == "caller":  # larger than max_staged_bytes on its own: written here, the ring empty
            written = self.writer.write(tensors, is_prefill=is_prefill, size=size, meta=meta)
        elif outcome == "dropped":
            written = []
            if self._behind.dropped == 1 or self._behind.dropped % 100 == 0:
                log.warning(
                    "capture step %s dropped: the writer is behind and staging's when_full is 'drop' "
                    "(%d dropped so far; max_staged_bytes=%d, max_staged_steps=%d)",
                    reserved[0],
                    self._behind.dropped,
                    self.staging.max_staged_bytes,
                    self.staging.max_staged_steps,
                )
        else:
            written = self.writer.step_dirs([e[0] for e in tensors], reserved[0])
        self._behind.raise_errors()  # an earlier step's background failure surfaces at the next save
        return written

    def _check_step(self, reg: TensorRegistry) -> None:
        """Refuse, with the reason, a step whose captures cannot be trusted: values this model
        produced that could not be named, or none at all where a graph compiled for another
        instance of the class may have run without capture nodes."""
        if reg.problems:
            raise CaptureError(
                f"capture step not written: {reg.problems[0]}"
                + (f" (and {len(reg.problems) - 1} more)" if len(reg.problems) > 1 else "")
                + f". {_shared_graph_advice(self.model)}"
            )
        if reg.module_tensor_count == 0 and _traced_other_instance(self.model) and _has_compiled_code(self.model):
            raise CaptureError(
                f"capture step not written: nothing was captured for the modules this ModelCapture selects "
                f"({', '.join(p.text for p in self.patterns)}), and graphpass compiled another "
                f"{type(self.model).__name__} instance. {_shared_graph_advice(self.model)}. (If this model did not "
                "run in the step, close the step without saving it: use setup_tensor_capture / a step only "
                "around calls of this model.)"
            )

    @contextlib.contextmanager
    def step(
        self,
        positions: Any = None,
        is_prefill: bool = True,
        req_ids: Sequence[str] | None = None,
        extra_meta: Mapping[str, Any] | None = None,
        wait: bool = True,
    ) -> Iterator["ModelCapture"]:
        """``with capture.step(...): out = compiled(x)``: set up, run, save. If the body raises,
        nothing is written and the previously active registry is restored. ``wait=False``: the
        step is staged and written behind the compute (``flush()`` waits for it)."""
        sweep_marking_hook()
        self.setup_tensor_capture()
        try:
            yield self
        except BaseException:
            self._current().clear()
            self._restore()
            raise
        self.save_tensor_captures(
            positions=positions, is_prefill=is_prefill, req_ids=req_ids, extra_meta=extra_meta, wait=wait
        )

    def auto_steps(
        self,
        module: torch.nn.Module | None = None,
        step_info: Callable[[tuple, dict], StepInfo | None] | None = None,
        wait: bool = False,
    ) -> AutoSteps:
        """Make every forward of ``module`` one step, named from its input: ``prefill_s{N}_{k}`` for
        ``N > 1`` tokens per sequence, ``decode_b{B}_{k}`` for one token per sequence of a batch of
        ``B`` (``with capture.auto_steps(): model.generate(...)``). ``module``: the module whose calls
        are steps; default the one given to ``ModelCapture`` (its ``torch.compile`` wrapper if it was
        given one). ``step_info(args, kwargs)``: name the step yourself (a :class:`StepInfo`, or None
        to leave that call uncaptured). ``wait``: write each step before the forward returns
        (default: written behind the compute; leaving the ``with`` or ``remove()`` waits for all).
        Returns an :class:`AutoSteps`: use it in ``with``, or ``remove()`` it."""
        return AutoSteps(self, self._called if module is None else module, step_info, wait=wait)


def _model_mesh(model: torch.nn.Module) -> Any:
    """The DeviceMesh of the first DTensor parameter or buffer of ``model``, or None."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        mesh = dtensor_mesh(t)
        if mesh is not None:
            return mesh
    return None


def _mesh_rank(mesh: Any, dim: str) -> int:
    return int(mesh.get_local_rank(dim))


def resolve_ranks(
    model: torch.nn.Module, dp_rank: Any, tp_rank: Any, mesh: Any = None, dp_dim: str = "dp", tp_dim: str = "tp"
) -> tuple[Any, Any]:
    """``(dp_rank, tp_rank)`` for a ModelCapture. An int is used as given; a ProcessGroup gives this
    process's rank in it. ``AUTO`` (the default) reads the DeviceMesh (``mesh``, else that of the
    model's first DTensor weight): its ``dp_dim`` / ``tp_dim`` dimensions, a 1-D mesh named neither
    being the tensor-parallel one; a dimension it lacks gives 0. Without a mesh under an
    initialized process group of several ranks, each process is its own data-parallel rank
    (``dp_rank`` = global rank, ``tp_rank`` 0), so ranks never write each other's files."""
    import torch.distributed as dist

    unset = object()

    def given(value: Any) -> Any:
        if isinstance(value, str) and value == AUTO:
            return unset
        if dist.is_available() and isinstance(value, dist.ProcessGroup):
            return dist.get_rank(value)
        return value  # an int, or a bad value CaptureWriter refuses with ConfigError

    dp, tp = given(dp_rank), given(tp_rank)
    if dp is not unset and tp is not unset:
        return dp, tp
    mesh = mesh if mesh is not None else _model_mesh(model)
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        if tp is unset:
            one_d = mesh.ndim == 1 and tp_dim not in names and dp_dim not in names
            tp = _mesh_rank(mesh, 0) if one_d else (_mesh_rank(mesh, tp_dim) if tp_dim in names else 0)
        if dp is unset:
            dp = _mesh_rank(mesh, dp_dim) if dp_dim in names else 0
        return dp, tp
    spread = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return (dist.get_rank() if spread else 0) if dp is unset else dp, 0 if tp is unset else tp


def resolve_tp_size(
    model: torch.nn.Module, tp_rank: Any, mesh: Any = None, dp_dim: str = "dp", tp_dim: str = "tp"
) -> int | None:
    """How many tensor-parallel ranks the run has, as far as :func:`resolve_ranks` can tell (the
    meta's ``tp_size``: ``compare`` expects every one of them in every step): the size of a
    ``ProcessGroup`` given as ``tp_rank``; under ``AUTO`` the size of the mesh's ``tp_dim`` dimension
    (a 1-D mesh named neither ``tp_dim`` nor ``dp_dim``: its size), 1 when the mesh has no such
    dimension or there is no mesh; None (unknown) when ``tp_rank`` is an int."""
    import torch.distributed as dist

    if dist.is_available() and isinstance(tp_rank, dist.ProcessGroup):
        return dist.get_world_size(tp_rank)
    if not (isinstance(tp_rank, str) and tp_rank == AUTO):
        return None
    mesh = mesh if mesh is not None else _model_mesh(model)
    if mesh is None:
        return 1
    names = tuple(mesh.mesh_dim_names or ())
    shape = tuple(int(n) for n in mesh.shape)
    if mesh.ndim == 1 and tp_dim not in names and dp_dim not in names:
        return shape[0]
    return shape[names.index(tp_dim)] if tp_dim in names else 1


# Classes whose instances' outputs get ``output_key`` markers (the capture pass names captured
# values by them) -> how many live ModelCaptures selected a module of that class. One global
# forward hook, not hooks on the selected modules: every instance of a class then traces to the
# same graph (a hook on one instance only would make Dynamo run a graph traced without it for
# another), which the capture isolation relies on. The hook exists only while a ModelCapture does.
_MARKED_CLASSES: dict[type, int] = {}
_GLOBAL_HOOK: list = []


def _marking_hook(module: torch.nn.Module, args: Any, out: Any) -> None:
    if type(module) not in _MARKED_CLASSES:
        return
    if not torch.compiler.is_compiling():  # the call ran outside any graph (a graph break at it)
        if ACTIVE_CAPTURES.get() and _in_compiled_call():
            capture_eager_outputs(module, out)
    elif _hook_in_own_frame():  # traced, but in the module's own call frame: see _hook_in_own_frame
        _capture_outside_graph(module, out)
    else:  # traced into a graph: markers the capture pass reads
        mark_output_keys(module, args, out)


def _in_compiled_call() -> bool:
    """Is a ``torch.compile``'d function running (Dynamo's frame callback set), so that this module
    call runs eagerly only because Dynamo broke the graph at it? A model run plainly eagerly (or
    inside ``torch.compiler.disable``) captures nothing, as before: it has no graphpass graph."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except Exception:  # noqa: BLE001 - private API moved: capture (the values are the module's)
        return True
    return get_eval_frame_callback() is not None


_CALL_FRAMES = ("_call_impl", "_wrapped_call_impl")


@torch._dynamo.assume_constant_result
def _hook_in_own_frame() -> bool:
    """At trace time: is Dynamo tracing this hook as a frame of its own (called from the eager
    ``_call_impl`` of a module whose forward broke the graph: Dynamo catches every Python frame
    that starts while a compiled function runs), or inside the frame of the hooked module's own
    call (``_call_impl``, or its resumption)? Such a graph holds none of the module's computation
    and no weight that tells the instances sharing it apart, so the capture pass drops its
    markers (the module's outputs were not captured at all): the hook then runs outside the
    graph instead (a graph break in a frame that holds nothing else)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx().output.current_tx  # innermost: this hook
        caller = tx.parent
        if caller is None:  # the hook is the frame: Dynamo caught it called from eager code
            return True
        while caller is not None and caller.f_code.co_name.startswith(
            _CALL_FRAMES + tuple(f"torch_dynamo_resume_in_{n}" for n in _CALL_FRAMES)
        ):
            if caller.parent is None:
                return True
            caller = caller.parent
    except Exception:  # noqa: BLE001 - private API moved: the markers, as before
        return False
    return False


@torch._dynamo.disable
def _capture_outside_graph(module: torch.nn.Module, out: Any) -> None:
    """Run outside the graph (a graph break at the end of the module's own call frame)."""
    if ACTIVE_CAPTURES.get():
        capture_eager_outputs(module, out)


def _mark_classes(capture: "ModelCapture", classes: list[type]) -> None:
    classes = list(dict.fromkeys(classes))
    sweep_marking_hook()
    for cls in classes:
        _MARKED_CLASSES[cls] = _MARKED_CLASSES.get(cls, 0) + 1
    if not _GLOBAL_HOOK:
        _GLOBAL_HOOK.append(torch.nn.modules.module.register_module_forward_hook(_marking_hook))
    weakref.finalize(capture, _unmark_classes, classes)


def _unmark_classes(classes: list[type]) -> None:
    for cls in classes:
        left = _MARKED_CLASSES.get(cls, 1) - 1
        if left > 0:
            _MARKED_CLASSES[cls] = left
        else:
            _MARKED_CLASSES.pop(cls, None)
    # This runs as a finalizer, whenever the garbage collector gets to the last ModelCapture: that
    # may be in the middle of a Dynamo compile building guards on the global hook dict (removing
    # the hook then is a KeyError inside Dynamo). Then the hook stays (it acts on marked classes
    # only, so an idle one is harmless) until the next safe point sweeps it.
    sweep_marking_hook()


def _compiling() -> bool:
    """Is this thread inside a Dynamo compile (tracing, the backend, or building guards)?"""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
    except Exception:  # noqa: BLE001 - private API moved: assume the worst, sweep later
        return True
    if torch._guards.TracingContext.try_get() is not None:
        return True
    try:
        return InstructionTranslator.current_tx() is not None
    except AttributeError:  # no translator was ever set in this thread
        return False


def sweep_marking_hook() -> None:
    """Remove the marking hook when no ModelCapture selects anything any more, unless this thread
    is compiling. Called when the last ModelCapture dies and again where user code runs outside
    any compile (a ModelCapture being made, a step starting)."""
    if _MARKED_CLASSES or not _GLOBAL_HOOK or _compiling():
        return
    _GLOBAL_HOOK.pop().remove()


def _step_size(positions: Any, is_prefill: bool, req_ids: Sequence[str] | None, tensors) -> int:
    if positions is not None:
        shape = tuple(torch.as_tensor(positions).shape)
        if is_prefill:
            return int(shape[-1]) if shape else 1
        if req_ids is not None:
            return len(req_ids)
        return int(shape[0]) if shape else 1
    if not is_prefill and req_ids is not None:
        return len(req_ids)
    if tensors:
        t = tensors[0][1]
        if is_prefill:
            return int(t.shape[1]) if t.dim() >= 2 else int(t.shape[0]) if t.dim() else 1
        return int(t.shape[0]) if t.dim() else 1
    raise ConfigError("positions", positions, "cannot tell the step's size: pass positions or req_ids")


# meta fields graphpass itself writes (step_files.plan_step adds the rest): extra_meta cannot replace them
_OWN_META = OWN_META


def _check_extra_meta(extra_meta: Mapping[str, Any] | None) -> dict:
    if extra_meta is None:
        return {}
    if not isinstance(extra_meta, Mapping) or not all(isinstance(k, str) for k in extra_meta):
        raise ConfigError("extra_meta", extra_meta, "must be a mapping with str keys")
    clash = sorted(set(extra_meta) & set(_OWN_META))
    if clash:
        raise ConfigError("extra_meta", clash, "cannot replace the meta fields graphpass writes")
    return dict(extra_meta)
