"""slice_static_buffers: factories with symbolic sizes become slices of constant max-size buffers."""

import pytest
import sympy
import torch
import torch.nn as nn

from graphpass.config import GraphpassConfig
from graphpass.passes.base import PassContext
from graphpass.passes.slice_static_buffers import SliceStaticBuffers, slice_static_buffers

MAX = 16
LENGTHS = (5, 3, 9, MAX)  # 0 and 1 are specialized by Dynamo (a new graph), so not used
FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty}
NEW_FACTORIES = {"new_zeros", "new_ones", "new_full", "new_empty"}


def size_symbols(gm):
    """The symbols of the graph's SymInt placeholders, in order (s0, s1, ...)."""
    return [
        n.meta["example_value"].node.expr
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymInt)
    ]


class SlicingBackend:
    """Runs slice_static_buffers with ``MAX`` for the chosen symbols, then ``then`` (or gm.forward)."""

    def __init__(self, bound=MAX, symbols=None, then=None, edit=None, slice_outputs=True):
        self.bound, self.symbols, self.then, self.edit = bound, symbols, then, edit
        self.slice_outputs = slice_outputs
        self.graphs, self.records = [], []

    def __call__(self, gm, example_inputs):
        syms = size_symbols(gm)
        chosen = syms if self.symbols is None else [syms[i] for i in self.symbols]
        if self.edit is not None:
            self.edit(gm)
        self.records = slice_static_buffers(gm, {s: self.bound for s in chosen}, slice_outputs=self.slice_outputs)
        self.graphs.append(gm)
        return self.then(gm, example_inputs) if self.then is not None else gm.forward

    def record(self, op):
        return next(r for r in self.records if r.op == op)


def symbolic_factories(gm):
    out = []
    for n in gm.graph.nodes:
        is_factory = (n.op == "call_function" and n.target in FACTORIES) or (
            n.op == "call_method" and n.target in NEW_FACTORIES
        )
        ev = n.meta.get("example_value")
        if is_factory and any(isinstance(d, torch.SymInt) for d in ev.shape):
            out.append(n.name)
    return out


def assert_same(got, ref):
    got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape and g.stride() == r.stride()
        assert torch.equal(g, r)


