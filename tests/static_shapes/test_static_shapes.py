"""static_shapes: buckets, padding safety, staging buffers, the dynamic fallback."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass
from graphpass.models.corpus import SeedStyle, build

from helpers import CountingBackend

BUCKETS = [8, 16, 32, 64]


def opts(counter, buckets=BUCKETS, **extra):
    return graphpass.backend(then=counter, static_shapes={"dims": {"ids": 1}, "buckets": list(buckets), **extra})


def test_64_lengths_cost_at_most_buckets_plus_one_compilations():
    """Lengths 2..65 (Dynamo always specializes a size of 1 into a graph of its own)."""
    model, _ = build("tiny_transformer")  # causal attention: padding at the end is safe
    counter = CountingBackend()
    buckets = [8, 16, 32, 64, 72]
    gp = opts(counter, buckets)
    compiled = torch.compile(model, backend=gp)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n in torch.randperm(64, generator=g).tolist():
            ids = torch.randint(0, 64, (2, n + 2), generator=g)
            out = compiled(ids)
            assert out.shape == (2, n + 2, 64)
            # padded matmuls may take other BLAS blocking: fp32 rounding differs, rows do not mix
            torch.testing.assert_close(out, model(ids), rtol=1e-5, atol=1e-6)
    assert counter.calls <= len(buckets) + 1
    (runner,) = [g.runner for g in gp.graphs if g.runner is not None]
    assert runner.plan.active and len(runner.compiled) == len(buckets) and not runner.oversize


def test_dynamic_true_compiles_only_the_buckets():
    model, _ = build("tiny_transformer")
    counter = CountingBackend()
    compiled = torch.compile(model, backend=opts(counter), dynamic=True)
    with torch.no_grad():
        for n in (3, 9, 10, 17, 40, 64, 2, 33):
            ids = torch.randint(0, 64, (1, n))
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)
    assert counter.calls == 4  # buckets 8, 16, 32, 64; no exact-size graph


def test_larger_than_largest_bucket_warns_once_and_runs_unpadded():
    model, _ = build("tiny_transformer")
    counter = CountingBackend()
    compiled = torch.compile(model, backend=opts(counter), dynamic=True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (70, 90, 70, 65, 128, 300):
            ids = torch.randint(0, 64, (1, n))
            assert torch.equal(compiled(ids), model(ids))  # unpadded: exact
    msgs = [str(w.message) for w in caught if "static_shapes" in str(w.message)]
    assert len(msgs) == 1 and "larger than the largest bucket 64" in msgs[0] and "dynamic shapes" in msgs[0]
    assert counter.calls == 1  # one dynamic fallback graph for every oversize length


def test_dynamic_fallback_under_inductor_and_aot_eager():
    """The oversize fallback is compiled once with symbolic sizes by a real AOTAutograd delegate."""
    model, _ = build("tiny_transformer")
    for then in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        calls = []

        def delegate(gm, example_inputs, then=then):
            calls.append(1)
            if then == "inductor":
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs)
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend(then)(gm, example_inputs)

        compiled = torch.compile(model, backend=opts(delegate), dynamic=True)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            for n in (70, 99, 130):
                ids = torch.randint(0, 64, (1, n))
                torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
        assert len(calls) == 1, then


def test_staging_buffers_have_stable_addresses():
    model, _ = build("tiny_transformer")
    gp = opts(CountingBackend())
    compiled = torch.compile(model, backend=gp, dynamic=True)
    with torch.no_grad():
        compiled(torch.randint(0, 64, (2, 5)))
        (runner,) = [g.runner for g in gp.graphs if g.runner is not None]
        (buf,) = runner.staging.values()
        ptr = buf.data_ptr()
        for n in (6, 7, 3):
            ids = torch.randint(0, 64, (2, n))
            compiled(ids)
            (buf,) = runner.staging.values()
            assert buf.data_ptr() == ptr and buf.shape == (2, 8)
            assert torch.equal(buf[:, :n], ids) and not buf[:, n:].any()


class MLPOverSeq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.fc = nn.Linear(16, 16)

    def forward(self, ids):
        return self.fc(F.gelu(self.emb(ids)))


class FullAttention(nn.Module):
    """Non-causal attention over the sequence: padding would change every row."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)

    def forward(self, ids):
        x = self.emb(ids)[:, None]
        return F.scaled_dot_product_attention(x, x, x)[:, 0]


class SeqSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)

    def forward(self, ids):
        return self.emb(ids).sum(dim=1)


def test_row_wise_graph_is_padded():
    model = MLPOverSeq()
    gp = opts(CountingBackend())
    compiled = torch.compile(model, backend=gp, dynamic=True)
    with torch.no_grad():
        ids = torch.randint(0, 64, (3, 11))
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)
    (runner,) = [g.runner for g in gp.graphs if g.runner is not None]
    assert runner.plan.active and list(runner.compiled)


@pytest.mark.parametrize("cls,words", [(FullAttention, "attention over the padded sequence"), (SeqSum, "")])
def test_unsafe_graph_refused_with_node_and_reason(cls, words):
    model = cls()
    gp = opts(CountingBackend())
    compiled = torch.compile(model, backend=gp, dynamic=True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (5, 9):
            ids = torch.randint(0, 64, (2, n))
            assert torch.equal(compiled(ids), model(ids))  # dynamic fallback: exact
    (plan,) = [g.analysis.bucket_plan for g in gp.graphs if g.analysis.bucket_plan is not None]
    assert not plan.active and all(g.runner is None for g in gp.graphs)
    reason = plan.refused[0]
    assert "node" in reason and words in reason
    assert sum("not padding this graph" in str(w.message) for w in caught) == 1


def test_mask_contract_allows_padding():
    model = FullAttention()
    gp = opts(CountingBackend(), masked=["ids"])
    compiled = torch.compile(model, backend=gp, dynamic=True)
    with torch.no_grad():
        compiled(torch.randint(0, 64, (2, 5)))
    (runner,) = [g.runner for g in gp.graphs if g.runner is not None]
    assert runner.plan.active  # the user vouched that padding is masked


def test_unknown_input_name_is_a_config_error():
    model, inputs = build("tiny_transformer")
    compiled = torch.compile(
        model,
        backend=graphpass.backend(then="eager", static_shapes={"dims": {"input_ids": 1}, "buckets": [8]}),
        dynamic=True,
    )
    with pytest.raises(graphpass.ConfigError, match="input_ids"):
        compiled(*inputs)


def test_dim_out_of_range_is_a_config_error():
    model, inputs = build("tiny_transformer")
    compiled = torch.compile(
        model, backend=graphpass.backend(then="eager", static_shapes={"dims": {"ids": 5}, "buckets": [8]}), dynamic=True
    )
    with pytest.raises(graphpass.ConfigError, match="has only 2 dims"):
        compiled(*inputs)


def test_seed_style_model_buffers_and_no_variable_size_allocation():
    model = SeedStyle().eval()
    gp = graphpass.backend(then="aot_eager", static_shapes={"dims": {"ids": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp, dynamic=True)
    with torch.no_grad():
        for n in (5, 12):
            ids = torch.randint(0, 64, (2, n))
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)
        (g,) = [g for g in gp.graphs if g.runner is not None]
        assert any("slice of _graphpass_static" in line for line in g.log)  # arange -> buffer slice
        allocs = []
        for n in (3, 5, 7, 8):  # one bucket (8), four lengths
            ids = torch.randint(0, 64, (2, n))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                compiled(ids)
            allocs.append(sorted(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0))
    # the steady state allocates the same sizes whatever the length: no variable-size allocation
    assert allocs[0] and all(a == allocs[0] for a in allocs)


def test_cudagraphs_delegate_records_each_bucket_once():
    """then="cudagraphs": one delegate compilation (one recording on a GPU) per bucket."""
    from torch._dynamo.backends.registry import lookup_backend

    calls = []

    def cudagraphs(gm, example_inputs):
        calls.append(1)
        return lookup_backend("cudagraphs")(gm, example_inputs)

    model, _ = build("tiny_transformer")
    compiled = torch.compile(model, backend=opts(cudagraphs), dynamic=True)
    with torch.no_grad():
        for n in range(2, 66):
            ids = torch.randint(0, 64, (1, n))
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)
    assert len(calls) == len(BUCKETS) + 1  # + the one oversize length (65), compiled at its size


class _BreakingAct(nn.Module):
    """No parameters, a graph break inside: Dynamo compiles its forward as a frame of its own whose
    only inputs are activations (no source rooted at ``self``)."""

    def forward(self, x):
        x = F.gelu(x)
        torch._dynamo.graph_break()
        return x * 2


class _LayerCallingHelper(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d, 2 * d), _BreakingAct(), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + _mixed(self.down(self.act(self.up(x))))


def _mixed(h):  # a free function with a break: its own frames, no module ``self``
    h = h.softmax(-1)
    torch._dynamo.graph_break()
    return h * h.sum(-1, keepdim=True)


class _BreakingModel(nn.Module):
    def __init__(self, vocab=32, d=16, loop=True):
        super().__init__()
        self.loop = loop
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_LayerCallingHelper(d) for _ in range(2))

    def forward(self, input_ids):
        h = self.embed(input_ids)
        if self.loop:  # a break inside the loop: Dynamo skips this whole frame
            for layer in self.layers:
                h = layer(h)
            return h
        return self.layers[1](self.layers[0](h))  # unrolled: the frame splits at each call


