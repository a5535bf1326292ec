"""The ``graphpass`` command (also ``python -m graphpass``): ``demo``, ``explain``, ``audit``, ``compare``, ``golden``, ``trace``."""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os
import sys
import tempfile
import time
from typing import Any, Sequence

from .errors import ConfigError, GraphpassError


def load_factory(spec: str) -> tuple[Any, tuple]:
    """``package.module:factory`` -> ``(model, example_inputs)`` from calling ``factory()``."""
    if ":" not in spec:
        raise ConfigError("factory", spec, "expected 'module:function', e.g. graphpass.models.corpus:tiny_transformer")
    mod_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ConfigError("factory", spec, f"cannot import {mod_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError("factory", spec, f"{mod_name!r} has no callable {attr!r}")
    built = fn()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[1], (tuple, list))):
        raise ConfigError("factory", spec, "the factory must return (model, example_inputs_tuple)")
    return built[0], tuple(built[1])


def _explain(args: argparse.Namespace) -> int:
    from .explain_report import explain

    model, inputs = load_factory(args.factory)
    options: dict[str, Any] = {}
    if args.traps is not None:
        options["traps"] = args.traps
    report = explain(model, *inputs, **options)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
        if args.tensors:
            print()
            print(report.tensor_table())
    return 0


def parse_dynamic(specs: Sequence[str]) -> dict[str, dict[int, tuple[int | None, int | None]]]:
    """``["x=0", "y=1:2:512", "y=2::64"]`` -> ``{"x": {0: (None, None)}, "y": {1: (2, 512), 2: (None, 64)}}``."""
    out: dict[str, dict[int, tuple[int | None, int | None]]] = {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        parts = rest.split(":")
        try:
            if not eq or not name or len(parts) not in (1, 3):
                raise ValueError
            dim = int(parts[0])
            lo, hi = (
                (None, None)
                if len(parts) == 1
                else (int(parts[1]) if parts[1] else None, int(parts[2]) if parts[2] else None)
            )
        except ValueError:
            raise ConfigError(
                "dynamic", spec, "expected NAME=DIM or NAME=DIM:MIN:MAX (MIN, MAX may be empty)"
            ) from None
        if dim in out.setdefault(name, {}):
            raise ConfigError("dynamic", spec, f"dim {dim} of {name!r} is given twice")
        out[name][dim] = (lo, hi)
    return out


def _audit(args: argparse.Namespace) -> int:
    from .static_shapes import audit

    dynamic = parse_dynamic(args.dynamic)
    model, inputs = load_factory(args.factory)
    train = True if args.train else (False if args.inference else None)
    report = audit(model, *inputs, dynamic=dynamic, train=train, partial_factor=args.partial_factor)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    return 0


def _demo(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:  # the disk offload's folder, if any, goes with it
        return _run_demo(args, stack)


def _run_demo(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    import torch

    from .dynamo_backend import GraphpassBackend
    from .explain_report import ExplainReport
    from .models.corpus import demo_model

    model, inputs = demo_model(seed=args.seed)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"graphpass demo: TinyTransformer, {n_params / 1e6:.2f} M parameters, delegate {args.then}"
        + (f", layer weights offloaded to storage={args.offload!r}" if args.offload != "none" else "")
    )
    reference = copy.deepcopy(model)  # eager reference with its weights in place
    state = _demo_offload(args, model, stack)
    gp = GraphpassBackend({"then": args.then})
    compiled = torch.compile(model, backend=gp)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = compiled(*inputs)
    compile_s = time.perf_counter() - t0
    print(ExplainReport(graphs=gp.graphs, config=gp.config, offload=state))
    print()
    worst, got, ref, events = _demo_fresh_inputs(args, model, inputs, compiled, reference)
    ran = sorted({label for kind, label in events if kind == "enter"})
    rtol, atol = 1e-4, 1e-5
    ok = torch.allclose(got, ref, rtol=rtol, atol=atol) and worst <= atol + rtol * ref.abs().max().item()
    print(f"first call (compile + run): {compile_s:.1f} s; traps that ran: {', '.join(ran)}")
    print(
        f"max |compiled - eager| over 3 fresh inputs: {worst:.3g} (tolerance atol={atol}, rtol={rtol}: "
        f"{args.then} reorders float math) -> {'OK' if ok else 'MISMATCH'}"
    )
    if state is not None:
        from .offloading import memory_stats

        print()
        print(memory_stats(compiled))
    del out
    print()
    print(
        "next: docs/index.md (the map), `graphpass explain MODULE:FACTORY` for your model's traps and owners,\n"
        "      `graphpass audit MODULE:FACTORY --dynamic NAME=DIM` for its variable-size allocations,\n"
        "      `graphpass trace MODULE:FACTORY --plot trace.png` to see whether loads overlap compute (docs/trace.md),\n"
        "      docs/capture.md for `graphpass compare`, docs/offload.md for memory_stats"
    )
    return 0 if ok else 1


def _demo_offload(args: argparse.Namespace, model: Any, stack: contextlib.ExitStack) -> Any:
    """``--offload cpu|disk``: the demo model's layer weights offloaded; its OffloadState, or None for ``none``."""
    state = None
    if args.offload != "none":
        from .offloading import OffloadConfig, offload

        folder = None
        if args.offload == "disk":  # removed with its files when the demo ends, however it ends
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="graphpass-demo-"))
        model.requires_grad_(False)
        state = offload(model, OffloadConfig(device="cpu", storage=args.offload, disk_path=folder))
    return state


