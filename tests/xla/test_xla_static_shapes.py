"""static_shapes through torch_xla's real XLA compiler: one XLA compilation per bucket, counted with
torch_xla's metrics, no per-length glue compiles, and no silent loss of bucketing under the Dynamo
setting `import torch_xla` leaves.

How the counts work: torch_xla compiles one XLA computation per distinct graph and shapes (its
``CompileTime`` metric gets one sample per compilation; a computation it already compiled in this
process costs none). Any tensor
operation outside a compiled graph on an XLA tensor (a copy into a padded buffer, a slice of an
output) is itself traced lazily and compiled for its exact shapes the first time its result is
needed, so it would cost compilations per distinct length. graphpass pads inputs and slices outputs
on the host for XLA tensors (transfers compile nothing), so the only compilations are the bucket
graphs': with ``dynamic=True`` Dynamo's first graph is already symbolic and there is no exact-size
graph, hence exactly one compilation per bucket used.

torch_xla's compilation cache is process-wide and cannot be cleared: each test uses a batch size of
its own (3, 4, 6, 7; the other modules here use the corpus's batch of 2), so no test reuses a
computation another test compiled. Under dynamic=True none equals a length of the sweep: Dynamo would
give a batch equal to the first length the length's symbol, and that graph is not bucketed.
"""

import copy

import pytest

torch_xla = pytest.importorskip(
    "torch_xla", reason="torch_xla is not installed: the XLA leg (make test-xla) runs these"
)

import torch  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

import graphpass  # noqa: E402
from graphpass.backends import NeuronDelegate, XlaDelegate  # noqa: E402
from graphpass.models.corpus import build  # noqa: E402

BUCKETS = [8, 16, 32]
LENGTHS = [5, 9, 3, 17, 30, 12, 8, 25, 14, 2]  # 10 lengths over the 3 buckets (1 is always a graph of its own)


class CountingXla(XlaDelegate):
    """then="openxla", counting the graphs handed to torch_xla (one per piece per bucket)."""

    def __init__(self) -> None:
        super().__init__("openxla")
        self.calls = 0

    def compile(self, gm, example_inputs):
        self.calls += 1
        return super().compile(gm, example_inputs)


def _sweep(compiled, model, device, batch, lengths=LENGTHS, vocab=64, mark_first=False):
    """Run every length through ``compiled``, checking each against eager on the CPU (padded matmuls:
    XLA blocks the math differently, fp32 rounding; rows never mix). ``mark_first``: mark the first
    call's length dim dynamic (torch._dynamo.mark_dynamic), the fix the refusal names first."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for k, n in enumerate(lengths):
            ids = torch.randint(0, vocab, (batch, n), generator=g)
            on_device = ids.to(device)
            if mark_first and k == 0:
                torch._dynamo.mark_dynamic(on_device, 1)
            out = compiled(on_device)
            assert out.device.type == "xla" and out.shape == (batch, n, vocab)
            torch.testing.assert_close(out.cpu(), model(ids), rtol=1e-5, atol=1e-5)


def _fallbacks() -> dict:
    """torch_xla's counters of ops it ran on the CPU instead of lowering them (``aten::...``)."""
    return {k: met.counter_value(k) for k in met.counter_names() if k.startswith("aten::")}


@pytest.mark.parametrize("how, batch", [("dynamic=True", 4), ("mark_dynamic", 3)])
def test_one_xla_compile_per_bucket(xla_device, xla_compiles, how, batch):
    """10 lengths over 3 buckets cost exactly 3 XLA compilations: the bucket graphs, nothing per length
    (the length is symbolic from the first graph on, so there is no exact-size graph either). Before
    padding moved to the host, the staging copy and the output slice compiled about two more
    computations for every distinct length (23 in all)."""
    model, _ = build("tiny_transformer")
    model.eval()
    on_xla = copy.deepcopy(model).to(xla_device)
    delegate = CountingXla()
    gp = graphpass.backend(then=delegate, traps=[], static_shapes={"dims": {"ids": 1}, "buckets": BUCKETS})
    compiled = torch.compile(on_xla, backend=gp, dynamic=True if how == "dynamic=True" else None)
    before, syncs = xla_compiles(), met.counter_value("DynamoSyncInputExecuteTime") or 0
    _sweep(compiled, model, xla_device, batch=batch, mark_first=how == "mark_dynamic")
    assert xla_compiles() - before == len(BUCKETS) == delegate.calls
    (record,) = gp.graphs
    assert record.runner is not None and len(record.runner.compiled) == len(BUCKETS)
    # no pending lazy computation reached the bucket graphs (the padded inputs are plain device data)
    assert (met.counter_value("DynamoSyncInputExecuteTime") or 0) == syncs
    assert not _fallbacks()


