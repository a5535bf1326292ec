"""Deprecated alias of :mod:`graphpass.comparing.compare_runs` (compare moved to its own package,
``graphpass.comparing``): importing this path warns and gives that module itself. Kept for one release."""

import sys
import warnings

from ..comparing import compare_runs as _moved

warnings.warn(
    "graphpass.capturing.compare_runs moved to graphpass.comparing.compare_runs; "
    "the old path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