class PositionModel(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.pos = nn.Embedding(MAX, 8)
        self.dtype = dtype

    def forward(self, x):
        b, length = x.shape[0], x.shape[1]
        ids = torch.arange(length)  # position ids
        mask = torch.ones(length, length, dtype=self.dtype).tril()
        pad = torch.zeros(b, length, dtype=self.dtype)
        three = torch.full((length,), 3.0)
        extra = x.new_zeros(length, 4)
        return x + self.pos(ids), ids, mask, pad, three, extra


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_model_matches_eager_and_allocates_no_symbolic_factory(dtype):
    torch.manual_seed(0)
    model = PositionModel(dtype).eval()
    backend = SlicingBackend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for length in LENGTHS:
            x = torch.randn(2, length, 8)
            assert_same(compiled(x), model(x))
    assert len(backend.graphs) == 1  # every length ran the one rewritten graph
    gm = backend.graphs[0]
    assert symbolic_factories(gm) == []
    assert {r.op for r in backend.records} == {"arange", "ones", "zeros", "full", "new_zeros"}
    assert all(r.skipped_reason is None for r in backend.records), backend.records
    assert backend.record("ones").max_shape == (MAX, MAX)
    assert backend.record("arange").max_shape == (MAX,)
    assert backend.record("new_zeros").max_shape == (MAX, 4)
    for r in backend.records:
        buf = gm.get_buffer(r.buffer)
        assert tuple(buf.shape) == r.max_shape
        assert r.bytes == buf.numel() * buf.element_size()
        assert r.buffer not in gm.state_dict()  # non-persistent


def test_returned_slice_shares_the_buffer_across_calls():
    backend = SlicingBackend()
    compiled = torch.compile(lambda x: torch.arange(x.shape[0]), backend=backend, dynamic=True)
    outs = [compiled(torch.randn(n)) for n in (4, 7, 11)]
    buf = backend.graphs[0].get_buffer(backend.record("arange").buffer)
    assert tuple(buf.shape) == (MAX,)
    for n, out in zip((4, 7, 11), outs):
        assert torch.equal(out, torch.arange(n))
        assert out.untyped_storage().data_ptr() == buf.data_ptr()  # no allocation of its own


def test_slice_outputs_false_leaves_returned_factories():
    def fn(x):
        return torch.arange(x.shape[0]).view(-1, 1), x + torch.zeros(x.shape[0])

    backend = SlicingBackend(slice_outputs=False)
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for n in (4, 7):
        x = torch.randn(n)
        assert_same(compiled(x), fn(x))
    assert "graph output" in backend.record("arange").skipped_reason
    assert backend.record("zeros").skipped_reason is None


def test_inner_symbolic_dim_keeps_fresh_strides():
    backend = SlicingBackend()
    compiled = torch.compile(lambda x: torch.zeros(x.shape[0], x.shape[1]).view(-1) + 1, backend=backend, dynamic=True)
    for b, length in ((2, 3), (3, 5), (4, 7)):
        x = torch.randn(b, length)
        assert_same(compiled(x), torch.zeros(b, length).view(-1) + 1)
    rec = backend.record("zeros")
    assert rec.skipped_reason is None and rec.max_shape == (MAX, MAX)


def test_arange_with_start_step_and_floats():
    def fn(x):
        n = x.shape[0]
        return torch.arange(2, n + 3, 2), torch.arange(0.5, n, 0.25), torch.arange(n, dtype=torch.float32)

    backend = SlicingBackend()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for n in LENGTHS:
        x = torch.randn(n)
        assert_same(compiled(x), fn(x))
    assert len(backend.records) == 3
    assert all(r.skipped_reason is None for r in backend.records), backend.records
    assert symbolic_factories(backend.graphs[0]) == []


def test_inexact_float_arange_is_skipped():
    # arange(0.1, n, 0.1) in float32 differs in the last bit between lengths: no prefix stands in
    fn = lambda x: torch.arange(0.1, x.shape[0], 0.1)  # noqa: E731
    backend = SlicingBackend()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for n in LENGTHS:
        assert_same(compiled(torch.randn(n)), fn(torch.randn(n)))
    assert "not exact" in backend.record("arange").skipped_reason


def test_size_given_as_shape_object():
    fn = lambda x: (torch.zeros(x.shape), torch.ones(x.size()) * 2)  # noqa: E731
    backend = SlicingBackend()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for b, length in ((2, 3), (3, 9)):
        x = torch.randn(b, length)
        assert_same(compiled(x), fn(x))
    assert symbolic_factories(backend.graphs[0]) == []


def _add_one(x):
    z = torch.zeros(x.shape[0])
    z.add_(1)
    return x + z


def _setitem(x):
    z = torch.zeros(x.shape[0])
    z[0] = z[0] + 5  # reads what is there: a shared buffer would give 10 on the second call
    return x * z


def _view_mutated(x):
    z = torch.zeros(x.shape[0], 2)
    z.t().add_(2)
    z.view(-1)[1] = 7
    return z + x[:, None]


@pytest.mark.parametrize("fn, writer", [(_add_one, "add_"), (_setitem, "setitem"), (_view_mutated, "a view of it")])
def test_mutated_factory_is_skipped(fn, writer):
    backend = SlicingBackend()
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for n in (4, 6, 4):  # the repeat would see a buffer written by an earlier call
        x = torch.randn(n)
        assert_same(compiled(x), fn(x))
    (rec,) = backend.records
    assert rec.skipped_reason is not None and "writes into" in rec.skipped_reason
    assert writer in rec.skipped_reason
    assert rec.buffer is None and rec.bytes == 0
    assert not [name for name, _ in backend.graphs[0].named_buffers()]


def test_unbounded_symbol_is_skipped():
    def fn(x):
        return torch.arange(x.shape[1]), torch.zeros(x.shape[0], x.shape[1])

    backend = SlicingBackend(symbols=[1])  # a bound for the length only, none for the batch
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for b, length in ((2, 3), (5, 7)):
        x = torch.randn(b, length)
        assert_same(compiled(x), fn(x))
    batch = size_symbols(backend.graphs[0])[0]
    assert backend.record("arange").skipped_reason is None
    assert backend.record("zeros").skipped_reason == f"no bound for {batch}"
    assert backend.record("zeros").max_shape is None


def test_bound_below_traced_size_is_skipped():
    backend = SlicingBackend(bound=4)
    compiled = torch.compile(lambda x: torch.arange(x.shape[0]), backend=backend, dynamic=True)
    assert torch.equal(compiled(torch.randn(9)), torch.arange(9))
    assert "below the traced size" in backend.record("arange").skipped_reason


def test_requires_grad_factory_is_skipped():
    def mark(gm):  # Dynamo keeps requires_grad factories out of its graphs, so set the kwarg here
        node = next(n for n in gm.graph.nodes if n.target is torch.zeros)
        node.kwargs = {**node.kwargs, "requires_grad": True}

    backend = SlicingBackend(edit=mark)
    compiled = torch.compile(lambda x: torch.zeros(x.shape[0]) + x, backend=backend, dynamic=True)
    compiled(torch.randn(5))
    assert "requires_grad" in backend.record("zeros").skipped_reason


def test_size_above_the_bound_raises_instead_of_wrong_values():
    compiled = torch.compile(lambda x: torch.arange(x.shape[0]) + x, backend=SlicingBackend(), dynamic=True)
    compiled(torch.zeros(4))
    with pytest.raises(RuntimeError):
        compiled(torch.zeros(MAX + 1))


def test_rewritten_graph_survives_aot_autograd():
    from torch._dynamo.backends.registry import lookup_backend

    model = PositionModel(torch.float32)
    backend = SlicingBackend(then=lookup_backend("aot_eager"))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for length in (3, 7):
        x = torch.randn(2, length, 8, requires_grad=True)
        got, ref = compiled(x), model(x)
        assert_same(tuple(t.detach() for t in got), tuple(t.detach() for t in ref))
        got[0].sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x))
    stepped = lambda x: torch.arange(0.5, x.shape[0], 0.25) + torch.arange(1, x.shape[0] + 1, 3).sum()  # noqa: E731
    compiled = torch.compile(stepped, backend=SlicingBackend(then=lookup_backend("aot_eager")), dynamic=True)
    for n in (4, 10):
        assert torch.equal(compiled(torch.randn(n)), stepped(torch.randn(n)))


