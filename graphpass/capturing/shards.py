"""Deprecated alias of :mod:`graphpass.comparing.shards` (compare moved to its own package,
``graphpass.comparing``): importing this path warns and gives that module itself. Kept for one release."""

import sys
import warnings

from ..comparing import shards as _moved

warnings.warn(
    "graphpass.capturing.shards moved to graphpass.comparing.shards; the old path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
