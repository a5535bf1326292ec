"""The offload worker: one daemon thread per model running transfer jobs in order (see :class:`Worker`)."""

from __future__ import annotations

import os
import queue
import threading
import time

from ..errors import OffloadError


class Job:
    """One job of a :class:`Worker`; its outcome comes back through a C ``SimpleQueue``."""

    __slots__ = ("fn", "args", "done", "worker")

    def __init__(self, fn, args, worker: "Worker") -> None:
        self.fn, self.args, self.done, self.worker = fn, args, queue.SimpleQueue(), worker

    def run(self) -> None:
        try:
            outcome = (True, self.fn(*self.args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome = (False, exc)
        self.done.put(outcome)

    def result(self, timeout: float):
        """The job's return value (its exception re-raised); OffloadError when the worker is gone or
        it does not finish in ``timeout`` seconds. Polled in short slices: a dead worker is seen at once."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok, value = self.done.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                break
            except queue.Empty:
                if not self.worker.alive():
                    raise OffloadError(
                        f"the offload worker of this load is gone ({self.worker.why_dead()}): "
                        f"nothing was computed with partial weights"
                    ) from None
                if time.monotonic() >= deadline:
                    raise TimeoutError from None
        if not ok:
            raise value
        return value


class Worker:
    """The offload worker: one daemon thread running jobs in order from a C ``SimpleQueue``.

    Not a ``ThreadPoolExecutor``: its ``submit`` and ``Future.result`` go through Python-level
    locks (``threading.Condition``, ``Semaphore``) whose ``__enter__`` a ``KeyboardInterrupt`` can
    split right after the lock was taken, leaking it: the next ``submit`` blocked forever, or the
    worker blocked in ``set_result`` and every later load waited out ``LOAD_TIMEOUT_S`` (issue 22,
    item 8). Here the compute thread only calls ``SimpleQueue.put``/``get`` (C, atomic for Python)
    and the worker blocks on nothing the compute thread holds. Signals never run Python code on
    the worker (Python runs handlers in the main thread only)."""

    def __init__(self, name: str) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(self._jobs,), name=name, daemon=True)
        self._thread.start()

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            job.run()
            del job

    def submit(self, fn, *args) -> Job:
        job = Job(fn, args, self)
        self._jobs.put(job)
        return job

    def alive(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()

    def why_dead(self) -> str:
        if self.pid != os.getpid():
            return f"it ran in process {self.pid}, and this is a child made by fork()"
        return "its thread exited"

    def shutdown(self, timeout: float | None = None) -> None:
        self._jobs.put(None)
        if self.alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
