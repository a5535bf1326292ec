"""What ``compare`` requires each side to hold, and the order it walks the steps in.

The completeness contract (docs/capture.md, "What compare requires"): every step, module, rank and
key of either run must be in the other, and every rank a run had must be in every one of its
steps; whatever is missing is a ``FAIL`` row that names it. This module answers the questions the
contract asks of the files; :mod:`graphpass.comparing.compare_runs` writes the rows.

* :class:`StepScan` reads one side's step folder once: its meta (merged over the ranks' meta
  files, or why there is none), its module folders and each module's ``rank{r}.safetensors`` files.
* :func:`run_ranks`: the tensor-parallel ranks a run had, per tree (the ``dp{d}`` folder a step is
  in): every rank with a file or a meta file in any of its steps, and ``0 .. tp_size-1`` where a
  meta records ``tp_size`` (:class:`graphpass.capturing.writer.CaptureWriter`).
* :func:`execution_order`: the steps in the order they ran, by the ``step_index`` the writer
  records (a counter over all of a ``ModelCapture``'s steps, whatever their phase). Captures
  without one are ordered by their counter ``k`` (``prefill_s8_0``, ``decode_b1_0``), a prefill
  before a decode of the same ``k``; a note says so.
"""

from __future__ import annotations

import numbers
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..capture_format import (
    DP_FOLDER,
    KEY,
    MAX_TP_SIZE,
    MODULES,
    RANK_TENSORS,
    RUN,
    STEP_INDEX,
    TENSORS,
    TP_SIZE,
    FormatVersionError,
    rank_file_rank,
    read_step_meta,
)
from .compare_report import CompareError

__all__ = ["StepScan", "execution_order", "fmt_ranks", "run_ranks", "tree_of"]

_STEP_K_RE = re.compile(r"(prefill|decode)?.*_([0-9]+)")


def find_steps(root: Path) -> set[str]:
    """Relative paths (posix) of every step directory: the children of each ``dp{d}`` directory."""
    steps: set[str] = set()
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        name = here.resolve().name if here == root else here.name  # ref_dir may itself be a dp dir
        if DP_FOLDER.fullmatch(name):
            steps.update((here / d).relative_to(root).as_posix() for d in dirnames)
            dirnames[:] = []  # a dp directory's children are steps: do not descend further
    return steps


def runs_of(scans: Mapping[str, "StepScan"]) -> dict[str, dict[str, int]]:
    """Per top folder of the steps (``dp0``, ``draft/dp0``): run id -> how many steps of that run it holds (the
    meta's ``run``; ``"?"`` for a meta without one, written before runs were named)."""
    out: dict[str, dict[str, int]] = {}
    for rel, scan in scans.items():
        if scan.meta is None:
            continue
        run = scan.meta.get(RUN)
        folder = rel.rsplit("/", 1)[0]
        counts = out.setdefault(folder, {})
        key = run if isinstance(run, str) else "?"
        counts[key] = counts.get(key, 0) + 1
    return out


def check_one_run(scans: Mapping[str, "StepScan"], name: str, root: Path) -> None:
    """A :class:`CompareError` when one of ``root``'s step folders holds the steps of more than one run: two
    runs captured into the same ``capture_dir`` (their steps would be compared as one run's)."""
    for folder, counts in sorted(runs_of(scans).items()):
        named = [r for r in counts if r != "?"]
        if len(counts) > 1 and named:
            found = ", ".join(
                f"run {r}: {n} step(s)" if r != "?" else f"{n} step(s) of a run with no id"
                for r, n in sorted(counts.items())
            )
            raise CompareError(
                f"{name} {root}: {folder} holds the steps of {len(counts)} runs ({found}): two runs "
                "were captured into one capture_dir; capture each run into a folder of its own"
            )


_PHASES = {"prefill": 0, "decode": 1}


def natural(text: str) -> tuple:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", text) if p)


