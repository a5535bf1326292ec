"""Ownership read off the graph: FQNs, owners, traps and bytes for every tensor input."""

import torch
import torch.nn as nn

import graphpass
from graphpass.models.corpus import build


def analyses(name_or_model, inputs=None, **options):
    if isinstance(name_or_model, str):
        model, inputs = build(name_or_model)
    else:
        model = name_or_model
    gp = graphpass.backend(then="eager", **options)
    with torch.no_grad():
        torch.compile(model, backend=gp)(*inputs)
    return gp.graphs


def tensor(graphs, fqn):
    for g in graphs:
        t = g.analysis.tensor_for(fqn)
        if t is not None:
            return t
    raise KeyError(fqn)


def test_every_tensor_input_has_fqn_owner_and_trap():
    graphs = analyses("tiny_transformer")
    (g,) = graphs
    a = g.analysis
    placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
    assert {p.name for p in placeholders} == set(a.tensors)  # no SymInts here: every input is a tensor
    for t in a.weights():
        assert t.fqns and t.owners, t
        if t.fqn.startswith("layers."):
            assert t.traps == [".".join(t.fqn.split(".")[:2])]
    ids = next(t for t in a.tensors.values() if t.kind == "input")
    assert ids.fqns == ["ids"] and ids.nbytes == 0


def test_tied_weights_one_input_several_owners_counted_once():
    model, inputs = build("tiny_transformer")
    assert model.lm_head.weight is model.embed.weight
    (g,) = analyses(model, inputs)
    a = g.analysis
    tied = a.tensor_for("lm_head.weight")
    assert tied is a.tensor_for("embed.weight")
    assert tied.fqns == ["embed.weight", "lm_head.weight"]
    assert set(tied.holders) == {"embed", "lm_head"} and set(tied.consumers) == {"embed", "lm_head"}
    placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder" and "embed" in n.name]
    assert len(placeholders) == 1
    unique = {id(p): p for p in model.parameters()}  # parameters() deduplicates tied weights
    assert a.total_weight_bytes == sum(p.numel() * p.element_size() for p in unique.values())
    report = graphpass.explain(model, *inputs)
    assert report.total_weight_bytes == a.total_weight_bytes


def test_inner_tensor_field_owned_with_its_parameter():
    graphs = analyses("quant_linear")
    scale = tensor(graphs, "layers.0.up.weight.scale")
    weight = tensor(graphs, "layers.0.up.weight")
    assert scale.kind == "inner" and scale.parent == "layers.0.up.weight"
    assert scale.holders == weight.holders == ["layers.0.up"]
    assert scale.traps == weight.traps == ["layers.0"]
    assert scale.dtype == "float32" and weight.dtype == "int8"
    trap = graphs[0].analysis.traps["layers.0"]
    assert scale.node in trap.tensors and weight.node in trap.tensors


class BufferLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("shift", torch.randn(8))

    def forward(self, x):
        return self.bn(self.lin(x)) + self.shift


class BufferModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(BufferLayer() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_buffers():
    model = BufferModel().eval()
    graphs = analyses(model, (torch.randn(4, 8),))
    shift = tensor(graphs, "layers.1.shift")
    assert shift.kind == "buffer" and shift.holders == ["layers.1"] and shift.traps == ["layers.1"]
    mean = tensor(graphs, "layers.0.bn.running_mean")
    assert mean.kind == "buffer" and mean.consumers == ["layers.0.bn"] and mean.traps == ["layers.0"]


def test_weights_read_only_by_a_custom_op():
    graphs = analyses("custom_op")
    (g,) = graphs
    w13 = tensor(graphs, "layers.1.mlp.w13_weight")
    ops = [n for n in g.gm.graph.nodes if n.op == "call_function" and "fused_mlp" in str(n.target)]
    assert len(ops) == 2, "the custom op is a node of the graph, once per layer"
    assert g.analysis.consumer_nodes[w13.node] == [ops[1].name]
    assert w13.consumers == ["layers.1.mlp"] and w13.traps == ["layers.1"]


def test_moe_fused_expert_parameters():
    graphs = analyses("moe")
    for layer in (0, 1):
        for p in ("w13_weight", "w2_weight"):
            t = tensor(graphs, f"layers.{layer}.moe.{p}")
            assert t.kind == "parameter" and t.holders == [f"layers.{layer}.moe"] and t.traps == [f"layers.{layer}"]
    w13 = tensor(graphs, "layers.0.moe.w13_weight")
    assert w13.shape == (4, 96, 32) and w13.nbytes == 4 * 96 * 32 * 4


def test_graph_break_inside_the_layer_stack():
    graphs = analyses("graph_break")
    assert len(graphs) >= 2
    fc1 = tensor(graphs, "layers.1.fc1.weight")
    fc2 = tensor(graphs, "layers.1.fc2.weight")
    g1 = next(g for g in graphs if fc1.node in g.analysis.tensors and g.analysis.tensors[fc1.node] is fc1)
    g2 = next(g for g in graphs if fc2.node in g.analysis.tensors and g.analysis.tensors[fc2.node] is fc2)
    assert g1 is not g2  # layer 1 is cut in two by the break
    assert fc1.traps == ["layers.1"] and fc2.traps == ["layers.1"]
    assert fc1.holders == ["layers.1.fc1"]


def test_no_hooks_modes_or_warmup_runs(monkeypatch):
    """Ownership is complete when the delegate is called, i.e. before the compiled graph has run
    once, and nothing was hooked or intercepted on the way."""
    model, inputs = build("tiny_transformer")
    state = {}
    calls = {"forward": 0}
    orig_forward = type(model).forward

    def counting_forward(self, *a):
        calls["forward"] += 1
        return orig_forward(self, *a)

    monkeypatch.setattr(type(model), "forward", counting_forward)

    def delegate(gm, ex):
        from torch.nn.modules import module as m
        from torch.overrides import _get_current_function_mode_stack

        state["analysis"] = gp.graphs[-1].analysis
        state["hooks"] = (
            len(m._global_forward_hooks)
            + len(m._global_forward_pre_hooks)
            + sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in model.modules())
        )
        state["modes"] = len(_get_current_function_mode_stack())
        state["forward_calls_before_run"] = calls["forward"]
        return gm.forward

    gp = graphpass.backend(then=delegate)
    torch.compile(model, backend=gp)(*inputs)
    a = state["analysis"]
    assert len(a.traps) == 2 and all(t.traps for t in a.weights() if t.fqn.startswith("layers."))
    assert state["hooks"] == 0 and state["modes"] == 0
    # Nothing of the model has run when ownership is complete (the counter in the traced forward is
    # a side effect Dynamo replays after the compiled graph runs), and the user's one call ran once.
    assert state["forward_calls_before_run"] == 0
    assert calls["forward"] == 1
