"""``compare`` across engines: a serving engine's captures (vLLM, docs/vllm.md) against a reference run
in transformers (``graphpass reference``), aligned by request and token position, not by folder name.

The engine runs several requests as one flattened batch of tokens (its step folders say nothing the
reference's do); the reference runs one request at a time. Both metas say, per tensor row, which
request (``req_ids[token_request[i]]``) and which position (``positions[i]``) it is. So the test's
steps are walked in execution order (``step_index``), and for each, every captured row is matched to
the reference's row of the same request and position, wherever the reference holds it:

* request ids: vLLM's internal id is the caller's plus ``-<suffix>``, stripped here; the reference's
  are the prompt indices ``"0"``, ``"1"``, ... (as ``LLM.generate`` numbers the requests of a fresh
  ``LLM``);
* rows: an engine's tensors are ``[tokens, ...]`` (``engine: "vllm"``), the reference's
  ``[1, tokens, ...]`` (``engine: "transformers"``: a batch of one request);
* modules: the engine's modules are rebuilt in transformers' terms by the model family's adapter
  (:mod:`graphpass.comparing.engine_families`: hidden + residual, fused q/k/v and gate/up split),
  found by the engine and model type (the meta's ``engine`` and ``model.model_type``: another engine's
  family for the same model type is its own);
* tokens: where both metas hold ``input_ids`` (the token fed at each row), they are compared exactly
  first in each step, as module ``<input_ids>``.

Rows: one :class:`CompareRow` per test step, module and key, over all of that step's tokens (the
reference's rows gathered in the test's token order); ``first_failure`` is then the first diverging
module of the first step where anything diverges. The completeness contract holds as in
:func:`compare`: a token of a test step that the reference lacks, a token of the reference that no test
step holds, a module or key one side lacks, are ``FAIL`` rows naming it (``missing``).

Tensor parallelism (the engine's meta ``model.tp_size`` > 1): every rank ``0 .. tp_size-1`` of the
engine is compared with the reference, one row per rank. The family rebuilds each rank's tensors
(``ModelShape.tp_rank``); a tensor every rank holds whole (a decoder layer's output, all-reduced) is
compared whole, a rank's shard (a :class:`~graphpass.comparing.engine_families.Slice`: its q/k/v heads,
its part of gate/up) with the matching part of the reference's tensor. So ranks that disagree are
named: the rank whose copy diverges fails. Each rank wrote its own meta: they must describe the same
tokens (requests, positions, token ids) as rank 0's, else a ``FAIL`` row names the rank (its steps are
not the engine's steps of rank 0); a rank with no meta file or no tensor file is a ``FAIL`` row too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..capture_format import (
    ENGINE,
    INPUT_IDS,
    MODEL,
    POSITIONS,
    REFERENCE_ENGINE,
    REQ_IDS,
    ROW_FIELDS,
    STEP,
    VLLM_ENGINE,
    EngineStepMeta,
    meta_file_name,
)
from .compare_report import FAIL, CompareError, CompareReport, CompareRow
from .compare_tensors import compare_tensors
from .completeness import StepScan, execution_order, find_steps, natural
from .engine_families import FAMILIES, FamilyRegistry, ModelShape, RebuildError, Slice

__all__ = ["ENGINES", "compare_engines", "engine_of"]

ENGINES = (VLLM_ENGINE, REFERENCE_ENGINE)  # the meta's "engine" values compare_engines reads (and any engine
# a family is registered for: its rows are tokens, its request ids as written)
TOKENS = "<input_ids>"  # the module name of the token rows
OTHER_MODELS = ("draft", "vision")  # subdirectories where an engine's other models' steps are (ModelCapture)


def engine_of(scans: dict[str, StepScan]) -> str | None:
    """The ``engine`` the metas of one run name (the first found), or None."""
    for rel in sorted(scans, key=natural):
        engine = (scans[rel].meta or {}).get(ENGINE)
        if isinstance(engine, str):
            return engine
    return None


@dataclass(eq=False)  # hashed by identity
class _Step:
    """One step of one side: its meta's per-row (request, position), and its tensors, loaded once."""

    rel: str
    scan: StepScan
    engine: str
    tokens: list[tuple[str, int] | None] = field(default_factory=list)  # row -> (request, position); None: padding
    cached: dict[str, int] = field(default_factory=dict)  # request -> its first positions served from a prefix cache
    parents: dict[str, str] = field(default_factory=dict)  # parallel-sampling child -> the request it was forked from
    _loaded: dict[tuple[str, int], dict[str, torch.Tensor] | str] = field(default_factory=dict)

    @classmethod
    def read(cls, rel: str, scan: StepScan, engine: str) -> "_Step":
        meta = scan.meta or {}
        fields = EngineStepMeta.from_dict(meta)
        req_ids, which = meta.get(REQ_IDS) or [], fields.token_request
        positions = torch.as_tensor(meta.get(POSITIONS) or [], dtype=torch.long).reshape(-1).tolist()
        if not isinstance(which, list) or len(which) != len(positions):
            raise CompareError(
                f"{rel}: its meta has no token_request of {len(positions)} rows (positions): "
                "not a capture of graphpass's vLLM plugin or `graphpass reference`"
            )
        step = cls(rel, scan, engine)
        for i, pos in zip(which, positions):
            ok = isinstance(i, int) and 0 <= i < len(req_ids)
            step.tokens.append((_request(str(req_ids[i]), engine), int(pos)) if ok else None)
        requests = [_request(str(r), engine) for r in req_ids]
        cached, parents = fields.prefix_cached, fields.parents
        if isinstance(cached, list) and len(cached) == len(requests):
            step.cached = {r: int(n) for r, n in zip(requests, cached) if isinstance(n, int) and n > 0}
        if isinstance(parents, list) and len(parents) == len(requests):
            step.parents = {r: str(p) for r, p in zip(requests, parents) if isinstance(p, str) and p}
        return step

    def tensors(self, module: str, rank: int = 0) -> dict[str, torch.Tensor] | str:
        """``module``'s tensors of tensor-parallel rank ``rank``, rows = tokens (the reference's batch dim
        of 1 dropped), or why not."""
        if (module, rank) not in self._loaded:
            self._loaded[module, rank] = self._load(module, rank)
        return self._loaded[module, rank]

    def _load(self, module: str, rank: int) -> dict[str, torch.Tensor] | str:
        path = self.scan.files.get(module, {}).get(rank)
        if path is None:
            return "rank file missing"
        try:
            out = load_file(str(path))
        except Exception as exc:  # a corrupt file is a FAIL row, never a crash
            return f"cannot read: {type(exc).__name__}: {exc}"
        out = {k: v for k, v in out.items() if not k.startswith("other[")}
        if self.engine == REFERENCE_ENGINE:
            out = {k: v[0] if v.dim() >= 2 and v.shape[0] == 1 else v for k, v in out.items()}
        return out

    def input_ids(self) -> list | None:
        ids = (self.scan.meta or {}).get(INPUT_IDS)
        return ids if isinstance(ids, list) and len(ids) == len(self.tokens) else None