def _run_breaking(loop):
    torch.manual_seed(0)
    model = _BreakingModel(loop=loop).eval()
    gp = graphpass.backend(then="eager", static_shapes={"dims": {"input_ids": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (5, 7, 12):
            ids = torch.randint(0, 32, (1, n))
            torch.testing.assert_close(compiled(input_ids=ids), model(ids), rtol=1e-5, atol=1e-6)
    roots = [g.analysis.roots for g in gp.graphs]
    entry = [g for g, r in zip(gp.graphs, roots) if r is not None and r.is_entry_frame]
    inner = {r.frame_name for r in roots if r is not None and not r.is_entry_frame}
    return entry, inner, [str(w.message) for w in caught]


def test_graphs_of_frames_inside_the_model_are_not_taken_for_the_entry_frame():
    """Before: a graph compiled from a submodule's or a free function's own frame that reads no
    weight (a graph break inside ``_BreakingAct.forward`` / ``_mixed``) was taken for the entry
    frame, so ``static_shapes.dims={"input_ids": 1}`` raised "no input of the compiled function has
    this name (inputs: x)". The entry frame's graph is bucketed; the others run as they are."""
    entry, inner, _ = _run_breaking(loop=False)
    # the entry frame compiles twice (the first length static, then dynamic) and is bucketed
    assert entry and all(g.analysis.roots.frame_name == "forward" for g in entry)
    assert any(g.runner is not None and g.runner.plan.active for g in entry)
    assert {"forward", "_mixed"} <= inner, inner  # _BreakingAct.forward and the free function's first graphs


def test_a_skipped_entry_frame_is_a_warning_naming_the_input_not_a_config_error():
    """With the break inside the layer loop Dynamo runs the entry frame eagerly: no graph takes
    ``input_ids``. graphpass says so (and why, from Dynamo's records) instead of raising or staying silent."""
    entry, inner, warned = _run_breaking(loop=True)
    assert not entry and {"forward", "_mixed"} <= inner
    assert any("input_ids" in w and "skipped" in w and "loop" in w for w in warned), warned


@pytest.fixture
def automatic_dynamic_off():
    """Dynamo's setting as `import torch_xla` leaves it (torch's own scoped patch; monkeypatch cannot
    restore a config-module attribute)."""
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield


def test_automatic_dynamic_shapes_off_is_refused_before_anything_compiles(automatic_dynamic_off):
    """`import torch_xla` turns Dynamo's automatic dynamic shapes off process-wide: every length would
    then trace a static graph of its own and bucketing would silently never happen. graphpass refuses
    at the first graph, naming the setting and the fixes, before the delegate compiles anything."""
    model, _ = build("tiny_transformer")
    counter = CountingBackend()
    compiled = torch.compile(model, backend=opts(counter))
    with pytest.raises(graphpass.DynamicShapesDisabledError) as info, torch.no_grad():
        compiled(torch.randint(0, 64, (2, 5)))
    msg = str(info.value)
    assert "torch._dynamo.config.automatic_dynamic_shapes is False" in msg and "ids dim 1" in msg
    assert "dynamic=True" in msg and "mark_dynamic" in msg
    assert info.value.input == "ids" and info.value.dim == 1
    assert counter.calls == 0


def test_automatic_dynamic_shapes_off_buckets_under_dynamic_true_or_mark_dynamic(automatic_dynamic_off):
    """The fixes the error names work with the setting still off: dynamic=True (or mark_dynamic on the
    first call's input) gives graphpass a symbolic length from the first call, one graph per bucket.
    A first call of length 1 is static under every setting (Dynamo specializes it): not refused."""
    model, _ = build("tiny_transformer")
    for how in ("dynamic", "mark"):
        torch._dynamo.reset()
        counter = CountingBackend()
        compiled = torch.compile(model, backend=opts(counter), dynamic=True if how == "dynamic" else None)
        lengths = (1, 3, 9, 10, 17, 40, 2) if how == "dynamic" else (3, 9, 10, 17, 40, 2)
        with torch.no_grad():
            for k, n in enumerate(lengths):
                ids = torch.randint(0, 64, (2, n))
                if how == "mark" and k == 0:
                    torch._dynamo.mark_dynamic(ids, 1)
                torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)
        # buckets 8, 16, 64 (and 32 for 17); with dynamic=True, the length-1 graph compiles as is
        assert counter.calls == 4 + (how == "dynamic"), how


def _skip_unless_torch_guards_duck_sizes(model):
    """torch 2.9's Dynamo (not 2.15's) runs a graph traced for a batch equal to the length for a later
    (5, 9) call too, and fails in a reshape with no graphpass involved: probe plain torch.compile."""
    plain = torch.compile(model, backend="eager", dynamic=True)
    try:
        with torch.no_grad():
            for shape in ((5, 5), (5, 9)):
                plain(torch.randint(0, 64, shape))
    except RuntimeError as err:
        pytest.skip(
            f"this torch's Dynamo reuses a duck-sized graph for unequal sizes (plain torch.compile fails: {err})"
        )
    finally:
        torch._dynamo.reset()


def test_a_batch_equal_to_the_first_length_under_dynamic_true_is_refused_not_a_crash():
    """Under dynamic=True Dynamo gives equal sizes one symbol (duck sizing): a first call of batch 5 and
    length 5 makes the logits' reshape ``(s*s)//s``, no polynomial. That used to fail the pass with a
    sympy PolynomialError (a PassError); now the plan is refused with the output named, that graph runs
    dynamic, and the next batch gets a bucketed graph of its own."""
    model, _ = build("tiny_transformer")
    _skip_unless_torch_guards_duck_sizes(model)
    counter = CountingBackend()
    gp = opts(counter)
    compiled = torch.compile(model, backend=gp, dynamic=True)
    with pytest.warns(UserWarning, match=r"not padding this graph.*cannot slice it back"), torch.no_grad():
        for batch, n in ((5, 5), (5, 9), (2, 5), (2, 9)):
            ids = torch.randint(0, 64, (batch, n))
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-6)
    first, second = gp.graphs
    assert first.runner is None and second.runner is not None and second.runner.plan.active
