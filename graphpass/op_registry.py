"""``register_all``: every graphpass custom op registered, whatever was imported first.

Each feature keeps its ops in one module (the trap ops in :mod:`graphpass.ops`,
``graphpass.capturing.ops``, ``graphpass.offloading.ops``) that defines them in a
``torch.library.Library("graphpass", "FRAGMENT")`` when imported; code that inserts or matches an
op imports it from there. This module imports all of them and nothing imports it back but the
package's ``__init__``, so the op modules stay free of import circles.
"""

from __future__ import annotations

from . import ops as _trap_ops  # noqa: F401
from .capturing import ops as _capture_ops  # noqa: F401
from .offloading import ops as _offload_ops  # noqa: F401


def register_all() -> None:
    """Register every graphpass custom op. Idempotent: importing this module already did."""