def _request(rid: str, engine: str) -> str:
    """vLLM's internal request id is the caller's plus ``-<suffix>``."""
    return rid.rsplit("-", 1)[0] if engine == VLLM_ENGINE and "-" in rid else rid


def compare_engines(ref: Path, test: Path, report: CompareReport, families: FamilyRegistry | None = None) -> None:
    """Append to ``report`` the rows of ``test`` (an engine's captures) against ``ref`` (see the module docstring)."""
    families = FAMILIES if families is None else families
    sides = []
    for name, root in (("ref", ref), ("test", test)):
        scans = _one_model({rel: StepScan.read(root / rel) for rel in find_steps(root)}, name, root, report)
        sides.append((scans, engine_of(scans)))
    (ref_scans, ref_engine), (test_scans, test_engine) = sides
    known = list(dict.fromkeys([*ENGINES, *families.engines()]))
    for name, engine in (("ref", ref_engine), ("test", test_engine)):
        if engine not in known:
            raise CompareError(
                f"{name}: its metas name no engine graphpass can align ({engine!r}; known: {', '.join(known)})"
            )
    ref_steps = [
        _Step.read(rel, ref_scans[rel], ref_engine) for rel in execution_order(set(ref_scans), ref_scans, {})[0]
    ]
    order, notes = execution_order(set(test_scans), {}, test_scans)
    report.notes.extend(notes)
    test_steps = [_Step.read(rel, test_scans[rel], test_engine) for rel in order]
    shape = _shape(test_steps, ref_steps)
    family = families.lookup(shape.model_type, engine=test_engine)
    report.notes.append(
        f"across engines: {test_engine} against {ref_engine}, aligned by request and position; "
        f"modules rebuilt by the {family.name!r} family"
    )
    if shape.tp_size > 1:
        report.notes.append(
            f"test: {shape.tp_size} tensor-parallel ranks, each compared with the reference "
            "(whole tensors whole, each rank's shard with its part)"
        )
    where = _index(ref_steps, report)
    _align_children(test_steps, where, report)
    seen: set[tuple[str, int]] = set()
    for step in test_steps:
        _compare_step(report, step, where, family, shape, seen)
    _unmatched(report, ref_steps, seen, _cached(test_steps))


