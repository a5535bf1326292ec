"""The padding-safety fuzzer at scale (``graphpass/static_shapes/padding_fuzz/``; issue 33, item 2).

    python bench/padding_fuzz.py [--n 20000] [--seed 0] [--jobs 2] [--time-limit SECONDS] [--no-shrink]

Runs the programs of seeds ``seed .. seed + n - 1`` through the full path (``torch.compile`` with graphpass's
bucketing, a recording delegate, every padded call compared with eager), in ``--jobs`` worker processes (at most 2),
each with one intra-op thread. Prints a table of counts and shares: programs, accepted (padded) share,
accepted-but-wrong (must be 0), errors, the programs refused, per op family the programs that have a step of it and
the share of those padded, and seconds; then every failure, shrunk, as Python source. Exits 1 when any program is
accepted but wrong (or crashed outside graphpass's own errors).

``--time-limit``: stop starting programs after that many seconds and report the programs that ran (the real
count); the run's progress goes to stderr every ``--progress`` programs.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import platform
import sys
import time
from collections import Counter

import torch

MAX_JOBS = 2


def _init_worker() -> None:
    import logging
    import warnings

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in ("torch._guards", "torch._dynamo", "torch.fx.experimental.symbolic_shapes"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _run(args: tuple[int, bool]):
    from graphpass.static_shapes import padding_fuzz as pf

    seed, do_shrink = args
    r = pf.run_program(pf.generate(seed))
    if do_shrink and r.category in ("WRONG", "error"):
        r = pf.shrink(r)
    text = pf.format_failure(r) if r.category in ("WRONG", "error", "invalid", "graph_break") else ""
    return r.program.seed, r.category, sorted(r.families), r.seconds, r.detail, text


def _table(rows: list[tuple], wall: float, jobs: int) -> tuple[str, dict]:
    from tabulate import tabulate

    from graphpass.static_shapes.padding_fuzz import CATEGORIES, FAMILIES

    n = len(rows)
    counts = Counter(r[1] for r in rows)
    accepted = counts["exact"] + counts["WRONG"]
    share = (lambda k: f"{100 * k / n:.1f}%") if n else (lambda k: "-")
    summary = [
        ["programs", n, ""],
        ["accepted (padded)", accepted, share(accepted)],
        ["  exact", counts["exact"], share(counts["exact"])],
        ["  accepted but WRONG (must be 0)", counts["WRONG"], share(counts["WRONG"])],
        ["refused (not padded)", counts["refused"], share(counts["refused"])],
        ["errors (crash)", counts["error"], share(counts["error"])],
        ["GraphpassError", counts["graphpass_error"], share(counts["graphpass_error"])],
        [
            "invalid programs (generator)",
            counts["invalid"] + counts["graph_break"],
            share(counts["invalid"] + counts["graph_break"]),
        ],
        ["seconds (wall)", f"{wall:.0f}", f"{jobs} worker(s)"],
        ["seconds per program (one worker)", f"{sum(r[3] for r in rows) / max(n, 1):.3f}", ""],
    ]
    fam_rows = []
    for f in FAMILIES:
        with_f = [r for r in rows if f in r[2]]
        acc = sum(r[1] in ("exact", "WRONG") for r in with_f)
        fam_rows.append(
            [
                f,
                len(with_f),
                acc,
                f"{100 * acc / len(with_f):.1f}%" if with_f else "-",
                sum(r[1] == "WRONG" for r in with_f),
            ]
        )
    text = (
        tabulate(summary, headers=["", "count", "share"], tablefmt="github")
        + "\n\n"
        + tabulate(
            fam_rows, headers=["op family", "programs with it", "padded", "padded share", "WRONG"], tablefmt="github"
        )
    )
    assert set(counts) <= set(CATEGORIES)
    return text, dict(counts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20000, help="programs (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--jobs", type=int, default=2, help=f"worker processes (at most {MAX_JOBS})")
    p.add_argument("--time-limit", type=float, default=None, help="stop starting programs after this many seconds")
    p.add_argument("--progress", type=int, default=500, help="print progress every this many programs")
    p.add_argument("--no-shrink", action="store_true", help="do not shrink failures")
    a = p.parse_args(argv)
    jobs = max(1, min(a.jobs, MAX_JOBS))
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    rows: list[tuple] = []
    work = ((s, not a.no_shrink) for s in range(a.seed, a.seed + a.n))
    deadline = None if a.time_limit is None else t0 + a.time_limit

    def limited():
        for item in work:
            if deadline is not None and time.perf_counter() > deadline:
                return
            yield item

    ctx = mp.get_context("spawn")
    with ctx.Pool(jobs, initializer=_init_worker, maxtasksperchild=200) as pool:
        for row in pool.imap_unordered(_run, limited(), chunksize=4):
            rows.append(row)
            if row[1] in ("WRONG", "error"):
                print(f"[{row[1]}] seed {row[0]}: {row[4]}", file=sys.stderr, flush=True)
            if len(rows) % a.progress == 0:
                c = Counter(r[1] for r in rows)
                print(f"{len(rows)} programs, {time.perf_counter() - t0:.0f} s: {dict(c)}", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    text, counts = _table(rows, wall, jobs)
    print(
        f"padding fuzz: seeds {a.seed}..{a.seed + a.n - 1} asked, {len(rows)} run; started {started:%Y-%m-%d %H:%M} "
        f"UTC; torch {torch.__version__}; python {platform.python_version()}; {mp.cpu_count()} cores"
    )
    print(text)
    failures = sorted(
        (r for r in rows if r[1] in ("WRONG", "error", "graphpass_error", "invalid", "graph_break")), key=lambda r: r[0]
    )
    for r in failures:
        print()
        print(r[5] or f"[{r[1]}] seed {r[0]}: {r[4]}")
    return 1 if counts.get("WRONG", 0) or counts.get("error", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