def _context(gm, **attrs):
    ctx = PassContext(gm=gm, example_inputs=[], config=GraphpassConfig())
    for k, v in attrs.items():
        setattr(ctx, k, v)
    return ctx


@pytest.mark.parametrize("source", ["static_bounds", "callable", "none"])
def test_pass_takes_bounds_from_context_or_callable(source):
    seen = {}

    def backend(gm, example_inputs):
        (sym,) = size_symbols(gm)
        bounds = {sym: MAX}
        if source == "static_bounds":
            p, ctx = SliceStaticBuffers(bounds=lambda ctx: {}), _context(gm, static_bounds=bounds)
        elif source == "callable":
            p, ctx = SliceStaticBuffers(bounds=lambda ctx: bounds), _context(gm)
        else:
            p, ctx = SliceStaticBuffers(), _context(gm, static_bounds={})
        seen["should_run"] = p.should_run(ctx)
        p(ctx)
        seen["log"] = ctx.log
        seen["gm"] = gm
        return gm.forward

    fn = lambda x: torch.arange(x.shape[0]) * 2  # noqa: E731
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    assert torch.equal(compiled(torch.randn(6)), fn(torch.randn(6)))
    if source == "none":
        assert seen["should_run"] is False and seen["log"] == []
        assert symbolic_factories(seen["gm"]) != []
    else:
        assert seen["should_run"] is True
        assert symbolic_factories(seen["gm"]) == []
        assert len(seen["log"]) == 1 and seen["log"][0].startswith("slice_static_buffers: ")
        assert "_graphpass_static_0" in seen["log"][0]


def test_static_graph_is_left_alone():
    gm_seen = []

    def backend(gm, example_inputs):
        p, ctx = SliceStaticBuffers(), _context(gm, static_bounds={sympy.Symbol("s0"): MAX})
        assert not p.should_run(ctx)
        assert slice_static_buffers(gm, {sympy.Symbol("s0"): MAX}) == []
        gm_seen.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x: torch.zeros(4) + x, backend=backend, dynamic=False)
    assert torch.equal(compiled(torch.ones(4)), torch.ones(4))
    assert [n for n in gm_seen[0].graph.nodes if n.target is torch.zeros]


def test_inductor_returns_views_of_the_buffer():
    from torch._dynamo.backends.registry import lookup_backend

    torch.manual_seed(0)
    model = PositionModel(torch.float32).eval()
    backend = SlicingBackend(then=lookup_backend("inductor"))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for length in (3, 7):
            x = torch.randn(2, length, 8)
            got = compiled(x)
            assert_same(got, model(x))
            # the last graph: Dynamo may restart once (python float scalars) and discard the first
            ids = backend.graphs[-1].get_buffer(backend.record("arange").buffer)
            assert got[1].untyped_storage().data_ptr() == ids.data_ptr()