def _one_model(scans: dict[str, StepScan], name: str, root: Path, report: CompareReport) -> dict[str, StepScan]:
    """The steps of the served model only: a run's ``draft/`` and ``vision/`` steps are another model's
    (aligned by the same requests and positions, but other modules): left out, with a note. Given the
    ``draft`` folder itself, its steps are the ones compared."""
    others = {rel for rel in scans if rel.split("/", 1)[0] in OTHER_MODELS}
    if not others or len(others) == len(scans):
        return scans
    folders = sorted({rel.split("/", 1)[0] for rel in others})
    report.notes.append(
        f"{name}: the steps under {', '.join(f + '/' for f in folders)} are another model's "
        f"(left out here): compare them on their own, e.g. {str(Path(root, folders[0]))!r}"
    )
    return {rel: scan for rel, scan in scans.items() if rel not in others}


def _shape(test_steps: list[_Step], ref_steps: list[_Step]) -> ModelShape:
    for step in test_steps + ref_steps:
        shape = ModelShape.from_meta((step.scan.meta or {}).get(MODEL))
        if shape is not None:
            return shape
    raise CompareError(
        "neither run's metas name the model (meta field 'model' with 'model_type'): capture with "
        "a graphpass whose vLLM plugin and `graphpass reference` record it"
    )


def _index(ref_steps: list[_Step], report: CompareReport) -> dict[tuple[str, int], tuple[_Step, int]]:
    """(request, position) -> (the reference step, row) holding it; the first, with a note on repeats."""
    where: dict[tuple[str, int], tuple[_Step, int]] = {}
    repeats = 0
    for step in ref_steps:
        for row, token in enumerate(step.tokens):
            if token is None:
                continue
            if token in where:
                repeats += 1
            else:
                where[token] = (step, row)
    if repeats:
        report.notes.append(f"ref: {repeats} token(s) captured more than once: the first is compared")
    return where


def _align_children(test_steps: list[_Step], where: dict, report: CompareReport) -> None:
    """Rows of a parallel-sampling child (``n`` > 1: the meta's ``parents``) whose request the reference lacks are
    its parent's request: the reference ran the parent's prompt once (with greedy sampling every child's tokens
    are the parent's; a sampled child that took other tokens fails at ``<input_ids>``). Rows rewritten in place,
    with a note of how many."""
    children: dict[str, str] = {}
    for step in test_steps:
        for row, tok in enumerate(step.tokens):
            parent = step.parents.get(tok[0]) if tok is not None else None
            if parent is not None and tok not in where and (parent, tok[1]) in where:
                step.tokens[row] = (parent, tok[1])
                children[tok[0]] = parent
        step.cached = {children.get(r, r): n for r, n in step.cached.items()}
    if children:
        pairs = ", ".join(f"{c} of {p}" for c, p in sorted(children.items())[:4])
        report.notes.append(
            f"test: {len(children)} parallel-sampling child request(s) aligned with the reference's "
            f"parent request ({pairs}{', ...' if len(children) > 4 else ''})"
        )


def _cached(test_steps: list[_Step]) -> dict[str, int]:
    """Request -> how many of its first positions the engine served from its prefix cache (the most any of its
    steps' metas says)."""
    out: dict[str, int] = {}
    for step in test_steps:
        for req, count in step.cached.items():
            out[req] = max(out.get(req, 0), count)
    return out


def _fmt_tokens(tokens: list[tuple[str, int]], shown: int = 4) -> str:
    by_req: dict[str, list[int]] = {}
    for req, pos in tokens:
        by_req.setdefault(req, []).append(pos)
    parts = [f"request {r} positions {','.join(map(str, sorted(p)))}" for r, p in sorted(by_req.items())]
    return "; ".join(parts[:shown]) + (f" and {len(parts) - shown} more requests" if len(parts) > shown else "")


