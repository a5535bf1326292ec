"""The XLA leg (make test-xla): graphpass through torch_xla's real XLA compiler on the CPU.

Every module here starts with ``pytest.importorskip("torch_xla")``, so on the main leg (no torch_xla)
they are skipped with that reason. torch_xla runs on the CPU with ``PJRT_DEVICE=CPU`` (set here
unless the caller chose a device).

``import torch_xla`` turns Dynamo's automatic dynamic shapes off for the whole process. These tests
run under that setting, as a torch_xla user's process does; the import happens here, once, and the
setting is put back for the rest of the session after it (in case the main suite runs in the same
process), then set as torch_xla leaves it around each test of this folder.
"""

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

try:
    import torch._dynamo.config as _dynamo_config

    _before = _dynamo_config.get_config_copy()
    import torch_xla  # noqa: F401

    AS_TORCH_XLA_LEAVES = {k: v for k, v in _dynamo_config.get_config_copy().items() if _before.get(k) != v}
    _dynamo_config.load_config(_before)
except ImportError:
    AS_TORCH_XLA_LEAVES = None


@pytest.fixture(autouse=True)
def _dynamo_as_torch_xla_leaves_it():
    """Dynamo's settings as `import torch_xla` left them (automatic_dynamic_shapes=False, ...)."""
    if AS_TORCH_XLA_LEAVES is None:
        yield
        return
    import torch

    with torch._dynamo.config.patch(AS_TORCH_XLA_LEAVES):
        yield


@pytest.fixture
def xla_device():
    import torch_xla

    return torch_xla.device()


@pytest.fixture
def xla_compiles():
    """``xla_compiles()``: the number of XLA compilations so far in this process (torch_xla's
    ``CompileTime`` metric: one sample per computation compiled; cache hits are ``CachedCompile``)."""
    import torch_xla.debug.metrics as met

    def count() -> int:
        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    return count
