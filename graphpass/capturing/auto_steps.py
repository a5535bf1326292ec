"""Automatic capture steps: every forward of a model is one step, named from its input.

``with capture.auto_steps(): model.generate(ids, max_new_tokens=32)`` captures each forward that
``generate`` makes as its own step, laid out as the manual ``step(...)`` ones are:
``prefill_s{N}_{k}`` for a forward whose input holds ``N > 1`` tokens per sequence (or one token at
position 0: a one-token prompt), ``decode_b{B}_{k}`` for a forward of one token per sequence of a
batch of ``B``. See docs/capture.md ("Automatic steps: generate()").

How: a forward pre-hook on the module that is called (the ``torch.compile`` wrapper when
``ModelCapture`` was given one, else the model) opens a step (``setup_tensor_capture``) and a
forward hook saves it (staged and written behind the compute unless ``wait=True``; leaving the
``with`` or ``remove()`` waits until every step is on disk) (``always_call``: a forward that raises, which torch reports to the hook as a
``None`` result, writes nothing and closes the step; so does one that returns ``None``).
The hooks run outside the compiled code (``torch._dynamo.disable``): opening, naming and writing
a step never enter a graph and never cause a recompilation.
"""

from __future__ import annotations

import contextvars
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..errors import CaptureError
from .registry import TensorRegistry

log = logging.getLogger("graphpass.capturing.auto_steps")

# keyword arguments that hold the step's tokens / embeddings (transformers' names), in that order
INPUT_KEYS = ("input_ids", "inputs_embeds", "hidden_states", "x")
# keyword arguments that hold the step's positions, recorded in the meta file
POSITION_KEYS = ("cache_position", "position_ids", "positions")


@dataclass(frozen=True)
class StepInfo:
    """How one forward is filed: ``prefill_s{size}`` (``is_prefill``) or ``decode_b{size}``."""

    is_prefill: bool
    size: int
    positions: Any = None
    req_ids: Any = None


def _first_tensor(args: tuple, kwargs: dict, keys: tuple[str, ...]) -> torch.Tensor | None:
    for key in keys:
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor):
            return value
    return None


def default_step_info(args: tuple, kwargs: dict) -> StepInfo:
    """The step of a forward called with ``args`` / ``kwargs``, from its input (``input_ids``,
    ``inputs_embeds``, ..., else the first tensor argument): shape ``(B, S, ...)`` (a 1-D input is
    one sequence). ``S > 1``: prefill of ``S``; ``S == 1``: decode of batch ``B``, unless the step
    starts its sequences (``cache_position`` 0, else ``position_ids`` all 0: a one-token prompt,
    prefill of 1). The meta's ``positions``: ``cache_position``, else ``position_ids``."""
    x = _first_tensor(args, kwargs, INPUT_KEYS)
    if x is None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is None or x.dim() == 0:
        raise CaptureError(
            "auto_steps cannot name this step: the forward got no input tensor (input_ids, inputs_embeds or a "
            "positional tensor of shape (batch, seq, ...)); pass step_info=fn(args, kwargs) -> StepInfo"
        )
    batch, seq = (1, int(x.shape[0])) if x.dim() == 1 else (int(x.shape[0]), int(x.shape[1]))
    positions = _first_tensor(args, kwargs, POSITION_KEYS)
    if positions is not None:
        positions = positions.detach()
    if seq > 1:
        return StepInfo(True, seq, positions)
    return StepInfo(True, 1, positions) if _at_start(kwargs) else StepInfo(False, batch, positions)


def _at_start(kwargs: dict) -> bool:
    """Does this one-token step start its sequences (``cache_position`` 0, else every ``position_ids`` 0)?"""
    cache_pos, position_ids = kwargs.get("cache_position"), kwargs.get("position_ids")
    if isinstance(cache_pos, torch.Tensor) and cache_pos.numel() > 0:
        return int(cache_pos.reshape(-1)[0]) == 0
    if isinstance(position_ids, torch.Tensor) and position_ids.numel() > 0:
        return not bool(position_ids.detach().ne(0).any())
    return False


class StepsOwner(Protocol):
    """What :class:`AutoSteps` calls of the capture whose steps it opens and saves: a
    :class:`~graphpass.capturing.model_capture.ModelCapture` (which imports this module, so this one
    names it by what it does)."""

    @property
    def enabled(self) -> bool: ...

    def open_auto_step(self) -> None: ...

    def _current(self) -> TensorRegistry: ...

    def _restore(self) -> None: ...

    def _save_step(
        self,
        positions: Any = None,
        is_prefill: bool = True,
        req_ids: Any = None,
        size: int | None = None,
        extra_meta: Any = None,
        wait: bool = True,
    ) -> list[Path]: ...

    def flush(self) -> None: ...


class AutoSteps:
    """The hooks that make every forward of ``module`` a step of ``capture``. Returned by
    :meth:`ModelCapture.auto_steps`; a context manager (``with``), or call :meth:`remove`."""

    def __init__(
        self,
        capture: StepsOwner,
        module: torch.nn.Module,
        step_info: Callable[[tuple, dict], StepInfo | None] | None = None,
        wait: bool = False,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise CaptureError(f"auto_steps needs an nn.Module to hook, got {type(module).__name__}")
        self.capture = capture
        self.module = module
        self.step_info = step_info or default_step_info
        self.wait = bool(wait)  # False: steps are written behind the compute; remove() / exit waits
        self.steps = 0  # steps written
        self._warned = False
        # this context's open steps of these hooks: (StepInfo or None when the call is not captured), innermost last
        self._open: contextvars.ContextVar[tuple] = contextvars.ContextVar("graphpass_auto_steps", default=())
        self._handles = [
            module.register_forward_pre_hook(torch._dynamo.disable(self._before), with_kwargs=True),
            module.register_forward_hook(torch._dynamo.disable(self._after), with_kwargs=True, always_call=True),
        ]

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        info = self.step_info(args, kwargs)
        if info is not None:
            self.capture.open_auto_step()
        self._open.set(self._open.get() + (info,))

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
        opened = self._open.get()
        if not opened:  # hooks installed while this call was already running
            return
        info = opened[-1]
        self._open.set(opened[:-1])
        if info is None:
            return
        if result is None:  # the forward raised (always_call): nothing is written, the step is closed
            self.capture._current().clear()
            self.capture._restore()
            return
        if self.capture.enabled and self.capture._current().module_tensor_count == 0 and not self._warned:
            self._warned = True
            warnings.warn(
                f"graphpass auto_steps: a {'prefill' if info.is_prefill else 'decode'} step of "
                f"{type(module).__name__} captured no module output, so its step folder is not written: the "
                "selected modules did not run in it, or that forward ran outside a graph graphpass compiled "
                "(eagerly, e.g. the prefill of transformers' compile_config path, or under another backend). "
                "Compile the model's forward with graphpass "
                "(model.forward = torch.compile(model.forward, backend=graphpass.backend(...))). "
                "Warned once per auto_steps.",
                stacklevel=2,
            )
        written = self.capture._save_step(
            positions=info.positions, is_prefill=info.is_prefill, req_ids=info.req_ids, size=info.size, wait=self.wait
        )
        self.steps += bool(written)

    def remove(self) -> None:
        """Remove the hooks (later forwards are not captured) and wait until every step is on disk
        (raises ``CaptureError`` for a step whose background write failed). Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.capture.flush()

    def __enter__(self) -> "AutoSteps":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.remove()
            return
        try:  # the body raised: its error wins, the completed steps are still written
            self.remove()
        except CaptureError as err:
            log.error("%s", err)
