"""``graphpass.compare``: compare two capture directories tensor by tensor, for accuracy debugging.

A capture directory (written by ``CaptureWriter``) looks like::

    capture_dir/[subdirectory/]dp{d}/{step}/{step}_meta.json
    capture_dir/[subdirectory/]dp{d}/{step}/{module}/rank{r}.safetensors

``compare(ref_dir, test_dir)`` walks every step of both trees (steps in execution order: by the
meta's ``step_index``, :func:`graphpass.comparing.completeness.execution_order`; modules in the
order of the ref meta's ``"modules"``), compares every tensor of every rank file in float64 (in
chunks of at most ``CHUNK_ELEMS`` elements read from the memory-mapped files, so memory stays a
small multiple of one chunk; integer and bool tensors exactly) and returns a
:class:`CompareReport` whose ``first_failure`` is the first diverging module. Corrupt or
mismatched files never raise: each becomes a ``FAIL`` row with a note, and so does a module
folder or file in a step that the step's meta file does not list (left over from another run).
Every step, module, rank and key of either side must be in the other (the completeness contract,
:mod:`graphpass.comparing.completeness`): what is absent is a ``FAIL`` row naming it, whose
``missing`` says on which side. Temporary files an interrupted capture
left behind (``.graphpass-*.tmp`` files, and folders: a step being written) are never read
(:func:`graphpass.atomic_files.is_temp_name`): a note lists them. Only bad arguments raise :class:`CompareError`.
Tensors are taken in output order (the meta's key order). A module the two runs hold in different
pieces (other tensor-parallel ranks or shards, per each rank's meta file) is compared against the
reference's assembled global tensor, rank by rank (:mod:`graphpass.comparing.shards`); either side
may be several roots (one run's ranks written on several hosts).
Notes that name two values give the ref value first: ``shape mismatch [ref] vs [test]``,
``dtype <ref> vs <test>``.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any


from .. import progress
from ..atomic_files import is_temp_name
from ..capture_format import GLOBAL_OFFSET, GLOBAL_SHAPE, meta_file_rank
from .compare_report import FAIL, MISSING_SIDES, PASS, CompareError, CompareReport, CompareRow  # noqa: F401 (re-exported)
from .compare_tensors import CHUNK_ELEMS, LazyTensor, compare_tensors, open_safetensors  # noqa: F401
from .report_format import HEADERS, printable  # noqa: F401 (re-exported)
from .completeness import StepScan, check_one_run, execution_order, find_steps, fmt_ranks, natural, run_ranks, tree_of

__all__ = ["CompareError", "CompareRow", "CompareReport", "compare"]

# always used with fullmatch (`$` would accept a trailing newline); [0-9], not \d (no Unicode digits)


def compare(
    ref_dir: "str | os.PathLike[str] | list",
    test_dir: "str | os.PathLike[str] | list",
    rtol: float = 1e-3,
    atol: float = 1e-5,
    families: Any = None,
) -> CompareReport:
    """Compare every captured tensor under ``test_dir`` with the same one under ``ref_dir``.

    A tensor passes iff the shapes match and ``torch.allclose(test, ref, rtol, atol, equal_nan=True)``
    holds in float64; an integer or bool tensor iff every element is equal. Anything one side holds
    and the other lacks is a ``FAIL`` row naming it (``CompareRow.missing``). Either side may be a
    list of roots: the captures one run's ranks wrote on several hosts, read as one tree (``ref_dir``
    / ``test_dir`` of the report join them with ``os.pathsep``). A module the two runs hold in different pieces (other ranks, other shards) is
    compared against the reference's assembled global tensor (:mod:`graphpass.comparing.shards`).
    Captures of two engines (the metas' ``engine``: a vLLM run against a ``graphpass reference``
    run) are aligned by request and token position instead, the engine's modules rebuilt in
    transformers' terms by their model family (``families``: a
    :class:`~graphpass.comparing.engine_families.FamilyRegistry`, default the registered ones):
    :mod:`graphpass.comparing.compare_engines`.
    Raises :class:`CompareError` only for bad arguments.
    """
    rtol, atol = _check_tol("rtol", rtol), _check_tol("atol", atol)
    with contextlib.ExitStack() as stack:
        (ref, ref_name), (test, test_name) = (
            _root(name, value, stack) for name, value in (("ref_dir", ref_dir), ("test_dir", test_dir))
        )
        report = CompareReport(ref_dir=ref_name, test_dir=test_name, rtol=rtol, atol=atol)
        for side, roots in (("ref", ref_dir), ("test", test_dir)):
            for root in roots if isinstance(roots, (list, tuple)) else [roots]:
                _note_temp_files(report, side, Path(root))
        _compare_trees(report, ref, test, families)
    return report


def _root(name: str, value: Any, stack: contextlib.ExitStack) -> tuple[Path, str]:
    """A capture root and its name for the report; several roots merged into one temporary tree."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise CompareError(f"{name} is an empty list: give at least one capture directory")
        if len(value) > 1:
            from .shards import merge_roots

            paths = [_check_dir(name, v) for v in value]
            merged, tmp = merge_roots(paths, name)
            stack.callback(tmp.cleanup)
            return merged, os.pathsep.join(map(str, paths))
        value = value[0]
    path = _check_dir(name, value)
    return path, str(path)