def _demo_fresh_inputs(args: argparse.Namespace, model: Any, inputs: tuple, compiled: Any, reference: Any) -> tuple:
    """Three fresh random inputs through compiled and eager: ``(worst abs diff, last got, last ref, trap events)``."""
    import torch

    from .ops import trace_traps

    g = torch.Generator().manual_seed(args.seed + 1)
    worst = 0.0
    with torch.no_grad():
        for _trial in range(3):  # fresh random inputs, not the ones it was compiled with
            ids = torch.randint(0, model.cfg.vocab, inputs[0].shape, generator=g)
            with trace_traps() as events:
                got = compiled(ids)
            ref = reference(ids)
            worst = max(worst, (got - ref).abs().max().item())
    return worst, got, ref, events


def _compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .comparing import CompareError, compare

    report = compare(args.ref, list(args.test), rtol=args.rtol, atol=args.atol)
    print(report)
    target = Path(args.json) if args.json else Path(args.test[0]) / "compare_summary.json"
    try:
        written = report.write_json(target)
    except OSError as exc:
        raise CompareError(f"cannot write the JSON summary to {str(target)!r}: {exc}") from None
    print(f"summary written to {_shown(written)}")
    _compare_pictures(report, args)
    return 0 if report.passed else 1


def _shown(path: Any) -> str:
    return os.fsdecode(path).encode("utf-8", "backslashreplace").decode("utf-8")


def _compare_pictures(report: Any, args: argparse.Namespace) -> None:
    """``--plot PATH`` / ``--html PATH``: the divergence plot and the self-contained page (graphpass[plot])."""
    if not (args.plot or args.html):
        return
    from pathlib import Path

    from .comparing import CompareError
    from .comparing.plots import html_page, render_png

    png = render_png(report)  # raises PlotUnavailableError (exit 2) without matplotlib
    for target, data, what in ((args.plot, png, "plot"), (args.html, None, "page")):
        if not target:
            continue
        if data is None:
            data = html_page(report, png).encode("utf-8")
        try:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            from .atomic_files import write_bytes_atomic

            write_bytes_atomic(Path(target), data)
        except OSError as exc:
            raise CompareError(f"cannot write the {what} to {str(target)!r}: {exc}") from None
        print(f"{what} written to {_shown(target)}")