def _count(value: Any, low: int = 0, high: int | None = None) -> int | None:
    """``value`` if it is a non-bool int in [low, high], else None (a meta field may be tampered with)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    value = int(value)
    return value if value >= low and (high is None or value <= high) else None


def rank_files(module_dir: Path) -> dict[int, Path]:
    """rank -> its ``rank{r}.safetensors`` file in ``module_dir``."""
    found = {}
    for f in module_dir.iterdir():
        rank = rank_file_rank(f.name)
        if rank is not None and f.is_file():
            found[rank] = f
    return found


@dataclass
class StepScan:
    """One side's step folder, read once (see the module docstring)."""

    dir: Path
    meta: dict | None = None
    meta_problem: str = ""  # why ``meta`` is None: "no meta file" or "unreadable meta file (...)"
    files: dict[str, dict[int, Path]] = field(default_factory=dict)  # module folder -> rank -> file

    @classmethod
    def read(cls, step_dir: Path) -> "StepScan":
        scan = cls(step_dir)
        try:
            meta = read_step_meta(step_dir)
            if not all(isinstance(m, str) for m in meta[MODULES]):
                raise ValueError("no 'modules' list")
            scan.meta = meta
        except FormatVersionError as exc:  # a newer graphpass's capture: refused, not read as a damaged one
            raise CompareError(str(exc)) from None
        except FileNotFoundError:
            scan.meta_problem = "no meta file"
        except (OSError, ValueError) as exc:
            scan.meta_problem = f"unreadable meta file ({exc})"
        for d in step_dir.iterdir():
            if d.is_dir() and not d.name.startswith("."):
                scan.files[d.name] = rank_files(d)
        return scan

    @property
    def listed(self) -> list[str] | None:
        """The modules the meta lists (execution order), None without a readable meta."""
        return None if self.meta is None else list(dict.fromkeys(self.meta[MODULES]))

    def _rank_tensors(self) -> dict[int, dict]:
        per_rank = (self.meta or {}).get(RANK_TENSORS) or {}
        return {r: docs for r, docs in per_rank.items() if isinstance(docs, dict)}

    @property
    def ranks(self) -> set[int]:
        """Every rank this step holds anything of: a meta file of its own or a rank file."""
        return set(self._rank_tensors()) | {r for ranks in self.files.values() for r in ranks}

    def expected_ranks(self, module: str) -> set[int]:
        """The ranks that must hold ``module``: those of the step whose own meta file lists it, and
        those without a meta file of their own (captures from before per-rank meta files)."""
        own = self._rank_tensors()
        return {r for r in self.ranks if r not in own or module in own[r]}

    def layouts(self, module: str) -> dict[int, dict[str, dict]]:
        """rank -> key -> the meta entry of ``module``'s tensor (its layout, for a DTensor shard)."""
        out = {}
        for r, docs in self._rank_tensors().items():
            entries = docs.get(module)
            entries = entries if isinstance(entries, list) else []
            out[r] = {str(e[KEY]): e for e in entries if isinstance(e, dict) and KEY in e}
        return out

    def key_order(self, module: str) -> list[str]:
        """``module``'s keys in the order the meta lists them (output order), or []."""
        entries = ((self.meta or {}).get(TENSORS) or {}).get(module)
        if not isinstance(entries, list):
            return []
        return [str(e[KEY]) for e in entries if isinstance(e, dict) and KEY in e]

    @property
    def step_index(self) -> int | None:
        return _count((self.meta or {}).get(STEP_INDEX))

    @property
    def tp_size(self) -> int | None:
        return _count((self.meta or {}).get(TP_SIZE), 1, MAX_TP_SIZE)


def tree_of(rel: str) -> str:
    """The tree (``dp{d}`` folder, relative) step ``rel`` is in."""
    return rel.rpartition("/")[0]


def run_ranks(scans: dict[str, StepScan]) -> dict[str, set[int]]:
    """tree -> every tensor-parallel rank the run had there (see the module docstring)."""
    out: dict[str, set[int]] = {}
    for rel, scan in scans.items():
        ranks = out.setdefault(tree_of(rel), set())
        ranks |= scan.ranks
        if scan.tp_size is not None:
            ranks |= set(range(scan.tp_size))
    return out


def fmt_ranks(ranks: set[int] | list[int]) -> str:
    """``0-3, 5``: sorted ranks with runs collapsed."""
    parts, items = [], sorted(ranks)
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ", ".join(parts)


def _fallback_key(name: str) -> tuple:
    m = _STEP_K_RE.fullmatch(name)
    if m is None:
        return (2, 0, 0, natural(name))
    return (1, int(m.group(2)), _PHASES.get(m.group(1), 2), natural(name))


def execution_order(
    steps: set[str], ref: dict[str, StepScan], test: dict[str, StepScan]
) -> tuple[list[str], list[str]]:
    """(steps in execution order, notes). Trees in natural order; in each, by ``step_index`` (the
    ref's, the test's for a step only the test has), then the steps without one (see the module
    docstring). Notes: steps ordered without an index, steps the two runs ran in another order."""
    keys: dict[str, tuple] = {}
    unindexed: list[str] = []
    disagree: list[tuple[str, int, int]] = []
    for rel in steps:
        r, t = (ref[rel].step_index if rel in ref else None), (test[rel].step_index if rel in test else None)
        index = r if r is not None else t
        name = rel.rpartition("/")[2]
        keys[rel] = (
            tuple(natural(p) for p in tree_of(rel).split("/")),
            (0, index, 0, natural(name)) if index is not None else _fallback_key(name),
        )
        if index is None:
            unindexed.append(rel)
        elif r is not None and t is not None and r != t:
            disagree.append((rel, r, t))
    notes = []
    per_tree = Counter(tree_of(rel) for rel in steps)
    unindexed = [rel for rel in unindexed if per_tree[tree_of(rel)] > 1]  # a tree's only step needs no order
    if unindexed:
        notes.append(
            f"{len(unindexed)} step(s) have no step_index in their meta (captured before graphpass "
            "recorded one, or no meta file): ordered by their counter k, a prefill before a decode of the "
            "same k, after the steps with an index; that is the order one generate() runs them in, not "
            "several: capture both runs again for the exact order"
        )
    if disagree:
        disagree.sort(key=lambda d: keys[d[0]])
        shown = "; ".join(f"{rel} (ref {r}, test {t})" for rel, r, t in disagree[:5])
        notes.append(
            "the two runs ran steps in another order (step_index differs: "
            + shown
            + (f" and {len(disagree) - 5} more" if len(disagree) > 5 else "")
            + "): steps are compared by name, in the ref's order"
        )
    return sorted(steps, key=keys.__getitem__), notes
