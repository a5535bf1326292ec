"""Why a refusal may come from a library release rather than from the model: what the padding proof says when the
code it trusts by digest has changed, or when the refused op sits in a transformers release it was not checked on.

The proof trusts some library functions as a whole, by source digest (:data:`..causal_functions.CAUSAL_FUNCTIONS`,
:data:`.tables.ROW_WISE_FUNCTIONS`). Another transformers release may edit one: the digest no longer matches, the
function is checked op by op, and the refusal would name some inner op (a ``cumsum``, a ``tensor_split``), never the
cause. :func:`drift_note` adds the cause to a violation's reason: which function changed, in which transformers
version, against which the digests were recorded, and what to do.
"""

from __future__ import annotations

import functools

import torch

from ...fx_utils import ran_inside_file
from ..causal_functions import CAUSAL_FUNCTIONS, source_digest
from .tables import ROW_WISE_FUNCTIONS

__all__ = ["CHECKED_TRANSFORMERS", "drift_note"]

#: The transformers releases whose code the pinned digests were recorded or re-checked against (make
#: test-transformers-next runs the static families on the newest release: add it here when they pass).
CHECKED_TRANSFORMERS = ("5.24.0", "5.25.0")


@functools.lru_cache(maxsize=None)
def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return getattr(transformers, "__version__", None)


def _pins():
    for name, fn in CAUSAL_FUNCTIONS.items():
        for suffix in fn.files:
            yield suffix, name, fn.helpers, fn.digest
    for (suffix, name), fn in ROW_WISE_FUNCTIONS.items():
        yield suffix, name, fn.helpers, fn.digest


def _changed_pin(node: torch.fx.Node) -> tuple[str, str] | None:
    """(function, file suffix) of a pinned function ``node`` ran inside whose installed source has another digest."""
    for suffix, name, helpers, digest in _pins():
        path = ran_inside_file(node, suffix, name)
        if path is not None and source_digest(path, name, helpers) != digest:
            return name, suffix
    return None


def drift_note(node: torch.fx.Node) -> str | None:
    """Why the refusal at ``node`` may be a library release's doing, or None."""
    version = _transformers_version()
    changed = _changed_pin(node)
    if changed is not None:
        name, suffix = changed
        if suffix.startswith("transformers/"):
            where = f"transformers {version}" if version else "the installed transformers"
            return (
                f"{name} ({suffix}) in {where} is not the code graphpass proved (its digests were recorded "
                f"against transformers {', '.join(CHECKED_TRANSFORMERS)}), so this proof no longer applies "
                f"and it is checked op by op: pin transformers=={CHECKED_TRANSFORMERS[-1]}, or update graphpass "
                f"(a new release re-checks the function and records its digest)"
            )
        return (
            f"{name} ({suffix}) is not the code graphpass proved (another release or an edited copy): it is "
            "checked op by op"
        )
    trace = (node.meta.get("stack_trace") or "").replace("\\", "/")
    if version and version not in CHECKED_TRANSFORMERS and "/transformers/models/" in trace:
        return (
            f"transformers {version} is not a release this proof was checked on "
            f"({', '.join(CHECKED_TRANSFORMERS)}): if this model bucketed there, the release changed its code; "
            f"pin transformers=={CHECKED_TRANSFORMERS[-1]} or update graphpass"
        )
    return None
