"""Deprecated alias of :mod:`graphpass.comparing.completeness` (compare moved to its own package,
``graphpass.comparing``): importing this path warns and gives that module itself. Kept for one release."""

import sys
import warnings

from ..comparing import completeness as _moved

warnings.warn(
    "graphpass.capturing.completeness moved to graphpass.comparing.completeness; "
    "the old path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