def _golden(args: argparse.Namespace) -> int:
    from .golden import GoldenMismatch
    from .testing import golden_check

    model, inputs = load_factory(args.factory)
    name = args.name or args.factory.rpartition(":")[2]
    capture = args.capture or None
    try:
        accept = "release" if args.accept_release else (True if args.accept else None)
        result = golden_check(
            model,
            *inputs,
            name=name,
            directory=args.dir,
            accept=accept,
            then=args.then,
            capture=capture,
            hint="re-accept with `graphpass golden ... --accept`",
        )
    except GoldenMismatch as exc:
        print(f"FAIL {name}: {exc}")
        return 1
    if result.accepted == "release":
        print(f"accepted {name} for this torch release: its exact golden beside {_shown(result.text_path)}")
        return 0
    if result.accepted:
        print(f"accepted {name}: wrote {_shown(result.text_path)}, {_shown(result.summary_path)} and the meta file")
        return 0
    print(f"ok {name}: structural summary matches {_shown(result.summary_path)}")
    if result.exact_skipped:
        print(f"skipped: {result.exact_skipped}")
    else:
        print(f"ok {name}: exact rendering matches {_shown(result.text_path)}")
    return 0


def _add_compare_and_golden(add: Any) -> None:
    """The ``compare`` and ``golden`` subcommands (``add`` makes a subparser with an example)."""
    _add_compare(add)
    _add_golden(add)


def _add_compare(add: Any) -> None:
    """The ``compare`` subcommand: two capture directories, tensor by tensor."""
    p = add(
        "compare",
        "compare two capture directories tensor by tensor: graphpass compare REF TEST [TEST ...]",
        "graphpass compare captures_cpu captures_gpu --rtol 1e-3 --atol 1e-5 --json summary.json\n"
        "  graphpass compare captures_tp1 hostA/captures hostB/captures   # one TP run written on two hosts\n"
        "  graphpass compare ref vllm_captures   # `graphpass reference` vs vLLM: aligned by request and position",
    )
    p.add_argument("ref", help="reference capture directory")
    p.add_argument(
        "test",
        nargs="+",
        help="capture directory to check against REF; several: the roots of one run "
        "whose ranks wrote on several hosts, read as one",
    )
    p.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default: 1e-3)")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default: 1e-5)")
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="where to write the JSON summary (default: TEST/compare_summary.json, the first TEST)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="draw each step's relative error per module, the tolerance and the first divergence "
        "(needs matplotlib: pip install 'graphpass[plot]')",
    )
    p.add_argument(
        "--html",
        default=None,
        metavar="PATH",
        help="write one self-contained page: the plot, the table, both runs' meta (needs graphpass[plot])",
    )
    p.description += (
        "\n\nacross engines (a `graphpass reference` run as REF, a vLLM plugin run as TEST): steps are "
        "aligned by request and\ntoken position, the engine's modules rebuilt in transformers' terms "
        "(docs/vllm.md)"
    )
    p.description += (
        "\n\nexit status: 0 every tensor matches; 1 a difference, or a step, module, rank or key one run has "
        "and the other lacks\n(a FAIL row naming it, see docs/capture.md), or nothing compared; 2 bad arguments"
    )
    p.set_defaults(func=_compare)


def _add_golden(add: Any) -> None:
    """The ``golden`` subcommand: a model's graphs against its golden files."""
    p = add(
        "golden",
        "check a model's graphs against its golden files: graphpass golden module:factory --dir DIR",
        "graphpass golden graphpass.models.corpus:tiny_transformer --dir tests/golden --accept",
    )
    p.add_argument("factory", help="module:function returning (model, example_inputs)")
    p.add_argument(
        "--dir", required=True, help="folder of the golden files (NAME.txt, NAME.summary.json, NAME.meta.json)"
    )
    p.add_argument("--name", default=None, help="golden name (default: the factory's function name)")
    p.add_argument(
        "--accept", action="store_true", help="write the goldens instead of comparing (also GRAPHPASS_ACCEPT_GOLDEN=1)"
    )
    p.add_argument(
        "--accept-release",
        action="store_true",
        help="record this torch release's exact golden beside the main one, NAME.torch<major.minor>.txt "
        "where it differs (also GRAPHPASS_ACCEPT_GOLDEN=release)",
    )
    p.add_argument("--then", default="eager", help="delegate backend (default: eager)")
    p.add_argument(
        "--capture",
        nargs="+",
        default=None,
        metavar="PATTERN",
        help="attach a ModelCapture for these module patterns (the capture nodes become part of the golden)",
    )
    p.set_defaults(func=_golden)


