"""graphpass graph passes, one a file. The order they run in is ``graphpass.pipeline.PIPELINE``."""

from .base import GraphPass, PassContext

__all__ = ["GraphPass", "PassContext"]
