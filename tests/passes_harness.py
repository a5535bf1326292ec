"""One pipeline pass at a time: the graph before and after it, and the outputs of both.

:func:`dynamo_graph` compiles a model or function with a backend that only records what Dynamo
hands graphpass (the graph, its example inputs, and the model roots and capture specs read while
Dynamo's frame is current, as :class:`graphpass.dynamo_backend.GraphpassBackend` reads them);
:func:`run_one_pass` runs ONE pass of ``graphpass.pipeline.PIPELINE`` on a copy of that graph, after
the passes it requires (its ``requires``, transitively, in pipeline order), each under the runner's
contract (``run_pass``: lint and recompile after a change). The returned :class:`PassRun` holds the
graph's normalized code before and after the pass (``graphpass.golden.render_code``: no addresses,
paths or line numbers), the ops it inserted and removed, and :meth:`PassRun.check_outputs`, which
runs the untouched Dynamo graph and the transformed one on fresh random inputs and asserts equal
outputs (exactly by default: graphpass's passes only move data or add ops that compute nothing).

In the spirit of vLLM's ``TestBackend`` (tests/compile/backend.py), which snapshots the graph
before and after a custom pass; this one drives graphpass's own runner and pass contract.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from graphpass.config import GraphpassConfig
from graphpass.errors import GraphpassError
from graphpass.fx_utils import copy_graph, graphpass_op_name
from graphpass.golden import render_code
from graphpass.passes.base import GraphPass, PassContext
from graphpass.pipeline import PIPELINE, run_pass


@dataclass
class DynamoGraph:
    """What Dynamo handed the backend for one graph."""

    gm: torch.fx.GraphModule
    example_inputs: list
    roots: Any  # graphpass.roots.Roots
    captures: list = field(default_factory=list)


def dynamo_graph(fn: Callable, *args: Any, dynamic: bool | None = False, index: int = 0) -> DynamoGraph:
    """Graph ``index`` of ``torch.compile(fn, dynamic=dynamic)`` called on ``args`` (nothing rewritten)."""
    from graphpass.capturing import specs_for
    from graphpass.roots import dynamo_roots

    grabbed: list[DynamoGraph] = []

    def grab(gm, example_inputs):
        roots = dynamo_roots(gm)  # only while Dynamo's frame is current
        captures = [spec for model in roots.whole_models() for spec in specs_for(model)]
        # a copy: Dynamo drops the placeholders' ``grapharg`` (their sources) from gm's node meta after
        # the backend returns; the copy keeps it (each node's meta is a shallow copy) and stays untouched
        grabbed.append(DynamoGraph(copy_graph(gm), list(example_inputs), roots, captures))
        return gm.forward

    try:
        torch.compile(fn, backend=grab, dynamic=dynamic)(*args)
    except GraphpassError:
        if not grabbed:  # an offloaded model's guard ops refuse the unscheduled call: the graph is kept
            raise
    assert len(grabbed) > index, f"Dynamo produced {len(grabbed)} graph(s), not graph {index}"
    return grabbed[index]


def pipeline_pass(name: str) -> GraphPass:
    found = [p for p in PIPELINE if p.name == name]
    assert found, f"no pass {name!r} in the pipeline: {[p.name for p in PIPELINE]}"
    return found[0]


def required_passes(target: GraphPass) -> list[GraphPass]:
    """The passes ``target`` requires, transitively, in pipeline order."""
    by_name = {p.name: p for p in PIPELINE}
    needed: set[str] = set()
    todo = list(target.requires)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(by_name[name].requires)
    return [p for p in PIPELINE if p.name in needed]


def op_counts(gm: torch.fx.GraphModule) -> Counter:
    """graphpass op nodes by op name (``trap_enter``, ``load_start``, ``capture``, ...), plus the
    ``get_attr`` nodes (constants a pass registered on the GraphModule) under ``"get_attr"``."""
    out: Counter = Counter(graphpass_op_name(n) for n in gm.graph.nodes)
    out.pop("", None)
    out["get_attr"] = sum(n.op == "get_attr" for n in gm.graph.nodes)
    return +out


@dataclass
class PassRun:
    """One pass run on one graph: the graph before and after, and what it did."""

    name: str
    reference: DynamoGraph  # the untouched Dynamo graph and its inputs
    original: torch.fx.GraphModule  # the graph right before the pass (after its required passes)
    gm: torch.fx.GraphModule  # the graph after the pass
    ctx: PassContext
    changed: bool
    before: str  # normalized code before the pass
    after: str  # normalized code after it

    @property
    def inserted(self) -> Counter:
        return op_counts(self.gm) - op_counts(self.original)

    @property
    def removed(self) -> Counter:
        return op_counts(self.original) - op_counts(self.gm)

    def check_unchanged(self) -> None:
        """An analysis pass: the graph's code is exactly what it was."""
        assert not self.changed, f"{self.name} said it changed the graph"
        assert self.after == self.before, f"{self.name} changed the graph's code"

    def fresh_inputs(self, seed: int = 0) -> list:
        """The example inputs with every data input (not a weight or buffer of the traced model)
        replaced by new random values of the same shape and dtype; size inputs stay as traced."""
        weights = self._weight_ids()
        g = torch.Generator().manual_seed(seed)
        out = []
        for t in self.reference.example_inputs:
            if isinstance(t, torch.SymInt):
                out.append(t.node.hint)  # Dynamo's example of a size input: the size it traced with
            elif not isinstance(t, torch.Tensor) or id(t) in weights:
                out.append(t)
            elif t.dtype.is_floating_point:
                out.append(torch.randn(t.shape, generator=g, dtype=t.dtype))
            elif t.dtype == torch.bool:
                out.append(torch.rand(t.shape, generator=g) < 0.5)
            else:
                high = max(int(t.max()) + 1, 2) if t.numel() else 2
                out.append(torch.randint(0, high, t.shape, generator=g, dtype=t.dtype))
        return out

    def data_inputs(self, inputs: list) -> list:
        """The entries of ``inputs`` at the places of the graph's data inputs (not weights)."""
        weights = self._weight_ids()
        return [
            t
            for t, ex in zip(inputs, self.reference.example_inputs)
            if not (isinstance(ex, torch.Tensor) and id(ex) in weights)
        ]

    def _weight_ids(self) -> set[int]:
        return {id(t) for m in self.reference.roots.whole_models() for t in (*m.parameters(), *m.buffers())}

    def check_outputs(
        self,
        seeds=(1, 2),
        rtol: float = 0.0,
        atol: float = 0.0,
        inputs: list | None = None,
        expected: Callable | None = None,
    ) -> None:
        """The transformed graph computes what the untouched Dynamo graph computes, on fresh inputs
        (one set per seed), or on ``inputs`` when given (e.g. another size for a dynamic graph).
        ``expected(inputs)``: the reference outputs instead, for a graph that cannot run unscheduled
        (an offloaded model's guard ops refuse that)."""
        expected = expected or (lambda each: self.reference.gm(*each))
        for each in [inputs] if inputs is not None else [self.fresh_inputs(seed) for seed in seeds]:
            with torch.no_grad():
                want, _ = tree_flatten(expected(each))
                got, _ = tree_flatten(self.gm(*each))
            assert len(got) == len(want), f"{self.name}: {len(got)} outputs, the original has {len(want)}"
            for i, (a, b) in enumerate(zip(got, want)):
                if isinstance(b, torch.Tensor):
                    torch.testing.assert_close(
                        a, b, rtol=rtol, atol=atol, msg=lambda m: f"{self.name}, output {i}: {m}"
                    )
                else:
                    assert a == b, f"{self.name}, output {i}: {a!r} != {b!r}"


def run_one_pass(graph: DynamoGraph, name: str, config: GraphpassConfig | None = None, **options: Any) -> PassRun:
    """Run pass ``name`` of the pipeline on a copy of ``graph`` (after the passes it requires)."""
    target = pipeline_pass(name)
    config = config if config is not None else GraphpassConfig.from_options(options or None)
    gm = copy_graph(graph.gm)
    ctx = PassContext(
        gm=gm,
        example_inputs=list(graph.example_inputs),
        config=config,
        roots=graph.roots,
        captures=list(graph.captures),
        graph_name=f"graph ({name} test)",
    )
    for p in required_passes(target):
        run_pass(p, ctx)
    original = copy_graph(gm)
    before = render_code(gm)
    changed = run_pass(target, ctx)
    return PassRun(name, graph, original, gm, ctx, changed, before, render_code(gm))