def parse_size(spec: str) -> tuple[int, int]:
    """``"1200x360"`` -> ``(1200, 360)`` (pixels)."""
    width, x, height = spec.lower().partition("x")
    try:
        if not x:
            raise ValueError
        return int(width), int(height)
    except ValueError:
        raise ConfigError("plot-size", spec, "expected WIDTHxHEIGHT in pixels, e.g. 1200x360") from None


def _trace(args: argparse.Namespace) -> int:
    import torch

    from .dynamo_backend import GraphpassBackend
    from .tracing import trace

    size = parse_size(args.plot_size)
    from .tracing import check_outputs

    check_outputs(args.out, args.plot, names=("--out", "--plot"))  # before the model is built or run
    model, inputs = load_factory(args.factory)
    with contextlib.ExitStack() as stack:
        if args.offload != "none":
            from .offloading import OffloadConfig, offload

            folder = (
                stack.enter_context(tempfile.TemporaryDirectory(prefix="graphpass-trace-"))
                if args.offload == "disk"
                else None
            )
            model.requires_grad_(False)
            offload(
                model,
                OffloadConfig(device="cpu", storage=args.offload, disk_path=folder, prefetch_distance=args.prefetch),
            )
        compiled = torch.compile(model, backend=GraphpassBackend({"then": args.then}))
        with torch.no_grad():
            report = trace(
                compiled,
                *inputs,
                path=args.out,
                plot=args.plot,
                plot_size=size,
                calls=args.calls,
                warmup=args.warmup,
                title=args.title or "",
            )
        del compiled, model  # the offload file goes with the model, before its folder
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
        if report.plot is not None:
            print(f"plot written to {_shown(report.plot)}")
    return 0


def _add_trace(add: Any) -> None:
    """The ``trace`` subcommand: the offload schedule as a Chrome / Perfetto timeline (docs/trace.md)."""
    p = add(
        "trace",
        "run a model under torch.profiler and write a Chrome / Perfetto trace with every trap, "
        "load and eviction as a range: graphpass trace module:factory",
        "graphpass trace graphpass.models.trace_example:compute_bound --prefetch 1 --out trace.json --plot trace.png",
    )
    p.add_argument("factory", help="module:function returning (model, example_inputs)")
    p.add_argument("--out", default="trace.json", metavar="PATH", help="the trace file to write (default: trace.json)")
    p.add_argument(
        "--offload",
        default="cpu",
        choices=("none", "cpu", "disk"),
        help="stream the repeated blocks' weights from host memory or disk (default: cpu; none: keep them)",
    )
    p.add_argument("--prefetch", type=int, default=1, metavar="N", help="prefetch_distance: traps ahead (default: 1)")
    p.add_argument("--then", default="aot_eager", help="delegate backend (default: aot_eager)")
    p.add_argument("--calls", type=int, default=1, help="calls traced, after the warm-up (default: 1)")
    p.add_argument("--warmup", type=int, default=1, help="calls before tracing; the first compiles (default: 1)")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="also draw the timeline (needs matplotlib: pip install 'graphpass[plot]')",
    )
    p.add_argument(
        "--plot-size", default="1200x360", metavar="WxH", help="the plot's size in pixels (default: 1200x360)"
    )
    p.add_argument("--title", default=None, help="a title for the plot")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (schema in docs/cli.md)")
    p.set_defaults(func=_trace)


