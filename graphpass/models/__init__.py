"""Small bundled models: the demo transformer and the golden-graph corpus (random weights)."""

from .corpus import CORPUS, build
from .transformer import TinyTransformer, TransformerConfig

__all__ = ["CORPUS", "build", "TinyTransformer", "TransformerConfig"]
