"""Deprecated alias of :mod:`graphpass.comparing.compare_tensors` (compare moved to its own package,
``graphpass.comparing``): importing this path warns and gives that module itself. Kept for one release."""

import sys
import warnings

from ..comparing import compare_tensors as _moved

warnings.warn(
    "graphpass.capturing.compare_tensors moved to graphpass.comparing.compare_tensors; "
    "the old path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
