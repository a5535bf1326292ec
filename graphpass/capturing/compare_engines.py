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
  (:mod:`graphpass.capturing.engine_families`: hidden + residual, fused q/k/v and gate/up split),
  found from the meta's ``model.model_type``;
* tokens: where both metas hold ``input_ids`` (the token fed at each row), they are compared exactly
  first in each step, as module ``<input_ids>``.

Rows: one :class:`CompareRow` per test step, module and key, over all of that step's tokens (the
reference's rows gathered in the test's token order); ``first_failure`` is then the first diverging
module of the first step where anything diverges. The completeness contract holds as in
:func:`compare`: a token of a test step that the reference lacks, a token of the reference that no test
step holds, a module or key one side lacks, are ``FAIL`` rows naming it (``missing``). Only the
engine's tensor-parallel rank 0 of a one-rank run is read (``tp_size`` > 1 raises).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .compare_report import FAIL, CompareError, CompareReport, CompareRow
from .compare_tensors import compare_tensors
from .completeness import StepScan, execution_order, find_steps, natural
from .engine_families import FAMILIES, FamilyRegistry, ModelShape, RebuildError

__all__ = ["ENGINES", "compare_engines", "engine_of"]

ENGINES = ("vllm", "transformers")  # the meta's "engine" values compare_engines reads
TOKENS = "<input_ids>"  # the module name of the token rows


def engine_of(scans: dict[str, StepScan]) -> str | None:
    """The ``engine`` the metas of one run name (the first found), or None."""
    for rel in sorted(scans, key=natural):
        engine = (scans[rel].meta or {}).get("engine")
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
    _loaded: dict[str, dict[str, torch.Tensor] | str] = field(default_factory=dict)

    @classmethod
    def read(cls, rel: str, scan: StepScan, engine: str) -> "_Step":
        meta = scan.meta or {}
        req_ids, which = meta.get("req_ids") or [], meta.get("token_request")
        positions = torch.as_tensor(meta.get("positions") or [], dtype=torch.long).reshape(-1).tolist()
        if not isinstance(which, list) or len(which) != len(positions):
            raise CompareError(f"{rel}: its meta has no token_request of {len(positions)} rows (positions): "
                               "not a capture of graphpass's vLLM plugin or `graphpass reference`")
        step = cls(rel, scan, engine)
        for i, pos in zip(which, positions):
            ok = isinstance(i, int) and 0 <= i < len(req_ids)
            step.tokens.append((_request(str(req_ids[i]), engine), int(pos)) if ok else None)
        return step

    def tensors(self, module: str) -> dict[str, torch.Tensor] | str:
        """``module``'s rank-0 tensors, rows = tokens (the reference's batch dim of 1 dropped), or why not."""
        if module not in self._loaded:
            self._loaded[module] = self._load(module)
        return self._loaded[module]

    def _load(self, module: str) -> dict[str, torch.Tensor] | str:
        path = self.scan.files.get(module, {}).get(0)
        if path is None:
            return "rank file missing"
        try:
            out = load_file(str(path))
        except Exception as exc:  # a corrupt file is a FAIL row, never a crash
            return f"cannot read: {type(exc).__name__}: {exc}"
        out = {k: v for k, v in out.items() if not k.startswith("other[")}
        if self.engine == "transformers":
            out = {k: v[0] if v.dim() >= 2 and v.shape[0] == 1 else v for k, v in out.items()}
        return out

    def input_ids(self) -> list | None:
        ids = (self.scan.meta or {}).get("input_ids")
        return ids if isinstance(ids, list) and len(ids) == len(self.tokens) else None


def _request(rid: str, engine: str) -> str:
    """vLLM's internal request id is the caller's plus ``-<suffix>``."""
    return rid.rsplit("-", 1)[0] if engine == "vllm" and "-" in rid else rid


def compare_engines(ref: Path, test: Path, report: CompareReport, families: FamilyRegistry | None = None) -> None:
    """Append to ``report`` the rows of ``test`` (an engine's captures) against ``ref`` (see the module docstring)."""
    families = FAMILIES if families is None else families
    sides = []
    for root in (ref, test):
        scans = {rel: StepScan.read(root / rel) for rel in find_steps(root)}
        sides.append((scans, engine_of(scans)))
    (ref_scans, ref_engine), (test_scans, test_engine) = sides
    for name, engine in (("ref", ref_engine), ("test", test_engine)):
        if engine not in ENGINES:
            raise CompareError(f"{name}: its metas name no engine graphpass can align ({engine!r}; known: "
                               f"{', '.join(ENGINES)})")
    ref_steps = [_Step.read(rel, ref_scans[rel], ref_engine) for rel in execution_order(set(ref_scans), ref_scans, {})[0]]
    order, notes = execution_order(set(test_scans), {}, test_scans)
    report.notes.extend(notes)
    test_steps = [_Step.read(rel, test_scans[rel], test_engine) for rel in order]
    shape = _shape(test_steps, ref_steps)
    family = families.lookup(shape.model_type)
    if shape.tp_size > 1:
        raise CompareError(f"test: tensor-parallel captures (tp_size {shape.tp_size}) cannot be compared across "
                           "engines yet: capture with tensor_parallel_size=1")
    report.notes.append(f"across engines: {test_engine} against {ref_engine}, aligned by request and position; "
                        f"modules rebuilt by the {family.name!r} family")
    where = _index(ref_steps, report)
    seen: set[tuple[str, int]] = set()
    for step in test_steps:
        _compare_step(report, step, where, family, shape, seen)
    _unmatched(report, ref_steps, seen)


