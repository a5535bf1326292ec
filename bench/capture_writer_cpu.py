"""CPU time the capture writer spends per step, and what staging a step costs the caller.

A synthetic decode step (``--modules`` captured modules, default 32, each one ``[1, 1, --hidden]``
float32 value, default hidden 512, and the step's meta) is staged ``--steps`` times through the
real write-behind (``StagingConfig(writer=...)``, the same path as ``ModelCapture.step(wait=False)``
takes from the staging call on); no model runs, so the figures are CPU time, not wall time, and
hardly depend on what else the machine runs.

* caller CPU ms / step: ``time.thread_time()`` of the staging thread around each submit (records,
  one copy into the ring, the step's description down the pipe);
* writer CPU ms / step: the writer process's user + system time (``/proc/<pid>/stat``) over the
  measured steps, after ``--warmup`` steps (its start is not counted), divided by ``--steps``;
  with ``--writer thread``, the process's CPU time minus the caller's.

    python bench/capture_writer_cpu.py [--steps 300] [--modules 32] [--hidden 512] [--writer process]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from graphpass.capturing.staging import StagingConfig, make_write_behind
from graphpass.capturing.writer import CaptureWriter


def proc_cpu(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--modules", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--writer", default="process", choices=("process", "thread"))
    ap.add_argument("--dir", default=None, help="capture_dir's parent (default: a temporary folder)")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="gp-writer-cpu-", dir=args.dir)
    writer = CaptureWriter(os.path.join(tmp.name, "caps"))
    behind = make_write_behind(StagingConfig(writer=args.writer), writer)
    values = [torch.randn(1, 1, args.hidden) for _ in range(args.modules)]

    def stage_one() -> float:
        tensors = [(f"model.layers.{i}", v.clone(), "output", "") for i, v in enumerate(values)]
        meta = {
            "req_ids": [],
            "positions": torch.arange(1),
            "graphpass_version": "0",
            "torch_version": torch.__version__,
            "bucket": None,
            "dropped_steps": 0,
        }
        c = time.thread_time()

        def job() -> tuple:
            step, index = writer.reserve(False, 1)
            return tensors, dict(step=step, index=index, is_prefill=False, size=1, meta=meta)

        assert behind.submit(behind.nbytes(tensors), job) == "staged"
        return time.thread_time() - c

    for _ in range(args.warmup):
        stage_one()
    behind.flush()
    pid = behind._proc.pid if args.writer == "process" else os.getpid()
    u0, s0 = proc_cpu(pid)
    caller = sum(stage_one() for _ in range(args.steps))
    behind.flush()
    u1, s1 = proc_cpu(pid)
    user, system = u1 - u0, s1 - s0
    if args.writer == "thread":
        user -= caller  # roughly: the caller's share of the process's time is mostly user time
    writer_cpu = user + system
    behind.close()
    files = sum(len(fs) for _, _, fs in os.walk(tmp.name))
    print(
        f"writer={args.writer} modules={args.modules} hidden={args.hidden} steps={args.steps}: "
        f"caller CPU {caller / args.steps * 1e3:.3f} ms/step, writer CPU {writer_cpu / args.steps * 1e3:.3f} ms/step "
        f"(user {user / args.steps * 1e3:.3f}, system {system / args.steps * 1e3:.3f}) "
        f"({files} files on disk)"
    )
    tmp.cleanup()


if __name__ == "__main__":
    main()