def _compare_trees(report: CompareReport, ref: Path, test: Path, families: Any = None) -> None:
    scans = (
        {rel: StepScan.read(ref / rel) for rel in find_steps(ref)},
        {rel: StepScan.read(test / rel) for rel in find_steps(test)},
    )
    check_one_run(scans[0], "ref_dir", ref)
    check_one_run(scans[1], "test_dir", test)
    from .compare_engines import engine_of, compare_engines

    engines = (engine_of(scans[0]), engine_of(scans[1]))
    if engines[0] != engines[1] and None not in engines:
        if engines[0] != "transformers":
            raise CompareError(
                f"ref_dir holds {engines[0]!r} captures and test_dir {engines[1]!r}: across engines, "
                "give the transformers reference (`graphpass reference`) as ref_dir"
            )
        compare_engines(ref, test, report, families)
        return
    steps, notes = execution_order(set(scans[0]) | set(scans[1]), *scans)
    report.notes.extend(notes)
    run = (run_ranks(scans[0]), run_ranks(scans[1]))  # the ranks each run had, per tree
    with progress.bar(len(steps), "graphpass compare", unit="step") as shown:
        for rel in steps:
            lost = [side for side, found in zip(("ref", "test"), scans) if rel not in found]
            if lost:
                report.rows.append(
                    CompareRow(rel, "", None, None, FAIL, note=f"step missing in {lost[0]}", missing=lost[0])
                )
            else:
                _compare_step(
                    report,
                    rel,
                    (
                        ("ref", scans[0][rel], run[0].get(tree_of(rel), set())),
                        ("test", scans[1][rel], run[1].get(tree_of(rel), set())),
                    ),
                )
            shown.update(1)


# --- arguments and discovery -------------------------------------------------------------------


def _check_dir(name: str, value: Any) -> Path:
    try:
        path = Path(value)
    except TypeError:
        raise CompareError(f"{name} must be a path, got {value!r}") from None
    if not path.exists():
        raise CompareError(f"{name} {str(path)!r} does not exist")
    if not path.is_dir():
        raise CompareError(f"{name} {str(path)!r} is not a directory")
    return path