def _shape(test_steps: list[_Step], ref_steps: list[_Step]) -> ModelShape:
    for step in test_steps + ref_steps:
        shape = ModelShape.from_meta((step.scan.meta or {}).get("model"))
        if shape is not None:
            return shape
    raise CompareError("neither run's metas name the model (meta field 'model' with 'model_type'): capture with "
                       "a graphpass whose vLLM plugin and `graphpass reference` record it")


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


def _fmt_tokens(tokens: list[tuple[str, int]], shown: int = 4) -> str:
    by_req: dict[str, list[int]] = {}
    for req, pos in tokens:
        by_req.setdefault(req, []).append(pos)
    parts = [f"request {r} positions {','.join(map(str, sorted(p)))}" for r, p in sorted(by_req.items())]
    return "; ".join(parts[:shown]) + (f" and {len(parts) - shown} more requests" if len(parts) > shown else "")


def _compare_step(report: CompareReport, step: _Step, where: dict, family: Any, shape: ModelShape,
                  seen: set) -> None:
    rows = [(row, tok) for row, tok in enumerate(step.tokens) if tok is not None]
    lost = [tok for _, tok in rows if tok not in where]
    if lost:
        report.rows.append(CompareRow(step.rel, "", None, None, FAIL, missing="ref",
                                      note=f"{len(lost)} token(s) missing in ref: {_fmt_tokens(lost)}"))
    rows = [(row, tok) for row, tok in rows if tok in where]
    seen.update(tok for _, tok in rows)
    if not rows:
        return
    _compare_tokens(report, step, rows, where)
    test_modules = _rebuilt(step, family, shape, report)
    for module, why in list(test_modules.items()):
        if isinstance(why, str) and why.startswith("cannot rebuild"):  # its pieces are then missing rows
            report.rows.append(CompareRow(step.rel, module, 0, None, FAIL, note=why))
            del test_modules[module]
    ref_order = _ref_modules(rows, where)
    for module in ref_order + [m for m in test_modules if m not in ref_order]:
        _compare_module(report, step, module, rows, where, test_modules.get(module))


def _rebuilt(step: _Step, family: Any, shape: ModelShape, report: CompareReport) -> dict[str, Any]:
    """transformers module -> {key: tensor of the step's rows}, or a str saying why it cannot be had."""
    out: dict[str, Any] = {}
    for module in step.scan.listed or sorted(step.scan.files, key=natural):
        tensors = step.tensors(module)
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


def _compare_module(report: CompareReport, step: _Step, module: str, rows: list, where: dict,
                    test: dict[str, torch.Tensor] | str | None) -> None:
    """Rows for one transformers module of one test step: each key, the reference's rows gathered."""
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
    if test is None or isinstance(test, str) or problems:
        missing = _missing(test is None or test == "rank file missing",
                           any(p.endswith(("module missing", "rank file missing")) for p in problems))
        test_note = ["module missing in test"] if test is None else [f"test: {test}"] if isinstance(test, str) else []
        report.rows.append(CompareRow(step.rel, module, 0, None, FAIL, missing=missing,
                                      note="; ".join(test_note + list(dict.fromkeys(problems))[:3])))
        return
    test_rows = [row for row, _ in rows]
    for key in list(ref_keys) + [k for k in test if k not in ref_keys]:
        if key not in test or len(ref_keys.get(key, [])) != len(rows):
            side = "test" if key not in test else "ref"
            report.rows.append(CompareRow(step.rel, module, 0, key, FAIL, missing=side, note=f"key missing in {side}"))
            continue
        want = torch.stack(ref_keys[key])
        got = test[key][test_rows] if test[key].dim() else test[key]
        report.rows.append(compare_tensors(step.rel, module, 0, key, want, got, report.rtol, report.atol))


def _missing(in_test: bool, in_ref: bool) -> str | None:
    return "both" if in_test and in_ref else "test" if in_test else "ref" if in_ref else None


def _unmatched(report: CompareReport, ref_steps: list[_Step], seen: set) -> None:
    """FAIL rows for reference tokens no test step held."""
    for step in ref_steps:
        lost = [tok for tok in step.tokens if tok is not None and tok not in seen]
        if lost:
            report.rows.append(CompareRow(step.rel, "", None, None, FAIL, missing="test",
                                          note=f"{len(lost)} token(s) of ref missing in test: {_fmt_tokens(lost)}"))

