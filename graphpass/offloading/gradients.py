"""Gradients of host copies: what the backward pass of ``load_wait`` sends back to the host tensor a weight was
loaded from (``graphpass::accumulate_grad``).

From a CUDA device inside a backward pass the copy to the host does not stop the compute: it runs on
its own stream into a reused page-locked buffer, the worker adds it on the host once the copy is done,
and the backward pass ends only after every such addition (an autograd callback waits for them), so
the optimizer never reads a partial gradient. Elsewhere the gradient is added at once.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .staging import StagingPool
from .workers import Job, Worker


class GradientLanding:
    """One model's gradient copies from the device to its host copies (one per runtime, made again in a
    child made by ``fork()``). ``worker()`` is the runtime's worker; ``finish`` the callback the end of a
    backward pass runs (the runtime's ``finish_gradients``, which waits with its load timeout)."""

    def __init__(
        self, device: torch.device, staging: StagingPool, worker: Callable[[], Worker], finish: Callable[[], None]
    ) -> None:
        self._device = device
        self._staging = staging
        self._worker = worker
        self._finish = finish
        self._lock = threading.RLock()
        self.pending: list[Job] = []  # gradient additions of the running backward pass (CUDA)
        self._stream = None
        self._task = -1  # the backward pass (autograd graph task) whose end waits for them

    def add(self, host: torch.Tensor, grad: torch.Tensor) -> None:
        """Add ``grad`` to the gradient of ``host`` (see the module's docstring)."""
        if grad.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            add_grad(host, grad.to(device=host.device, dtype=host.dtype), grad)
            return
        task = torch._C._current_graph_task_id()
        if task == -1:  # not inside a backward pass
            add_grad(host, grad.to(device=host.device, dtype=host.dtype), grad)
            return
        with self._lock:
            if task != self._task:  # once per backward pass: its end waits for the additions
                self._task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            stream = self._d2h_stream()
            stream.wait_stream(torch.cuda.current_stream(grad.device))
            buf = self._staging.take(host.numel() * host.element_size())
            part = buf[: host.numel() * host.element_size()].view(host.dtype).view(host.shape)
            event = torch.cuda.Event()
            with torch.cuda.stream(stream):
                part.copy_(grad.to(host.dtype), non_blocking=True)
                event.record(stream)
            grad.record_stream(stream)
            self.pending.append(self._worker().submit(self.land, host, buf, part, event))

    def land(self, host: torch.Tensor, buf: torch.Tensor, part: torch.Tensor, event) -> None:
        """On the worker, once the copy is done: the first gradient of a backward pass becomes the host
        copy's gradient as it lies in the page-locked buffer (no host copy of it; the buffer leaves
        the pool, and torch's page-locked allocator caches it when the gradient is freed), a later
        one is added and its buffer goes back to the pool."""
        kept = False
        try:
            event.synchronize()
            if host.grad is None:
                host.grad = part
                kept = True
            else:
                host.grad.add_(part)
        finally:
            if not kept:
                self._staging.give(buf)

    def finish(self, timeout: float) -> None:
        """Wait until every gradient copy this backward pass started has been added on the host."""
        with self._lock:
            pending, self.pending = self.pending, []
            self._task = -1
        for job in pending:
            job.result(timeout)

    def _d2h_stream(self):
        """The gradients' CUDA stream, made on first use."""
        if self._stream is None:
            with self._lock:
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=self._device)
        return self._stream


def add_grad(host: torch.Tensor, g: torch.Tensor, source: torch.Tensor | None) -> None:
    """``host.grad += g`` (``g`` becomes the gradient when there is none; copied when it is
    ``source`` itself or a reused buffer)."""
    if host.grad is None:
        host.grad = g.clone() if source is None or g is source else g
    else:
        host.grad.add_(g)
