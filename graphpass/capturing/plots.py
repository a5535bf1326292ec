"""Deprecated alias of :mod:`graphpass.comparing.plots` (compare moved to its own package,
``graphpass.comparing``): importing this path warns and gives that module itself. Kept for one release."""

import sys
import warnings

from ..comparing import plots as _moved

warnings.warn(
    "graphpass.capturing.plots moved to graphpass.comparing.plots; the old path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
