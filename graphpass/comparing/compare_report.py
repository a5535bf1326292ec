"""The result of :func:`graphpass.compare`: :class:`CompareReport` (rows in execution order, notes)
and :class:`CompareRow` (one compared tensor, or one missing / unreadable thing), with the
``PASS`` / ``FAIL`` statuses and :class:`CompareError`. Shared by the tree walk
(:mod:`compare_runs`), the tensor comparison (:mod:`compare_tensors`) and the shard reassembly
(:mod:`shards`)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from ..atomic_files import write_bytes_atomic
from ..errors import GraphpassError
from .report_format import HEADERS, fmt_value, json_float, printable

PASS, FAIL = "pass", "FAIL"
MISSING_SIDES = ("test", "ref", "both")  # CompareRow.missing: the side(s) that lack the row's item


class CompareError(GraphpassError, ValueError):
    """``compare`` was given a bad argument: a directory that does not exist, a negative tolerance."""


@dataclass
class CompareRow:
    """One compared tensor (or one missing/unreadable thing). Errors are ``None`` when not computable."""

    step: str  # relative path of the step directory, e.g. "dp0/prefill_s8_0"
    module: str
    rank: int | None
    key: str | None
    status: str
    max_abs: float | None = None
    rel_l2: float | None = None
    rel_linf: float | None = None
    note: str = ""
    missing: str | None = None  # "test", "ref" or "both": the item is missing there (always a FAIL row)

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def to_dict(self) -> dict[str, Any]:
        return {k: json_float(v) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def where(self) -> str:
        parts = [f"step {self.step}"]
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.key is not None:
            parts.append(f"key {self.key}")
        return ", ".join(parts)


@dataclass
class CompareReport:
    """The result of :func:`compare`: rows in execution order, plus step-level notes."""

    ref_dir: str
    test_dir: str
    rtol: float
    atol: float
    rows: list[CompareRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def first_failure(self) -> CompareRow | None:
        """The first failing row in execution order; but a module returns after its submodules, so where a
        submodule of the same step and rank fails too, that one diverged first, whatever order a meta listed
        them in (a reference's meta lists a decoder layer before its own projections)."""
        first = next((row for row in self.rows if not row.passed), None)
        while first is not None and first.module:
            inner = next(
                (
                    r
                    for r in self.rows
                    if not r.passed
                    and r.step == first.step
                    and r.rank == first.rank
                    and r.module
                    and r.module.startswith(first.module + ".")
                ),
                None,
            )
            if inner is None:
                break
            first = inner
        return first

    @property
    def passed(self) -> bool:
        """True when at least one tensor was compared and every row passed."""
        return bool(self.rows) and self.first_failure is None

    def table(self) -> str:
        body = [
            [
                r.step,
                r.module,
                "" if r.rank is None else r.rank,
                "" if r.key is None else r.key,
                r.status,
                fmt_value(r.max_abs),
                fmt_value(r.rel_l2),
                fmt_value(r.rel_linf),
                r.note,
            ]
            for r in self.rows
        ]
        return tabulate(body, headers=HEADERS, disable_numparse=True)

    def summary_line(self) -> str:
        if not self.rows:
            return f"nothing compared: no captured steps found in {self.ref_dir} or {self.test_dir}"
        bad = self.first_failure
        if bad is None:
            return f"all {len(self.rows)} tensors match (rtol={self.rtol:g}, atol={self.atol:g})"
        what = f"max abs {bad.max_abs:.2e}" if bad.max_abs is not None else ""
        if bad.note:
            what = f"{what}; {bad.note}" if what else bad.note
        n_fail = sum(not r.passed for r in self.rows)
        missing = self.missing_counts()
        lost = "".join(f"; {n} missing in {side}" for side, n in missing.items() if n)
        return (
            f"{n_fail} of {len(self.rows)} rows FAIL (rtol={self.rtol:g}, atol={self.atol:g}{lost})\n"
            f"first diverging module: {bad.module or '<step>'} ({bad.where()}): {what}"
        )

    def missing_counts(self) -> dict[str, int]:
        """How many rows name something missing in the test run, in the ref run, in both."""
        return {side: sum(r.missing == side for r in self.rows) for side in MISSING_SIDES}

    def __str__(self) -> str:
        parts = [self.table()] if self.rows else []
        parts += [f"note: {n}" for n in self.notes]
        parts.append(self.summary_line())
        return printable("\n".join(parts))

    def to_dict(self) -> dict[str, Any]:
        n_pass = sum(r.passed for r in self.rows)
        first = self.first_failure
        return {
            "ref_dir": self.ref_dir,
            "test_dir": self.test_dir,
            "rtol": self.rtol,
            "atol": self.atol,
            "passed": self.passed,
            "counts": {
                "total": len(self.rows),
                "pass": n_pass,
                "fail": len(self.rows) - n_pass,
                **{f"missing_in_{side}": n for side, n in self.missing_counts().items()},
            },
            "first_failure": first.to_dict() if first is not None else None,
            "summary": self.summary_line(),
            "notes": list(self.notes),
            "rows": [r.to_dict() for r in self.rows],
        }

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_dict` to ``path`` atomically (temp file in the same directory + ``os.replace``)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        write_bytes_atomic(target, text.encode("utf-8"))
        return target

    def plot(self, path: str | os.PathLike[str], **kwargs: Any) -> Path:
        """The divergence plot as a PNG (``graphpass.comparing.plots.plot_report``; needs ``graphpass[plot]``)."""
        from .plots import plot_report

        return plot_report(self, path, **kwargs)

    def to_html(self, path: str | os.PathLike[str], **kwargs: Any) -> Path:
        """One self-contained HTML page: table, plot, meta of both runs (``graphpass.comparing.plots.write_html``)."""
        from .plots import write_html

        return write_html(self, path, **kwargs)
