"""The on-disk format of captures (docs/capture.md, "On disk"): the one place its names are defined.

Shared by the packages that meet only in it: ``capturing/`` writes steps, ``comparing/`` reads
them, and the engines that capture through ``ModelCapture`` add their own fields
(``integrations/vllm``: one step per engine step; ``reference.py``: ``graphpass reference``). So it
lives at the top level (a feature package never imports another) and imports nothing of graphpass
but the errors, and not torch (the capture writer process plans steps without torch).

* The layout: ``capture_dir/[subdirectory/]dp{d}/{step}/{module}/rank{r}.safetensors`` and the
  step's meta files ``{step}_meta.json`` (tensor-parallel rank 0), ``{step}_meta.rank{r}.json``
  (rank r > 0): :func:`dp_folder`, :func:`rank_file_name`, :func:`meta_file_name` and their
  readers.
* The step meta's keys (constants below, one definition each) and :func:`read_step_meta`, which
  merges a step's meta files.
* An engine step's fields (:class:`EngineStepMeta`): which request and position each tensor row
  is, the model's shape, the engine's name.
* The format version: every meta file written now holds ``format_version``
  (:data:`FORMAT_VERSION`); a meta without one was written before the field existed and is read as
  version 1. A reader that meets a version it does not read refuses it
  (:class:`FormatVersionError`, which ``compare`` raises as its ``CompareError``).
"""

from __future__ import annotations

import json
import numbers
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from .errors import GraphpassError

# --- the version ----------------------------------------------------------------------------------

FORMAT_VERSION = 1  # what capture writes now
READ_VERSIONS = (1,)  # what compare reads
UNVERSIONED = 1  # a meta without the field: written before it existed (the format was then version 1)
FORMAT_VERSION_KEY = "format_version"


class FormatVersionError(GraphpassError):
    """A meta file holds a format version this graphpass does not read (a newer graphpass wrote it)."""


def format_version(doc: Mapping[str, Any], where: str | os.PathLike[str]) -> int:
    """The format version of the meta ``doc`` read from ``where``: its ``format_version``, or
    :data:`UNVERSIONED` without one. Raises :class:`FormatVersionError` naming the file, the version
    found and the versions this graphpass reads when it is not one of :data:`READ_VERSIONS`."""
    if FORMAT_VERSION_KEY not in doc:
        return UNVERSIONED
    found = doc[FORMAT_VERSION_KEY]
    if isinstance(found, bool) or not isinstance(found, numbers.Integral) or int(found) not in READ_VERSIONS:
        raise FormatVersionError(
            f"{os.fspath(where)}: capture format version {found!r}, but this graphpass reads format version(s) "
            f"{', '.join(map(str, READ_VERSIONS))} (a meta without {FORMAT_VERSION_KEY!r} is version {UNVERSIONED}): "
            "compare with the graphpass that wrote the capture, or a newer one"
        )
    return int(found)


# --- the step meta's keys -------------------------------------------------------------------------

# what the capture writes in every step's meta (capturing/model_capture.py, step_files.plan_step)
REQ_IDS, POSITIONS, RUN = "req_ids", "positions", "run"
GRAPHPASS_VERSION, TORCH_VERSION = "graphpass_version", "torch_version"
BUCKET, DROPPED_STEPS = "bucket", "dropped_steps"
STEP, STEP_INDEX, PHASE, SIZE = "step", "step_index", "phase", "size"
MODULES, TENSORS = "modules", "tensors"  # module order (execution order); per module its tensor entries
DP_RANK, TP_RANK, TP_SIZE = "dp_rank", "tp_rank", "tp_size"
PREFILL, DECODE = "prefill", "decode"  # the values of PHASE
# the fields graphpass itself writes: a caller's extra_meta cannot replace them
OWN_META = (
    REQ_IDS,
    POSITIONS,
    RUN,
    GRAPHPASS_VERSION,
    TORCH_VERSION,
    BUCKET,
    STEP,
    STEP_INDEX,
    PHASE,
    SIZE,
    MODULES,
    TENSORS,
    DP_RANK,
    TP_RANK,
    TP_SIZE,
    FORMAT_VERSION_KEY,
)
# one tensor entry of TENSORS[module]: its key in the module's output, dtype, (local) shape and, for a
# DTensor shard, its layout (placements, global shape and offset, ...)
KEY, DTYPE, SHAPE = "key", "dtype", "shape"
GLOBAL_SHAPE, GLOBAL_OFFSET, PLACEMENTS = "global_shape", "global_offset", "placements"
# what read_step_meta adds when it merges a step's meta files
RANKS, RANK_TENSORS = "ranks", "rank_tensors"

MAX_TP_SIZE = 1 << 16  # tensor-parallel ranks compare expects at most (a larger tp_size in a meta is ignored)

# --- the layout -----------------------------------------------------------------------------------

RANK_FILE = re.compile(r"rank([0-9]+)\.safetensors")  # always fullmatch
DP_FOLDER = re.compile(r"dp[0-9]+")  # always fullmatch
_RANK_META = re.compile(r"(.+)_meta\.rank([0-9]+)\.json")