def _compare_step(report: CompareReport, step: _Step, where: dict, family: Any, shape: ModelShape, seen: set) -> None:
    rows = [(row, tok) for row, tok in enumerate(step.tokens) if tok is not None]
    lost = [tok for _, tok in rows if tok not in where]
    if lost:
        report.rows.append(
            CompareRow(
                step.rel,
                "",
                None,
                None,
                FAIL,
                missing="ref",
                note=f"{len(lost)} token(s) missing in ref: {_fmt_tokens(lost)}",
            )
        )
    rows = [(row, tok) for row, tok in rows if tok in where]
    seen.update(tok for _, tok in rows)
    if not rows:
        return
    _compare_tokens(report, step, rows, where)
    ranks = sorted(set(range(shape.tp_size)) | step.scan.ranks)
    _check_rank_metas(report, step, ranks)
    per_rank = {}
    for rank in ranks:
        per_rank[rank] = _rebuilt(step, family, dataclasses.replace(shape, tp_rank=rank), rank)
        for module, why in list(per_rank[rank].items()):
            if isinstance(why, str) and why.startswith("cannot rebuild"):  # its pieces are then missing rows
                report.rows.append(CompareRow(step.rel, module, rank, None, FAIL, note=why))
                del per_rank[rank][module]
    ref_order = _ref_modules(rows, where)
    extra = [m for r in ranks for m in per_rank[r] if m not in ref_order]
    for module in ref_order + list(dict.fromkeys(extra)):
        ref = _ref_rows(module, rows, where)
        for rank in ranks:
            _compare_module(report, step, module, rank, rows, ref, per_rank[rank].get(module))


def _check_rank_metas(report: CompareReport, step: _Step, ranks: list[int]) -> None:
    """A FAIL row for each rank > 0 whose own meta file is missing or describes other tokens than rank 0's."""
    base = step.scan.meta or {}
    name = str(base.get(STEP) or step.scan.dir.name)
    for rank in ranks[1:]:
        path = step.scan.dir / meta_file_name(name, rank)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            why = "no meta file" if isinstance(exc, FileNotFoundError) else f"unreadable meta file ({exc})"
            report.rows.append(
                CompareRow(step.rel, "<meta>", rank, None, FAIL, missing="test", note=f"rank {rank}: {why} {path.name}")
            )
            continue
        differ = [f for f in ROW_FIELDS if doc.get(f) != base.get(f)] if isinstance(doc, dict) else ["all"]
        if differ:
            report.rows.append(
                CompareRow(
                    step.rel,
                    "<meta>",
                    rank,
                    None,
                    FAIL,
                    note=f"rank {rank}'s meta differs from rank 0's in {', '.join(differ)}: "
                    "the ranks did not capture the same engine step here",
                )
            )


def _rebuilt(step: _Step, family: Any, shape: ModelShape, rank: int) -> dict[str, Any]:
    """transformers module -> {key: tensor (or Slice) of the step's rows} of tensor-parallel rank ``rank``,
    or a str saying why it cannot be had."""
    out: dict[str, Any] = {}
    for module in step.scan.listed or sorted(step.scan.files, key=natural):
        tensors = step.tensors(module, rank)
        if isinstance(tensors, str):
            out[module] = tensors
            continue
        try:
            out.update(family.rebuild(module, tensors, shape))
        except RebuildError as exc:
            out[module] = f"cannot rebuild in transformers' terms: {exc}"
    return out


def _ref_modules(rows: list, where: dict) -> list[str]:
    """The modules of the reference steps these rows come from, in their meta's (execution) order."""
    order: list[str] = []
    for step in dict.fromkeys(where[tok][0] for _, tok in rows):
        order += [m for m in (step.scan.listed or sorted(step.scan.files, key=natural)) if m not in order]
    return order


def _compare_tokens(report: CompareReport, step: _Step, rows: list, where: dict) -> None:
    test_ids = step.input_ids()
    ref_ids = [where[tok][0].input_ids() for _, tok in rows]
    if test_ids is None or any(ids is None for ids in ref_ids):
        return
    want = torch.tensor([ids[where[tok][1]] for ids, (_, tok) in zip(ref_ids, rows)])
    got = torch.tensor([test_ids[row] for row, _ in rows])
    report.rows.append(compare_tensors(step.rel, TOKENS, 0, "input_ids", want, got, report.rtol, report.atol))


