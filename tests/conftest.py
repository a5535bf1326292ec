import pytest
import torch

import graphpass  # noqa: F401  (registers graphpass ops)
from helpers import CountingBackend, StrictAtenBackend, register_temp_backend


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def counting():
    return CountingBackend()


@pytest.fixture
def strict_backend(monkeypatch):
    """A StrictAtenBackend registered with Dynamo under a test-only name (removed afterwards)."""
    return register_temp_backend(monkeypatch, "strict_aten_standin", StrictAtenBackend())
