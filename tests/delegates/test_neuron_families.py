"""The Neuron path (a delegate without host code) on real families and on graphs built to break it.

Regressions:

* OPT with static-shape buckets failed in the split at trap boundaries with "cycle exists between
  partitions!": a bucket bakes its size inputs in, so the first node whose example value is the size
  symbol became its definition for ``split_module``, which then made a piece depend on itself.
* transformers' mixture-of-experts families handed ``transformers.grouped_mm_fallback`` (a custom
  op looping over experts in Python) to a compiler that takes aten/prims ops only.
"""

from __future__ import annotations

import importlib.util
import logging
import operator
import random

import pytest
import torch

import graphpass
from graphpass.backends import Delegate, NeuronDelegate
from graphpass.delegation import runs_on_host, split_at_boundaries
from graphpass.fx_utils import copy_graph, is_tensor_node, node_order, writes_into
from graphpass.models.corpus import build

from helpers import StrictAtenBackend, bench_conformance, fresh_inputs

# ------------------------------------------------------------------ custom ops the tests route

_LIB = torch.library.Library("graphpass_test_host", "FRAGMENT")
_LIB.define("copy(Tensor x) -> Tensor")  # host only: a kernel, no decomposition
_LIB.define("pair(Tensor x) -> Tensor[]")  # host only, unpacked by getitem
_LIB.define("twice(Tensor x) -> Tensor")  # CompositeImplicitAutograd: decomposes on its own
_LIB.define("thrice(Tensor x) -> Tensor")  # a kernel, plus a decomposition table entry (fixture)
_LIB.define("outer(Tensor x) -> Tensor")  # CompositeImplicitAutograd calling a host-only op
_LIB.impl("copy", lambda x: x.clone(), "CompositeExplicitAutograd")
_LIB.impl("pair", lambda x: [x.clone(), x.clone()], "CompositeExplicitAutograd")
_LIB.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
_LIB.impl("thrice", lambda x: x * 3, "CompositeExplicitAutograd")
_LIB.impl("outer", lambda x: torch.ops.graphpass_test_host.copy(x) + 1, "CompositeImplicitAutograd")
for _name in ("copy", "pair", "thrice"):
    _LIB._register_fake(_name, lambda x, _n=_name: [x.clone(), x.clone()] if _n == "pair" else x.clone())
OPS = torch.ops.graphpass_test_host


def _neuron() -> NeuronDelegate:
    return NeuronDelegate(registered_name="strict_aten_standin", module=None)


def _only_aten(strict: StrictAtenBackend) -> None:
    for gm in strict.graphs:
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is not operator.getitem:
                assert isinstance(n.target, torch._ops.OpOverload) and n.target.namespace in ("aten", "prims"), n


# ------------------------------------------------------------------ transformers families

transformers_spec = importlib.util.find_spec("transformers")
needs_transformers = pytest.mark.skipif(transformers_spec is None, reason="transformers is not installed")


def _conformance():
    """bench/conformance.py, whose tiny configs (2 layers, 4 experts top-2) the harness also uses."""
    return bench_conformance()


FAMILIES = ["opt", "mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"]
MOE = {"mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"}


@needs_transformers
@pytest.mark.parametrize("family", FAMILIES)
def test_family_through_neuron(strict_backend, family, caplog):
    """Every graph Neuron gets holds aten/prims ops only, the MoE families' grouped matmul runs on
    the host (and says so), the traps run, the logits equal eager's (fp32, nothing recomputed)."""
    model = _conformance().build_model(family)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(model, backend=graphpass.backend(then=_neuron()))
    with graphpass.trace_traps() as events, torch.no_grad(), caplog.at_level("WARNING", "graphpass.delegation"):
        out = compiled(input_ids=ids, use_cache=True).logits  # the default cache holds tensor constants
        ref = model(input_ids=ids, use_cache=True).logits
    assert torch.equal(out, ref)
    _only_aten(strict_backend)
    layers = {label for kind, label in events if kind == "enter"}
    assert len(layers) == model.config.num_hidden_layers, layers
    host = [r.getMessage() for r in caplog.records if "run on the host" in r.getMessage()]
    if family in MOE:
        assert host and "transformers.grouped_mm_fallback" in host[0], host
    else:
        assert not host


@needs_transformers
def test_opt_with_buckets_through_neuron(strict_backend):
    """Regression: the bucket graph of OPT made the split fail with "cycle exists between partitions!"."""
    model = _conformance().build_model("opt")
    buckets = [8, 16]
    gp = graphpass.backend(then=_neuron(), static_shapes={"dims": {"input_ids": 1}, "buckets": buckets})
    compiled = torch.compile(model, backend=gp)
    g = torch.Generator().manual_seed(2)
    lengths = [6, 3, 11, 8, 16]
    with graphpass.trace_traps() as events, torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
            torch.testing.assert_close(
                compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-6
            )
    _only_aten(strict_backend)
    seq_lens = {s[1] for shapes in strict_backend.shapes for s in shapes if len(s) == 3 and s[0] == 1}
    assert seq_lens <= set(buckets) | {lengths[0]}, seq_lens
    assert sum(kind == "enter" for kind, _ in events) == len(lengths) * model.config.num_hidden_layers


