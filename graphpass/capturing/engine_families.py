"""Deprecated alias of :mod:`graphpass.comparing.engine_families` (compare moved to its own package,
``graphpass.comparing``): importing this path warns and gives that module itself. Kept for one release."""

import sys
import warnings

from ..comparing import engine_families as _moved

warnings.warn(
    "graphpass.capturing.engine_families moved to graphpass.comparing.engine_families; "
    "the old path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
