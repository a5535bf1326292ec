"""Deprecated alias of :mod:`graphpass.comparing.compare_report` (compare moved to its own package,
``graphpass.comparing``): importing this path warns and gives that module itself. Kept for one release."""

import sys
import warnings

from ..comparing import compare_report as _moved

warnings.warn(
    "graphpass.capturing.compare_report moved to graphpass.comparing.compare_report; "
    "the old path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