# ------------------------------------------------------------------ custom ops: decomposed, on the host, refused


class TwoOps(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = self.op(torch.relu(layer(x)))
        return x


@pytest.fixture
def thrice_decomposition():
    """A decomposition table entry for ``thrice``, removed afterwards (the table is torch's, process-wide)."""
    from torch._decomp import decomposition_table, register_decomposition

    register_decomposition(OPS.thrice.default)(lambda x: x * 3)
    yield
    decomposition_table.pop(OPS.thrice.default)


@pytest.mark.parametrize("op, on_host", [("twice", False), ("thrice", False), ("copy", True)])
def test_custom_ops_are_decomposed_or_run_on_the_host(strict_backend, thrice_decomposition, caplog, op, on_host):
    model = TwoOps(getattr(OPS, op))
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend=graphpass.backend(then=_neuron()))
    with torch.no_grad(), caplog.at_level("WARNING", "graphpass.delegation"):
        assert torch.equal(compiled(x), model(x))
    _only_aten(strict_backend)
    host = [r.getMessage() for r in caplog.records if "run on the host" in r.getMessage()]
    assert bool(host) == on_host, host
    if on_host:
        assert "graphpass_test_host.copy (2 calls)" in host[0]


def test_training_through_a_custom_op_on_the_host(strict_backend):
    """The corpus's fused kernel (a custom op with its own autograd, no decomposition) runs on the host
    between the compiled pieces; its gradients flow through them."""
    model, inputs = build("custom_op")
    ref, _ = build("custom_op")
    ref.load_state_dict(model.state_dict())
    x = fresh_inputs(inputs)
    torch.compile(model, backend=graphpass.backend(then=_neuron()))(*x).sum().backward()
    ref(*x).sum().backward()
    _only_aten(strict_backend)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_an_op_appearing_only_in_the_lowering_is_refused_by_name(strict_backend):
    """``outer`` decomposes, into ``copy``, which does not: graphpass cannot see it before AOTAutograd
    lowers the piece, so the lowering refuses it, by name, before Neuron's compiler gets the graph."""
    model = TwoOps(OPS.outer)
    compiled = torch.compile(model, backend=graphpass.backend(then=_neuron()))
    with pytest.raises(graphpass.DelegateError, match=r"graphpass_test_host\.copy\.default") as info, torch.no_grad():
        compiled(torch.randn(4, 16))
    assert "test_neuron_families.py" in str(info.value)  # the model line it came from
    assert not strict_backend.graphs or all("graphpass_test_host" not in str(g.graph) for g in strict_backend.graphs)


# ------------------------------------------------------------------ the split on random graphs


class CheckingDelegate(Delegate):
    """Without host code: runs each piece as it is, after checking it holds nothing the host must run."""

    name = "checking"
    host_code = False

    def compile(self, gm, example_inputs):
        bad = [n for n in gm.graph.nodes if runs_on_host(n)]
        assert not bad, bad
        return gm.forward


class GradToggle(torch.nn.Module):
    """Grad mode toggled inside the graph: ``split_module`` then requires contiguous partitions."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x).relu()
        with torch.no_grad():
            s = h.sum(-1, keepdim=True) / h.shape[-1]
        return self.b(h - s) * h.shape[0]


def _dynamo_graph(model, inputs):
    """The graph Dynamo traces for ``model`` with dynamic sizes, and the real arguments of its call."""
    seen = []

    def capture(gm, example_inputs):
        def run(*args):
            seen.append((gm, args))
            return gm(*args)

        return run

    torch._dynamo.reset()
    torch.compile(model, backend=capture, dynamic=True)(*inputs)
    return seen[0]


def _bake_sizes(gm, args):
    """What a static-shape bucket does: size inputs replaced by their value, dropped from the signature."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for ph, a in zip(placeholders, args):
        if isinstance(a, int):
            ph.replace_all_uses_with(a)
            gm.graph.erase_node(ph)
    gm.recompile()
    return [a for a in args if not isinstance(a, int)]


def _insert_size_products(gm, rng: random.Random) -> None:
    """For each size input, ``1 * size`` at a random place, read by the users of the size that come
    later (as ``bsz * seq_len`` is where the batch is 1): after a bucket bakes the size in, that node is
    the first whose example value is the size symbol."""
    order = node_order(gm.graph)
    for ph in [
        n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymInt)
    ]:
        users = sorted(ph.users, key=order.get)
        if not users:
            continue
        at = rng.choice(users)
        with gm.graph.inserting_before(at):
            product = gm.graph.call_function(operator.mul, (1, ph))
        product.meta["example_value"] = ph.meta["example_value"]
        for user in users[users.index(at) :]:
            user.replace_input_with(ph, product)
    gm.recompile()


