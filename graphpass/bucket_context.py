"""The static-shape bucket the current call runs: the per-call bucket context of the
``static_shapes`` feature.

:class:`graphpass.static_shapes.BucketDispatcher` is its only writer: it enters
:func:`running_bucket` for the duration of one bucket graph's call. The capture op
(``graphpass/capturing/ops.py``) is its only reader: :func:`current_bucket` names a capture step
after the bucket its tensors have.

Why it lives here and not in ``graphpass/static_shapes/``: the bucket belongs to static shapes, but
capturing reads it, and a feature package never imports another (docs/architecture.md, "Packages
and what each may import"; ``tests/core/test_import_rules.py``). State two features share lives at
the top level, in a module that imports nothing of graphpass. The only state is the ``ContextVar``
(one value per thread / task, reset when the call returns); nothing else is kept.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_CURRENT_BUCKET: contextvars.ContextVar[int | None] = contextvars.ContextVar("graphpass_bucket", default=None)


def current_bucket() -> int | None:
    """The bucket size of the static-shape graph running now in this thread / task; None outside one."""
    return _CURRENT_BUCKET.get()


@contextlib.contextmanager
def running_bucket(size: int) -> Iterator[None]:
    """Mark ``size`` as the running bucket until the block exits (the previous value is restored,
    also when the block raises). Entered by the bucket dispatcher only."""
    token = _CURRENT_BUCKET.set(size)
    try:
        yield
    finally:
        _CURRENT_BUCKET.reset(token)