def _reference(args: argparse.Namespace) -> int:
    from .reference import read_prompts, reference_run

    tokens = reference_run(args.model_dir, read_prompts(args.prompts), args.max_new_tokens, args.modules, args.out)
    print(f"reference: {len(tokens)} request(s), tokens in {os.path.join(args.out, 'tokens.json')}")
    return 0


def _add_reference(add: Any) -> None:
    p = add(
        "reference",
        "transformers, eager, greedy: capture MODULES of each prompt's steps, as an engine run to compare "
        "against: graphpass reference MODEL_DIR --prompts P.json --max-new-tokens N --modules ... --out REF",
        "graphpass reference ./llama --prompts prompts.json --max-new-tokens 4 --modules model.layers.0-1 --out ref",
    )
    p.add_argument("model_dir", help="a transformers checkpoint folder (config.json, weights)")
    p.add_argument("--prompts", required=True, help="JSON file: a list of prompts, each a list of token ids")
    p.add_argument("--max-new-tokens", type=int, required=True, help="greedy tokens generated per prompt")
    p.add_argument("--modules", nargs="+", required=True, metavar="PATTERN", help="module patterns to capture")
    p.add_argument("--out", required=True, help="capture folder; also gets tokens.json (tokens per prompt, in order)")
    p.set_defaults(func=_reference)


def _add_demo(add: Any) -> None:
    """The ``demo`` subcommand: the bundled transformer, compiled and checked against eager."""
    p = add(
        "demo",
        "compile the bundled transformer with graphpass and check it against eager",
        "graphpass demo --offload disk --then aot_eager",
    )
    p.add_argument("--then", default="inductor", help="delegate backend (default: inductor)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--offload",
        default="cpu",
        choices=("none", "cpu", "disk"),
        help="stream the layer weights from host memory or disk (default: cpu; none: keep them)",
    )
    p.set_defaults(func=_demo)


def _add_explain(add: Any) -> None:
    """The ``explain`` subcommand: a model's trap table."""
    p = add(
        "explain",
        "print the trap table of a model: graphpass explain module:factory",
        "graphpass explain graphpass.models.corpus:tiny_transformer --tensors",
    )
    p.add_argument("factory", help="module:function returning (model, example_inputs)")
    p.add_argument("--traps", nargs="+", default=None, help="trap patterns (default: the repeated blocks)")
    p.add_argument("--tensors", action="store_true", help="also print every weight's owners")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_explain)


def _add_audit(add: Any) -> None:
    """The ``audit`` subcommand: variable-size allocations and whether a fixed buffer fits."""
    p = add(
        "audit",
        "list variable-size allocations and whether a fixed buffer fits: graphpass audit module:factory --dynamic x=0",
        "graphpass audit graphpass.models.audit_example:factory --dynamic x=0:2:512 --json",
    )
    p.add_argument("factory", help="module:function returning (model_or_fn, example_inputs)")
    p.add_argument(
        "--dynamic",
        action="append",
        required=True,
        metavar="NAME=DIM[:MIN:MAX]",
        help="an input dim that varies, with an optional range (repeat for more dims)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--train", action="store_true", help="trace forward and backward with grad enabled")
    mode.add_argument("--inference", action="store_true", help="trace under no_grad only")
    p.add_argument(
        "--partial-factor",
        type=float,
        default=16.0,
        help="bound / example-size ratio above which a bounded allocation is PARTIAL (default: 16)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_audit)


def main(argv: Sequence[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="graphpass", description=__doc__)
    parser.add_argument("--version", action="version", version=f"graphpass {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str, example: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=f"example:\n  {example}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    _add_demo(add)
    _add_explain(add)
    _add_audit(add)
    _add_compare_and_golden(add)
    _add_trace(add)
    _add_reference(add)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except GraphpassError as err:
        print(f"graphpass: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