def _insert_host_nodes(gm, rng: random.Random, count: int) -> int:
    """Insert ``count`` host nodes at random places: trap boundaries on random earlier tensors, and
    host-only copies (one unpacked by a getitem placed further down) fed by one piece and read by a
    later one, out of order with the pieces between. Values are unchanged. Returns how many."""
    inserted = 0
    for _ in range(count):
        nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        order = node_order(gm.graph)
        at = rng.choice(nodes)
        tensors = [n for n in gm.graph.nodes if order[n] < order[at] and is_tensor_node(n) and not runs_on_host(n)]
        if not tensors:
            continue
        src = rng.choice(tensors)
        later = [u for u in src.users if order[u] >= order[at] and u.op != "output" and not writes_into(u, src)]
        kind = rng.choice(["trap", "copy", "pair"]) if later else "trap"
        with gm.graph.inserting_before(at):
            if kind == "trap":
                gm.graph.call_function(torch.ops.graphpass.trap_enter.default, (f"t{inserted}", [src]))
            else:
                host = gm.graph.call_function(getattr(OPS, kind).default, (src,))
        if kind != "trap":
            user = rng.choice(later)
            if kind == "pair":
                with gm.graph.inserting_before(user):
                    host = gm.graph.call_function(operator.getitem, (host, 1))
            user.replace_input_with(src, host)
        inserted += 1
    gm.graph.lint()
    gm.recompile()
    return inserted


def _property_cases():
    models = [build("mlp_stack"), build("tiny_transformer"), build("moe"), (GradToggle(), (torch.randn(4, 8),))]
    return [(m, fresh_inputs(inputs)) for m, inputs in models]


def test_split_never_makes_a_cycle():
    """Property: for corpus graphs with dynamic sizes, and the same graphs with their sizes baked in
    (a static-shape bucket), host nodes inserted at random places split into pieces that run, each
    free of host nodes, and give exactly what the unsplit graph gives."""
    rng = random.Random(0)
    checked = 0
    for model, inputs in _property_cases():
        source, args = _dynamo_graph(model, inputs)
        for baked in (False, True):
            for _ in range(4):
                gm = copy_graph(source)
                _insert_size_products(gm, rng)
                call_args = _bake_sizes(gm, list(args)) if baked else list(args)
                hosts = _insert_host_nodes(gm, rng, rng.randint(1, 6))
                parent, pieces = split_at_boundaries(gm, CheckingDelegate())
                assert pieces >= 1
                host_subs = [s for s in parent.children() if isinstance(s, torch.fx.GraphModule)]
                assert len(host_subs) == hosts
                with torch.no_grad():
                    want, got = gm(*call_args), parent(*call_args)
                assert all(torch.equal(w, g) for w, g in zip(want, got))
                checked += 1
    assert checked == 4 * 2 * 4


def test_the_split_leaves_the_graph_it_was_given_alone():
    model, inputs = build("tiny_transformer")
    gm, args = _dynamo_graph(model, fresh_inputs(inputs))
    _insert_host_nodes(gm, random.Random(1), 3)
    before = (gm.code, [dict(n.meta) for n in gm.graph.nodes])
    split_at_boundaries(gm, CheckingDelegate())
    assert (gm.code, [dict(n.meta) for n in gm.graph.nodes]) == before


def test_non_aten_nodes_names_what_a_static_compiler_refuses():
    from graphpass.fx_utils import aten_decomposition, is_custom_op, non_aten_nodes, op_library

    assert op_library(torch.ops.aten.add.Tensor) == "aten" and op_library(OPS.copy) == "graphpass_test_host"
    assert op_library(torch.add) is None and not is_custom_op(torch.ops.graphpass.trap_enter.default)
    assert aten_decomposition(OPS.twice) == {} and aten_decomposition(OPS.copy.default) is None
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.relu.default, (x,))
    z = g.call_function(OPS.copy.default, (y,))
    w = g.call_method("sum", (z,))
    g.output((w,))
    assert [n.name for n in non_aten_nodes(g)] == [z.name, w.name]


def test_a_split_with_no_host_node_needs_none(strict_backend, caplog):
    """A graph without host nodes (no traps: traps=[]) goes to the delegate whole."""
    model, inputs = build("mlp_stack")
    compiled = torch.compile(model, backend=graphpass.backend(then=_neuron(), traps=[]))
    with torch.no_grad(), caplog.at_level(logging.WARNING, "graphpass.delegation"):
        assert torch.equal(compiled(*inputs), model(*inputs))
    assert len(strict_backend.graphs) == 1 and not caplog.records