def test_neuron_path_compiles_each_piece_once_per_bucket(xla_device, xla_compiles):
    """The Neuron path with traps: every bucket's graph is split at the trap boundaries, and each piece
    is one XLA compilation, once per bucket (pieces x buckets in all); the traps run on every call."""
    model, _ = build("tiny_transformer")
    model.eval()
    on_xla = copy.deepcopy(model).to(xla_device)
    pieces = []

    class Counting(NeuronDelegate):
        def compile(self, gm, example_inputs):
            pieces.append(tuple(tuple(t.shape) for t in example_inputs))
            return super().compile(gm, example_inputs)

    gp = graphpass.backend(
        then=Counting(registered_name="openxla", module=None), static_shapes={"dims": {"ids": 1}, "buckets": BUCKETS}
    )
    compiled = torch.compile(on_xla, backend=gp, dynamic=True)
    before, extracted = xla_compiles(), met.counter_value("DynamoExtractCompiledGraph") or 0
    with graphpass.trace_traps() as events:
        _sweep(compiled, model, xla_device, batch=6)
    per_bucket = len(pieces) // len(BUCKETS)
    assert per_bucket == 4 and len(pieces) == per_bucket * len(BUCKETS)  # embedding, layer 0, layer 1, head
    # torch_xla's bridge records every piece, but the two decoder layers' pieces are one and the same
    # XLA computation (same ops, same shapes: one graph hash), which XLA compiles once per bucket
    assert (met.counter_value("DynamoExtractCompiledGraph") or 0) - extracted == len(pieces)
    assert xla_compiles() - before == (per_bucket - 1) * len(BUCKETS)
    assert events.count(("enter", "layers.0")) == len(LENGTHS)  # on every call
    assert not _fallbacks()


def test_first_exact_size_graph_when_automatic_dynamic_is_turned_back_on(xla_device, xla_compiles):
    """With the setting torch_xla turned off turned back on (and no dynamic=True), Dynamo traces the
    first call at its exact size: one more compilation, then one per bucket."""
    model, _ = build("tiny_transformer")
    model.eval()
    on_xla = copy.deepcopy(model).to(xla_device)
    gp = graphpass.backend(then="openxla", traps=[], static_shapes={"dims": {"ids": 1}, "buckets": BUCKETS})
    compiled = torch.compile(on_xla, backend=gp)
    before = xla_compiles()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=True):
        _sweep(compiled, model, xla_device, batch=7)
    assert xla_compiles() - before == len(BUCKETS) + 1
    assert len(gp.graphs) == 2  # the exact-size graph, then the bucketed one


def test_torch_xla_setting_does_not_silently_disable_bucketing(xla_device, xla_compiles):
    """Under the setting `import torch_xla` leaves (automatic dynamic shapes off), a static_shapes
    graph is refused with DynamicShapesDisabledError before anything compiles, naming the setting."""
    assert torch._dynamo.config.automatic_dynamic_shapes is False  # as torch_xla leaves it
    model, _ = build("tiny_transformer")
    on_xla = copy.deepcopy(model).to(xla_device)
    delegate = CountingXla()
    gp = graphpass.backend(then=delegate, static_shapes={"dims": {"ids": 1}, "buckets": BUCKETS})
    compiled = torch.compile(on_xla, backend=gp)
    before = xla_compiles()
    with pytest.raises(graphpass.DynamicShapesDisabledError) as info, torch.no_grad():
        compiled(torch.randint(0, 64, (2, 5)).to(xla_device))
    msg = str(info.value)
    assert "torch._dynamo.config.automatic_dynamic_shapes is False" in msg and "importing torch_xla" in msg
    assert "dynamic=True" in msg
    assert delegate.calls == 0 and xla_compiles() == before
