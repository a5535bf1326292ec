"""The package version (one place: ``pyproject.toml`` holds the same string; ``graphpass.__version__``)."""

__version__ = "0.1.0"
