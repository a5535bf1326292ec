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


def pytest_collection_modifyitems(config, items):
    """Test ids must be the same in every process (make test runs pytest-xdist workers, which
    compare what they collected): an id built from an object's repr (``<function f at 0x...>``)
    differs per process, so it is refused here, naming the test."""
    import re

    unstable = [item.nodeid for item in items if re.search(r" at 0x[0-9a-f]+|object at ", item.nodeid)]
    if unstable:
        raise pytest.UsageError("test ids built from an object's address (give the parametrization ids=): "
                                + ", ".join(unstable[:5]))
