"""Test helpers: counting and strict stand-in delegates, input makers, the bucket sweep."""

import operator

import torch
import torch.nn as nn


class CountingBackend:
    """A ``then=`` delegate that counts compilations and keeps the graphs it was given."""

    __name__ = "counting"

    def __init__(self, inner=None):
        self.calls = 0
        self.graphs = []
        self.inner = inner

    def __call__(self, gm, example_inputs):
        self.calls += 1
        self.graphs.append(gm)
        if self.inner is not None:
            return self.inner(gm, example_inputs)
        return gm.forward


class StrictAtenBackend:
    """Stand-in for AWS Neuron's compiler: it cannot run host code, so it accepts only graphs whose
    every op is a plain aten/prims op (plus getitem on their tuple results, and tensor constants such as
    the ``torch.tensor([])`` of transformers' default cache: data, not host code), and, like TorchNeuron
    (which rejects ``dynamic=True``), only static shapes: a symbolic size anywhere is refused."""

    __name__ = "strict_aten"

    def __init__(self):
        self.graphs = []
        self.shapes = []  # the input shapes of every graph it compiled

    def __call__(self, gm, example_inputs, **kwargs):
        for value in list(example_inputs) + [n.meta.get("val") for n in gm.graph.nodes]:
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                sizes = v.shape if isinstance(v, torch.Tensor) else [v]
                if any(isinstance(s, torch.SymInt) for s in sizes):
                    raise RuntimeError(f"strict backend: symbolic size {tuple(sizes)} refused (static shapes only)")
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor):
                continue  # a constant tensor (e.g. torch.tensor([]) in the model's code): data, not host code
            if node.op != "call_function":
                raise RuntimeError(f"strict backend: {node.op} node {node.name} refused")
            target = node.target
            if target is operator.getitem:
                continue
            if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
                raise RuntimeError(f"strict backend: non-aten op {target} ({node.name}) refused")
        self.graphs.append(gm)
        self.shapes.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        return gm.forward


def _lm_call(model, ids):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


def sweep_buckets(
    model, delegate, lengths, buckets, *, call=_lm_call, batch=1, vocab=None, seed=7, tol=1e-5, strict=None
):
    """Sweep ``lengths`` through ``buckets``: compile ``model`` with graphpass padding dim 1 of ``input_ids`` up to
    ``buckets`` in front of ``delegate`` (the strict stand-in behind a NeuronDelegate, or a recording delegate), then
    call it at every length (token ids of ``batch`` rows below ``vocab``, default the model's vocabulary, drawn
    from a generator seeded ``seed``): each call's logits (``call(model, ids)``, by default a causal LM's with a
    full attention mask and no cache) have eager's shape and equal them within ``tol``.

    Returns the graphpass backend, its bucket plans, and, when ``strict`` (the stand-in) is given, how many
    graphs it held after the first call (the pieces of one compile, split at the trap boundaries), else None."""
    import graphpass

    if vocab is None:
        vocab = model.config.get_text_config().vocab_size
    gp = graphpass.backend(then=delegate, static_shapes={"dims": {"input_ids": 1}, "buckets": buckets})
    compiled = torch.compile(model, backend=gp)
    pieces = None
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, vocab, (batch, n), generator=g)
            got, ref = call(compiled, ids), call(model, ids)
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol, msg=lambda m: f"length {n}: {m}")
            if pieces is None and strict is not None:
                pieces = len(strict.graphs)
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    return gp, plans, pieces


def max_diff(a, b):
    return (a - b).abs().max().item()


def fresh_inputs(inputs, seed=123, vocab=64):
    """New random inputs shaped like ``inputs`` (floats: normal; ints: token ids below ``vocab``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in inputs:
        if t.dtype.is_floating_point:
            out.append(torch.randn(t.shape, generator=g))
        else:
            out.append(torch.randint(0, vocab, t.shape, generator=g))
    return tuple(out)


def register_temp_backend(monkeypatch, name, fn):
    """Register ``fn`` with Dynamo as ``name`` for one test (monkeypatch undoes it)."""
    from torch._dynamo.backends import registry

    registry._lazy_import()
    monkeypatch.setitem(registry._BACKENDS, name, None)
    monkeypatch.setitem(registry._COMPILER_FNS, name, fn)
    fn._tags = ()
    return fn


def no_matplotlib(monkeypatch) -> None:
    """Make ``import matplotlib`` (and its submodules) fail, as on a machine without the plot extra."""
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


class LoopExperts(nn.Module):
    """An MoE block like longcat_flash's: the expert loop calls ``.item()``, a graph break inside a
    loop, so Dynamo skips that frame and runs it eagerly, reading the expert weights the model holds."""

    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.Parameter(torch.randn(n, d, d) / d**0.5)

    def forward(self, x):
        top = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in top.unique():
            i = int(e.item())
            out = out + (top == i).unsqueeze(-1) * (x @ self.experts[i])
        return x + out


class LoopExpertsStack(nn.Module):
    """``n`` :class:`LoopExperts` blocks in a row (tests/test_conformance_regressions.py, and the eager
    readers of tests/test_faults_offload.py)."""

    def __init__(self, n: int = 2, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoopExperts(d=d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def dynamo_graph(fn, *inputs):
    """The single Dynamo graph of ``fn(*inputs)`` traced with dynamic shapes (a graph break fails)."""
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=lambda gm, ex: graphs.append(gm) or gm.forward, dynamic=True)
    with torch.no_grad():
        compiled(*inputs)
    assert len(graphs) == 1, f"{len(graphs)} graphs (graph break?)"
    return graphs[0]


def tied_padding_violations(gm, zero_padded=("attention_mask",)):
    """``check_padding_safety`` of ``gm`` padding dim 1 of every tensor input whose dim 1 is symbolic, those
    symbols tied together, the inputs named like ``zero_padded`` padded with 0. Returns the violations, the
    inputs the accepted proofs need to hold 1 at every real position, and the zero-padded input names."""
    from graphpass.static_shapes.padding_safety import check_padding_safety

    values = {n.name: n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"}
    padded = {
        name: v
        for name, v in values.items()
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and isinstance(v.shape[1], torch.SymInt)
    }
    syms = {v.shape[1].node.expr for v in padded.values()}
    zero = [name for name in padded if any(z in name for z in zero_padded)]
    relied: set[str] = set()
    got = check_padding_safety(gm, syms, zero_padded=zero, ties={s: min(syms, key=str) for s in syms}, relied_on=relied)
    return got, relied, zero


def bench_conformance():
    """``bench/conformance.py`` as a module (its tiny configs and ``build_model``), loaded once per process."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "graphpass_bench_conformance"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / "bench" / "conformance.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
