"""The capture writer process: writes staged capture steps from a shared memory ring.

Started by :class:`graphpass.capturing.staging.ProcessWriteBehind` as
``python -I -S writer_child.py FD SIZE``: ``FD`` is an inherited memory file (``memfd``) of ``SIZE``
bytes that the saving process copies each staged step's values into. It imports no torch (its
start costs tens of milliseconds, its memory a few MB) and no ``graphpass/__init__``: it loads
:mod:`graphpass.capturing.step_files` (and what that imports: ``atomic_files``, ``errors``) under
stand-in package modules. It shares no interpreter lock with the model: what it spends writing
files never delays the compute's Python (with a writer thread, every step's writing held the
saving process's GIL and stalled the model's next kernel launches).

Protocol. In (stdin): frames of a 4-byte little-endian length and a JSON object, ``{"seq": n,
"records": [...], "step": {...}, "writer": [capture_dir, dp_rank, tp_rank, tp_size], "spans":
[[offset, nbytes], ...]}`` (the step's values as :func:`step_files.plan_step` takes them, the step's
name, index, phase, size and meta; ``spans[i]``: where the bytes of record ``src == i`` lie in the
ring) or ``{"close": true}``. Out (stdout): one JSON line per step, in order,
``{"seq": n, "error": null | "<CaptureError text>"}``; the saving process frees the step's ring
space when it reads it. Frames are read on a thread of their own, so the saving process never
blocks on a full pipe while this process writes.

It runs in a session (process group) of its own, so a terminal's Ctrl-C reaches only the saving
process, which decides what an interrupt means; SIGINT sent to it directly is ignored. Every step
the saving process staged is still written. When its stdin
closes (the saving process exited, even killed), it writes every step it received, then exits.
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import signal
import struct
import sys
import threading
import types


def load_step_files() -> types.ModuleType:
    """``StepFiles`` without importing torch: stand-in modules for ``graphpass`` and
    ``graphpass.capturing`` whose ``__path__`` is where this file lies, so only the submodules the
    writer needs are executed."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name, path in (("graphpass", os.path.dirname(here)), ("graphpass.capturing", here)):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [path]
            sys.modules[name] = module
    from graphpass.capturing import step_files

    return step_files


def read_frames(stream, inbox: queue.SimpleQueue) -> None:
    """Put every frame of ``stream`` on ``inbox`` as it arrives, then ``None`` (end of input)."""
    try:
        while True:
            head = stream.read(4)
            if len(head) < 4:
                break
            (n,) = struct.unpack("<I", head)
            body = stream.read(n)
            if len(body) < n:
                break
            inbox.put(json.loads(body))
    finally:
        inbox.put(None)


def serve(fd: int, size: int) -> None:
    ring = mmap.mmap(fd, size)
    view = memoryview(ring)
    sf = load_step_files()
    writers: dict = {}
    acks = True
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=read_frames, args=(sys.stdin.buffer, inbox), daemon=True).start()
    while True:
        msg = inbox.get()
        if msg is None or msg.get("close"):
            break
        root, dp_rank, tp_rank, tp_size = msg["writer"]
        try:
            files = writers.get((root, tp_rank)) or writers.setdefault((root, tp_rank), sf.StepFiles(root, tp_rank))
            plan = sf.plan_step(msg["records"], **msg["step"], dp_rank=dp_rank, tp_rank=tp_rank, tp_size=tp_size)
            files.emit(plan, [view[o : o + n] for o, n in msg["spans"]])
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the saving process, which raises it
            error = str(exc) or type(exc).__name__
        if acks:
            acks = send_ack(msg["seq"], error)


def send_ack(seq: int, error: str | None) -> bool:
    """Tell the saving process step ``seq`` is done; False once it is gone (its pipe closed): the
    steps already received are still written, unacknowledged."""
    line = (json.dumps({"seq": seq, "error": error}) + "\n").encode("utf-8")
    try:
        while line:
            line = line[os.write(1, line) :]
    except OSError:
        return False
    return True


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(int(argv[1]), int(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