def dp_folder(dp_rank: int) -> str:
    """The folder of data-parallel rank ``dp_rank``'s steps: ``dp{d}``."""
    return f"dp{dp_rank}"


def rank_file_name(tp_rank: int) -> str:
    """A module's file of tensor-parallel rank ``tp_rank`` in a step: ``rank{r}.safetensors``."""
    return f"rank{tp_rank}.safetensors"


def rank_file_rank(name: str) -> int | None:
    """The tensor-parallel rank whose module file ``name`` is, or None."""
    m = RANK_FILE.fullmatch(name)
    return int(m.group(1)) if m is not None else None


def meta_file_name(step: str, tp_rank: int) -> str:
    """Each tensor-parallel rank writes its own meta file (no rank overwrites another's):
    ``{step}_meta.json`` for rank 0, ``{step}_meta.rank{t}.json`` for the others."""
    return f"{step}_meta.json" if tp_rank == 0 else f"{step}_meta.rank{tp_rank}.json"


def meta_file_rank(step: str, name: str) -> int | None:
    """The tensor-parallel rank whose meta file ``name`` is in step folder ``step``, or None."""
    if name == f"{step}_meta.json":
        return 0
    m = _RANK_META.fullmatch(name)
    return int(m.group(2)) if m is not None and m.group(1) == step else None


def read_step_meta(step_dir: str | os.PathLike) -> dict:
    """The step's meta, merged from every rank's meta file: the lowest rank's fields, ``ranks``
    (every tensor-parallel rank that wrote, sorted), ``modules`` (all ranks', in order of first
    appearance), ``tensors`` (per module, the lowest rank's entries) and ``rank_tensors``
    (rank -> that rank's ``tensors``). Raises FileNotFoundError without any meta file, OSError /
    ValueError for an unreadable one (naming it), :class:`FormatVersionError` for a meta file of a
    format version this graphpass does not read (naming it)."""
    step_dir = Path(step_dir)
    docs: dict[int, dict] = {}
    for name in sorted(os.listdir(step_dir)):
        rank = meta_file_rank(step_dir.name, name)
        if rank is None:
            continue
        try:
            doc = json.loads((step_dir / name).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if isinstance(doc, dict):
            format_version(doc, step_dir / name)
        if not isinstance(doc, dict) or not isinstance(doc.get(MODULES), list):
            raise ValueError(f"{name}: no 'modules' list")
        docs[rank] = doc
    if not docs:
        raise FileNotFoundError(f"no meta file in {step_dir}")
    merged = dict(docs[min(docs)])
    merged[RANKS] = sorted(docs)
    merged[MODULES] = list(dict.fromkeys(m for r in sorted(docs) for m in docs[r][MODULES]))
    merged[RANK_TENSORS] = {r: docs[r].get(TENSORS) or {} for r in sorted(docs)}
    tensors: dict = {}
    for r in sorted(docs, reverse=True):
        tensors.update(docs[r].get(TENSORS) or {})
    merged[TENSORS] = tensors
    return merged


# --- an engine's steps ----------------------------------------------------------------------------

ENGINE, TOKEN_REQUEST, INPUT_IDS, MODEL = "engine", "token_request", "input_ids", "model"
PREFIX_CACHED, PARENTS = "prefix_cached", "parents"  # per request, in REQ_IDS order (vLLM)
DRAFT_PASS, TARGET_STEP_INDEX = "draft_pass", "target_step_index"  # a draft model's step (vLLM)
REFERENCE_ENGINE = "transformers"  # `graphpass reference`
VLLM_ENGINE = "vllm"  # graphpass's vLLM plugin
DEFAULT_ENGINE = VLLM_ENGINE  # the engine of an engine step's meta written without ENGINE (the first engine)
# what each tensor-parallel rank's meta of one engine step must agree on
ROW_FIELDS = (REQ_IDS, POSITIONS, TOKEN_REQUEST, INPUT_IDS)


@dataclass(frozen=True)
class EngineStepMeta:
    """The fields an engine adds to a step's meta (``extra_meta``; ``req_ids`` and ``positions`` are
    the capture's own): per tensor row the index of its request (``token_request``, -1: padding),
    the token fed (``input_ids``), the engine's name and the model's shape (``model``:
    :meth:`graphpass.model_shape.ModelShape.to_meta`); per request what vLLM served from its prefix
    cache and the parallel-sampling parent; for a draft model's step its pass and target step.
    Fields that are None are not written. :meth:`from_dict` reads them back as written, unchecked
    (a meta may be damaged: ``compare`` checks each where it reads it)."""

    engine: str
    token_request: list
    model: dict | None = None
    input_ids: list | None = None
    prefix_cached: list | None = None
    parents: list | None = None
    draft_pass: int | None = None
    target_step_index: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "EngineStepMeta":
        """The engine fields of a step's meta; an engine step's meta without ``engine`` is
        :data:`DEFAULT_ENGINE`'s (written before other engines)."""
        engine = doc.get(ENGINE)
        return cls(
            engine if isinstance(engine, str) else DEFAULT_ENGINE,
            doc.get(TOKEN_REQUEST),
            **{f.name: doc.get(f.name) for f in fields(cls)[2:]},
        )
