"""Deprecated alias of :mod:`graphpass.comparing.report_format` (compare moved to its own package,
``graphpass.comparing``): importing this path warns and gives that module itself. Kept for one release."""

import sys
import warnings

from ..comparing import report_format as _moved

warnings.warn(
    "graphpass.capturing.report_format moved to graphpass.comparing.report_format; "
    "the old path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
