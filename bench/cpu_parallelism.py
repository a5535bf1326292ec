"""How many processes this machine really runs at once: the same pure-Python loop in 1, 2, ...
processes started together, each timed (wall and CPU). With N independent cores, N copies take as
long as one; where the vCPUs share a physical core or the host steals time, they take longer. What
a writer process or thread can hide behind a model's compute depends on it
(docs/benchmarks.md, "Capture on against capture off").

    python bench/cpu_parallelism.py [--max 2] [--loops 30000000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from tabulate import tabulate


def spin(loops: int, out: "mp.Queue") -> None:
    t, c = time.perf_counter(), time.process_time()
    x = 0
    for i in range(loops):
        x += i
    out.put((time.perf_counter() - t, time.process_time() - c))


def run(n: int, loops: int) -> list[tuple[float, float]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=spin, args=(loops, out)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--loops", type=int, default=30_000_000)
    args = ap.parse_args()
    base = statistics.median(w for w, _ in run(1, args.loops))
    rows = []
    for n in range(1, args.max + 1):
        res = run(n, args.loops)
        wall = statistics.median(w for w, _ in res)
        rows.append(
            [
                n,
                f"{wall:.2f}",
                f"{statistics.median(c for _, c in res):.2f}",
                f"{wall / base:.2f}",
                f"{n * base / wall:.2f}",
            ]
        )
    print(f"os.cpu_count() = {os.cpu_count()}; the same loop in N processes at once")
    print(
        tabulate(
            rows,
            headers=[
                "processes",
                "wall s (median)",
                "CPU s (median)",
                "wall ratio to 1 process",
                "cores' worth of work done",
            ],
        )
    )


if __name__ == "__main__":
    main()