def _ref_rows(module: str, rows: list, where: dict) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The reference's tensors of ``module`` at these rows (key -> stacked rows), and what is missing."""
    ref_keys: dict[str, list[torch.Tensor]] = {}
    problems: list[str] = []
    for _, tok in rows:
        ref_step, ref_row = where[tok]
        held = module in ref_step.scan.files or module in (ref_step.scan.listed or [])
        tensors = ref_step.tensors(module) if held else "module missing"
        if isinstance(tensors, str):
            problems.append(f"ref {ref_step.rel}: {tensors}")
            continue
        for key, t in tensors.items():
            ref_keys.setdefault(key, []).append(t[ref_row])
    return {k: torch.stack(v) for k, v in ref_keys.items() if len(v) == len(rows)}, problems


def _compare_module(
    report: CompareReport,
    step: _Step,
    module: str,
    rank: int,
    rows: list,
    ref: tuple[dict[str, torch.Tensor], list[str]],
    test: dict[str, Any] | str | None,
) -> None:
    """Rows for one transformers module of one test step and rank: each key against the reference's rows
    (a :class:`Slice` against its part of the last dim)."""
    ref_keys, problems = ref
    if test is None or isinstance(test, str) or problems:
        report.rows.append(_unusable_module_row(step, module, rank, test, problems))
        return
    test_rows = [row for row, _ in rows]
    for key in list(ref_keys) + [k for k in test if k not in ref_keys]:
        if key not in test or key not in ref_keys:
            side = "test" if key not in test else "ref"
            report.rows.append(
                CompareRow(step.rel, module, rank, key, FAIL, missing=side, note=f"key missing in {side}")
            )
            continue
        want, got, note = ref_keys[key], test[key], ""
        if isinstance(got, Slice):
            want, note = want[..., got.start : got.stop], f"rank {rank}'s shard [..., {got.start}:{got.stop}]"
            got = got.tensor
        if got.dim() and test_rows and max(test_rows) >= got.shape[0]:
            # fewer rows than the meta's positions: a FAIL row naming it, not an IndexError (issue 36, item 5)
            report.rows.append(
                CompareRow(
                    step.rel,
                    module,
                    rank,
                    key,
                    FAIL,
                    note=(
                        f"test tensor has {got.shape[0]} row(s) but the step's meta places {max(test_rows) + 1} token(s) "
                        "in it: a truncated or mismatched capture"
                    ),
                )
            )
            continue
        got = got[test_rows] if got.dim() else got
        row = compare_tensors(step.rel, module, rank, key, want, got, report.rtol, report.atol)
        if note:
            row.note = "; ".join(n for n in (row.note, note) if n)
        report.rows.append(row)


def _unusable_module_row(step: _Step, module: str, rank: int, test: str | None, problems: list[str]) -> CompareRow:
    """The one FAIL row of a module that test lacks or cannot read, or whose reference rows have problems."""
    missing = _missing(
        test is None or test == "rank file missing",
        any(p.endswith(("module missing", "rank file missing")) for p in problems),
    )
    test_note = ["module missing in test"] if test is None else [f"test: {test}"] if isinstance(test, str) else []
    return CompareRow(
        step.rel,
        module,
        rank,
        None,
        FAIL,
        missing=missing,
        note="; ".join(test_note + list(dict.fromkeys(problems))[:3]),
    )


def _missing(in_test: bool, in_ref: bool) -> str | None:
    return "both" if in_test and in_ref else "test" if in_test else "ref" if in_ref else None


def _unmatched(report: CompareReport, ref_steps: list[_Step], seen: set, cached: dict[str, int]) -> None:
    """FAIL rows for reference tokens no test step held, but those the engine's metas say it served from its prefix
    cache (``prefix_cached``: it never computed them for that request, so there is nothing to compare): those are
    counted in a note."""
    served: list[tuple[str, int]] = []
    for step in ref_steps:
        lost = [tok for tok in step.tokens if tok is not None and tok not in seen]
        served += [tok for tok in lost if tok[1] < cached.get(tok[0], 0)]
        lost = [tok for tok in lost if tok[1] >= cached.get(tok[0], 0)]
        if lost:
            report.rows.append(
                CompareRow(
                    step.rel,
                    "",
                    None,
                    None,
                    FAIL,
                    missing="test",
                    note=f"{len(lost)} token(s) of ref missing in test: {_fmt_tokens(lost)}",
                )
            )
    if served:
        report.notes.append(
            f"test: {len(served)} token(s) of ref served from the engine's prefix cache (computed "
            f"for an earlier request, not in this one's steps: not compared): {_fmt_tokens(served)}"
        )
