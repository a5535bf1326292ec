import logging

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


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    """The suite's one fork server (tests/forkserver.py), one per test module: its children are forked from a
    process that imported torch and graphpass once (tests/capturing/test_capture_async.py,
    tests/offloading/test_faults_offload.py, tests/goldens/test_golden_plugin.py)."""
    from forkserver import ForkServer

    server = ForkServer(tmp_path_factory.mktemp("forks"))
    yield server
    server.close()


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
        raise pytest.UsageError(
            "test ids built from an object's address (give the parametrization ids=): " + ", ".join(unstable[:5])
        )


# pytest (9.x) attaches its log-capture handlers to every non-propagating logger, torch's structured
# trace ("torch.__trace") included, for each setup, call and teardown. torch builds a structured-trace
# payload (every graph Dynamo, AOT autograd and graphpass make, printed as text) whenever that logger
# has any handler, so under pytest each compile paid for printing graphs nobody reads. These wrappers
# run inside pytest's (trylast: innermost) and take its handlers off that one logger; torch's own
# handler (TORCH_TRACE) is left alone, and tests that read the trace run it in a child process.
_TORCH_TRACE_LOG = logging.getLogger("torch.__trace")


def _pytest_off_torch_trace() -> None:
    for handler in list(_TORCH_TRACE_LOG.handlers):
        if type(handler).__module__.startswith("_pytest."):
            _TORCH_TRACE_LOG.removeHandler(handler)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item):
    _pytest_off_torch_trace()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item):
    _pytest_off_torch_trace()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    _pytest_off_torch_trace()
    return (yield)