def _check_tol(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CompareError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise CompareError(f"{name} must be >= 0 and finite, got {value!r}: pass a number such as --{name} 1e-3")
    return float(value)


def _note_temp_files(report: CompareReport, side: str, root: Path, shown: int = 5) -> None:
    """A note naming the temporary files an interrupted capture left under ``root`` (never compared)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        temp = [d for d in dirnames if is_temp_name(d)]  # a step folder being written when the capture stopped
        dirnames[:] = [d for d in dirnames if d not in temp]
        found += [(Path(dirpath) / f).relative_to(root).as_posix() for f in filenames + temp if is_temp_name(f)]
    if found:
        found.sort(key=natural)
        more = f" and {len(found) - shown} more" if len(found) > shown else ""
        report.notes.append(
            f"{side}: ignored {len(found)} temporary file(s) left by an interrupted capture (not data): "
            + ", ".join(printable(f) for f in found[:shown])
            + more
        )


def _module_order(report: CompareReport, rel: str, side: str, scan: StepScan) -> list[str]:
    """The meta's ``modules`` (execution order), then module folders it does not list, sorted;
    a note when there is no readable meta."""
    if scan.meta is None:
        report.notes.append(
            f"{rel}: {scan.meta_problem.replace('meta file', f'{side} meta file', 1)}; "
            "module order from sorted directory names"
        )
    listed = scan.listed or []
    return listed + sorted(set(scan.files) - set(listed), key=natural)


def _unlisted(report: CompareReport, rel: str, scan: StepScan, side: str) -> set[str]:
    """FAIL rows for what a step holds that its meta file does not list (an earlier run's leftovers):
    module folders, and files other than the meta file. Returns the unlisted module folders."""
    listed = scan.listed
    if listed is None:
        return set()
    extra: set[str] = set()
    for entry in sorted(scan.dir.iterdir(), key=lambda p: natural(p.name)):
        name = entry.name
        if name.startswith(".") or meta_file_rank(scan.dir.name, name) is not None or name in listed:
            continue
        what = "module folder" if entry.is_dir() else "file"
        if entry.is_dir():
            extra.add(name)
        report.rows.append(
            CompareRow(
                rel,
                name,
                None,
                None,
                FAIL,
                note=f"{what} in {side} not listed in its meta file (left from another run?)",
            )
        )
    return extra


def _missing_ranks(report: CompareReport, rel: str, sides: tuple) -> None:
    """A FAIL row per side for the ranks its run had (:func:`completeness.run_ranks`) of which this
    step holds nothing: no meta file, no rank file (a lost host, a rank that stopped early)."""
    for side, scan, had in sides:
        lost = had - scan.ranks
        if lost:
            what = f"rank {fmt_ranks(lost)}" if len(lost) == 1 else f"ranks {fmt_ranks(lost)}"
            report.rows.append(
                CompareRow(
                    rel,
                    "",
                    next(iter(lost)) if len(lost) == 1 else None,
                    None,
                    FAIL,
                    missing=side,
                    note=f"{what} missing in {side}: no meta or rank file of {'it' if len(lost) == 1 else 'them'} in "
                    f"this step (the {side} run has ranks {fmt_ranks(had)}: its other steps' files or tp_size)",
                )
            )


# --- comparison --------------------------------------------------------------------------------


def _compare_step(report: CompareReport, rel: str, sides: tuple) -> None:
    """``sides``: ("ref", scan, the run's ranks) and ("test", ...)."""
    (_, ref, _), (_, test, _) = sides
    ref_order, test_order = (_module_order(report, rel, side, scan) for side, scan, _ in sides)
    _missing_ranks(report, rel, sides)
    stale = _unlisted(report, rel, ref, "ref") | _unlisted(report, rel, test, "test")
    seen = set(ref_order)
    for module in ref_order + [m for m in test_order if m not in seen]:
        if module in stale:
            continue  # already a FAIL row: its files are not this run's
        in_ref, in_test = module in ref.files, module in test.files
        if not in_ref and not in_test:
            report.rows.append(
                CompareRow(rel, module, None, None, FAIL, note="listed in meta but no directory", missing="both")
            )
        elif not in_test or not in_ref:
            side = "test" if not in_test else "ref"
            report.rows.append(CompareRow(rel, module, None, None, FAIL, note=f"missing in {side}", missing=side))
        else:
            _compare_module(report, rel, module, ref, test)


def _ordered_keys(keys: set[str], order: list[str]) -> list[str]:
    """``keys`` in ``order`` (the meta's output order), then any others in natural order."""
    rank = {k: i for i, k in reversed(list(enumerate(order)))}
    return sorted(keys, key=lambda k: (0, rank[k], ()) if k in rank else (1, 0, natural(k)))


def _note_old_keys(report: CompareReport, rel: str, module: str, ref_keys: set[str], test_keys: set[str]) -> None:
    """A note when one side's keys are the numbers ``0``, ``1``, ... of a capture written before
    graphpass named tensors by their output key path, and the other side's are not."""
    old = [side for side, keys in (("ref", ref_keys), ("test", test_keys)) if keys and all(k.isdigit() for k in keys)]
    note = (
        f"{rel}/{module}: {old[0] if old else ''} names its tensors 0, 1, ... (captured by a graphpass from before tensors were "
        "named by their key path in the module's output, e.g. [0], .last_hidden_state): capture both runs "
        "with the same graphpass version"
    )
    if len(old) == 1 and not (ref_keys & test_keys) and note not in report.notes:
        report.notes.append(note)


def _resharded(files: tuple[dict, dict], want: tuple[set, set], layouts: tuple[dict, dict]) -> bool:
    """Do the two runs hold ``module`` in different pieces (other ranks, other shards)? Then the
    pieces are compared against the reference's assembled global tensor, not rank against rank.
    The ranks of a side are those with a file and those it must hold (a lost file does not make
    a run another sharding)."""
    ref_ranks, test_ranks = set(files[0]) | want[0], set(files[1]) | want[1]
    ref_layout, test_layout = layouts
    if not (ref_ranks <= set(ref_layout) and test_ranks <= set(test_layout)):
        return False  # rank files no meta file of theirs vouches for (older captures): rank against rank
    if ref_ranks != test_ranks:
        return True

    def pieces(layout: dict) -> dict:
        return {
            r: {k: (e[GLOBAL_SHAPE], e.get(GLOBAL_OFFSET)) for k, e in keys.items() if e.get(GLOBAL_SHAPE)}
            for r, keys in layout.items()
        }

    return pieces(ref_layout) != pieces(test_layout)


def _compare_module(report: CompareReport, rel: str, module: str, ref: StepScan, test: StepScan) -> None:
    """Rows for one module both steps hold: rank against rank, or across shardings
    (:mod:`graphpass.comparing.shards`) when the two runs hold it in different pieces. Every rank
    a side must hold (:meth:`StepScan.expected_ranks`) that has no file is a row."""
    files = (ref.files[module], test.files[module])
    want = (ref.expected_ranks(module), test.expected_ranks(module))
    layouts = (ref.layouts(module), test.layouts(module))
    key_order = ref.key_order(module) + test.key_order(module)
    if not files[0] and not files[1] and not (want[0] | want[1]):
        report.rows.append(CompareRow(rel, module, None, None, FAIL, note="no rank*.safetensors files", missing="both"))
        return
    resharded = bool(files[0] and files[1]) and _resharded(files, want, layouts)
    every = set(files[0]) | set(files[1]) | want[0] | want[1]
    for rank in sorted(every):
        # across shardings a side need hold only its own run's ranks; rank against rank, both sides every rank
        lost = [
            side
            for side, have, must in zip(("ref", "test"), files, want)
            if rank not in have and (rank in must or not resharded)
        ]
        if lost:
            report.rows.append(
                CompareRow(
                    rel,
                    module,
                    rank,
                    None,
                    FAIL,
                    missing=_side(lost),
                    note=f"rank file missing in {' and '.join(lost)}",
                )
            )
        elif not resharded and rank in files[0] and rank in files[1]:
            _compare_rank(
                report,
                rel,
                module,
                rank,
                (files[0][rank], files[1][rank]),
                key_order,
                (layouts[0].get(rank, {}), layouts[1].get(rank, {})),
            )
    if resharded:
        from .shards import compare_resharded

        compare_resharded(report, rel, module, files, layouts, key_order)


def _side(lost: list[str]) -> str:
    """``CompareRow.missing`` for the sides that lack an item: "ref", "test" or "both"."""
    return lost[0] if len(lost) == 1 else "both"


def _compare_rank(
    report: CompareReport,
    rel: str,
    module: str,
    rank: int,
    paths: tuple[Path, Path],
    key_order: list[str],
    listed: tuple[dict, dict],
) -> None:
    """Rows for every key of one rank's two files: the keys either file holds or either meta lists."""
    with contextlib.ExitStack() as stack:
        ref_f, ref_err = open_safetensors(paths[0], stack)
        test_f, test_err = open_safetensors(paths[1], stack)
        if ref_f is None or test_f is None:
            notes = [f"cannot read {side} file: {err}" for side, err in (("ref", ref_err), ("test", test_err)) if err]
            report.rows.append(CompareRow(rel, module, rank, None, FAIL, note="; ".join(notes)))
            return
        ref_keys, test_keys = set(ref_f.keys()), set(test_f.keys())
        keys = _ordered_keys(ref_keys | test_keys | set(listed[0]) | set(listed[1]), list(key_order))
        _note_old_keys(report, rel, module, ref_keys, test_keys)
        if not keys:
            report.rows.append(CompareRow(rel, module, rank, None, FAIL, note="rank files hold no tensors"))
        for key in keys:
            lost = [side for side, have in (("ref", ref_keys), ("test", test_keys)) if key not in have]
            if lost:
                report.rows.append(
                    CompareRow(
                        rel,
                        module,
                        rank,
                        key,
                        FAIL,
                        missing=_side(lost),
                        note=f"key missing in {' and '.join(lost)}"
                        + (" (listed in its meta file)" if len(lost) == 2 else ""),
                    )
                )
                continue
            try:
                ref_t, test_t = (
                    LazyTensor.from_slice(ref_f.get_slice(key)),
                    LazyTensor.from_slice(test_f.get_slice(key)),
                )
            except Exception as exc:
                report.rows.append(
                    CompareRow(rel, module, rank, key, FAIL, note=f"cannot read tensor: {type(exc).__name__}: {exc}")
                )
                continue
            report.rows.append(compare_tensors(rel, module, rank, key, ref_t, test_t, report.rtol, report.atol))


# --- formatting ---------------------------------------------------------------------------------
