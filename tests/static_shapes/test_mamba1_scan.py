"""Static-shape buckets and Mamba (v1)'s selective scan (issue 20).

transformers' ``mamba_selective_scan`` (Mamba, Falcon-Mamba, Jamba, Zamba: one identical function) runs, under
torch.compile, torch's ``associative_scan`` of the affine maps ``(discrete_A[t], deltaB_u[t])`` along the
sequence (the last dim). As a whole it is causal (proof in docs/static-shapes.md, "Chunked scans"), so
graphpass trusts the proven code (``graphpass/static_shapes/causal_functions.py``) and checks its edges.

What Dynamo traces depends on the ``combine_mode`` transformers picks from the device:

* ``"pointwise"`` (CUDA, XPU): one ``torch.ops.higher_order.associative_scan`` node, no guard on the length:
  the graph buckets. These tests run on CPU, so they get that trace by making ``associative_scan`` use
  ``"pointwise"`` (``pointwise_scan`` below; the transformers function itself is unchanged, its digest
  matches; on CPU the higher-order op runs torch's generic fallback).
* ``"generic"`` (CPU, XLA): the odd/even recursion is unrolled for the traced length, under Dynamo guards on the
  parities of ``s, s // 2, s // 4, ...`` that pin the length (plain torch.compile compiles every length
  anew). The scan's rows come out sized by an expression equal to ``s`` only under those guards, and the
  layout check refuses the graph: it runs with dynamic shapes, exact.

When the graph goes to graphpass with static shapes, ``graphpass.static_shapes.scan_trace`` has Dynamo trace the
proven function's ``"generic"`` call as ``"pointwise"`` (one node), on any device: the real model buckets on this
CPU with no help, and a static-only compiler gets the op unrolled at the bucket's size. Other backends, graphpass
without static shapes and an edited copy of the function trace the generic recursion as before.
"""

import ast
import importlib
import importlib.util
import operator
from pathlib import Path

import pytest
import torch

import graphpass
from graphpass.fx_utils import find_calls
from graphpass.static_shapes.causal_functions import CAUSAL_FUNCTIONS, source_digest
from graphpass.static_shapes.padding_safety import check_padding_safety

from helpers import sweep_buckets

transformers = pytest.importorskip("transformers")
if not hasattr(importlib.import_module("torch._higher_order_ops"), "associative_scan"):
    pytest.skip("torch without associative_scan", allow_module_level=True)

_IMPORTS = [
    "import torch",
    "import torch.nn.functional as F",
    "from transformers.utils.import_utils import is_mambapy_available, is_torch_greater_or_equal, "
    "is_torchdynamo_compiling, is_torchdynamo_exporting",
]


@pytest.fixture
def pointwise_scan(monkeypatch):
    """torch's ``associative_scan`` with ``combine_mode="pointwise"`` whatever the caller asks: the trace
    transformers gets on CUDA, on this CPU."""
    module = importlib.import_module("torch._higher_order_ops.associative_scan")
    real = module.associative_scan

    def pointwise(combine_fn, xs, dim, reverse=False, combine_mode="pointwise"):
        return real(combine_fn, xs, dim, reverse=reverse, combine_mode="pointwise")

    monkeypatch.setattr(module, "associative_scan", pointwise)


def _copy_scan(tmp_path, edit=None, model="mamba"):
    """transformers' ``mamba_selective_scan``, copied undecorated into a file whose path ends like the
    original's (``transformers/models/<model>/modeling_<model>.py``), imported."""
    src = Path(transformers.__file__).parent / "models" / model / f"modeling_{model}.py"
    fn = next(
        n
        for n in ast.parse(src.read_text()).body
        if isinstance(n, ast.FunctionDef) and n.name == "mamba_selective_scan"
    )
    fn.decorator_list = []
    text = "\n".join(_IMPORTS) + "\n\n\n" + ast.unparse(fn) + "\n"
    if edit is not None:
        edited = edit(text)
        assert edited != text, "the edit changed nothing"
        text = edited
    out = tmp_path / "transformers" / "models" / model / f"modeling_{model}.py"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    spec = importlib.util.spec_from_file_location(f"copied_scan_{abs(hash(str(out)))}", out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(n=11, d=6, state=4):
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(2, d, n, generator=g),
        dt=torch.randn(2, d, n, generator=g),
        B=torch.randn(2, state, n, generator=g),
        C=torch.randn(2, state, n, generator=g),
        z=torch.randn(2, d, n, generator=g),
    )


_A = -torch.rand(6, 4, generator=torch.Generator().manual_seed(1)) - 0.5
_D, _BIAS = torch.ones(6), torch.full((6,), 0.1)


def _scan(mod, hidden_states, dt, B, C, z, **kw):
    return mod.mamba_selective_scan(
        hidden_states, dt, _A, B, C, D=_D, z=z, delta_bias=_BIAS, delta_softplus=True, use_associative_scan=True, **kw
    )


def _check(fn, inputs):
    """Trace ``fn`` with dynamic shapes and check padding the inputs' last dim (the sequence)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=keep, dynamic=True)
    with torch.no_grad():
        compiled(*inputs.values())
    gm = graphs[0]
    x = next(
        n.meta["example_value"]
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and isinstance(n.meta.get("example_value"), torch.Tensor)
        and n.meta["example_value"].dim() == 3
    )
    trusted = set()
    return check_padding_safety(gm, {x.shape[-1].node.expr}, trusted=trusted), trusted, gm


def _padded(inputs, extra=5):
    g = torch.Generator().manual_seed(3)
    return {k: torch.cat([t, 7 * torch.randn(*t.shape[:2], extra, generator=g)], dim=-1) for k, t in inputs.items()}


def test_the_recorded_digest_is_that_of_every_installed_copy():
    fn = CAUSAL_FUNCTIONS["mamba_selective_scan"]
    root = Path(transformers.__file__).parent.parent
    for suffix in fn.files:
        if (root / suffix).exists():
            assert source_digest(str(root / suffix), "mamba_selective_scan") == fn.digest, suffix


def test_the_pointwise_scan_is_trusted_and_padding_is_exact(tmp_path, pointwise_scan):
    mod = _copy_scan(tmp_path)
    inputs = _inputs()
    violations, trusted, gm = _check(lambda *a: _scan(mod, *a), inputs)
    assert violations == [] and trusted == {"mamba_selective_scan"}, violations
    assert any(n.target is torch.ops.higher_order.associative_scan for n in gm.graph.nodes)
    # the claim itself, numerically, through the traced scan: real rows of a right-padded call equal the unpadded
    compiled = torch.compile(lambda *a: _scan(mod, *a), backend="eager", dynamic=True)
    n = inputs["hidden_states"].shape[-1]
    with torch.no_grad():
        want = compiled(*inputs.values())
        for extra in (1, 4, 5):
            got = compiled(*_padded(inputs, extra).values())[..., :n]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # and the sequential loop transformers runs outside torch.compile computes the same rows
        torch.testing.assert_close(_scan(mod, *_padded(inputs).values())[..., :n], want, rtol=1e-5, atol=1e-6)


def test_the_generic_scan_is_refused_at_its_rows_sized_for_the_traced_length(tmp_path):
    # CPU's combine_mode="generic": the recursion is unrolled for the traced length (Dynamo guards pin it), its
    # rows are sized by an expression of the length, not the length: refused, naming the size
    mod = _copy_scan(tmp_path)
    violations, _, _ = _check(lambda *a: _scan(mod, *a), _inputs())
    assert violations and "not the padded length" in violations[0].reason, violations
    assert "mamba_selective_scan's result" in violations[0].reason


def test_the_final_state_read_outside_is_refused(tmp_path, pointwise_scan):
    mod = _copy_scan(tmp_path)

    def with_state(*a):
        out, state = _scan(mod, *a, return_last_state=True)
        return out, state * 2  # a cache would store it: it is the last row's state, padding included

    violations, _, _ = _check(with_state, _inputs())
    assert violations and "final recurrent state" in violations[0].reason, violations


@pytest.mark.parametrize(
    "edit",
    [
        # the scan run backwards: row t then reads rows >= t
        lambda s: s.replace("dim=2, combine_mode=combine_mode", "dim=2, reverse=True, combine_mode=combine_mode"),
        # the output read from the last state: every row reads every row
        lambda s: s.replace(
            "scan_output = torch.matmul(all_states.transpose(1, 2)",
            "scan_output = torch.matmul(all_states[:, :, -1:].expand_as(all_states).transpose(1, 2)",
        ),
    ],
    ids=["reverse", "last_state"],
)
def test_an_edited_copy_is_checked_op_by_op_and_refused(tmp_path, pointwise_scan, edit):
    mod = _copy_scan(tmp_path, edit=edit)
    violations, trusted, _ = _check(lambda *a: _scan(mod, *a), _inputs())
    assert violations and not trusted, "an edited copy must not be trusted"


def test_a_scan_of_another_library_called_inside_is_checked_op_by_op(tmp_path, monkeypatch):
    # with use_mambapy the function runs mambapy's pscan, whose code the proof does not cover: its nodes are not
    # trusted. A stand-in pscan that is not causal (each row reads the rows after it) is refused, naming its op
    pkg = tmp_path / "site" / "mambapy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pscan.py").write_text("def pscan(A, X):\n    return A * X.flip(1).cumsum(1).flip(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(importlib.sys.modules, "mambapy", raising=False)
    monkeypatch.delitem(importlib.sys.modules, "mambapy.pscan", raising=False)
    mod = _copy_scan(tmp_path)
    mod.is_mambapy_available = lambda: True
    violations, _, _ = _check(lambda *a: _scan(mod, *a, use_mambapy=True), _inputs())
    assert any(v.op == "Tensor.flip" and v.source.startswith("pscan.py") for v in violations), violations


# ----------------------------------------------------------------------------- a real tiny model

BUCKETS = [8, 16]
LENGTHS = [5, 7, 12, 14, 6, 3, 16]


def _model(layers=2):
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(
        vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=layers, expand=2, conv_kernel=4, time_step_rank=4
    )
    return transformers.MambaForCausalLM(cfg).eval()


def _sweep(model, lengths, use_cache=False):
    seen = []

    def recording(gm, example_inputs):
        seen.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    def call(m, ids):
        return m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=use_cache).logits

    torch._dynamo.reset()
    _, plans, _ = sweep_buckets(model, recording, lengths, BUCKETS, call=call, vocab=64)
    return plans, seen


def _shape_checks(plans, seen, lengths):
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    assert len(seen) <= len(BUCKETS) + 1, len(seen)  # the first call's exact length, then one graph per bucket
    seq = {s[1] for shapes in seen for s in shapes if len(s) == 2 and s[0] == 1}
    assert seq <= set(BUCKETS) | {lengths[0]}, seq


def test_mamba_pads_to_buckets_with_the_pointwise_scan(pointwise_scan):
    _shape_checks(*_sweep(_model(), LENGTHS), LENGTHS)


def test_mamba_pads_to_buckets_on_the_cpu_with_no_help():
    # no fixture: transformers asks for combine_mode="generic" here; graphpass with static shapes traces it as one op
    _shape_checks(*_sweep(_model(), LENGTHS), LENGTHS)


def _scan_nodes(compile_kwargs):
    """Per graph the delegate compiles, with ``torch.compile(model, **compile_kwargs(delegate))``: how many
    scan higher-order ops and how many calls of graphpass's decomposition of it (what a scan off CUDA
    becomes before any delegate sees it)."""
    from graphpass.delegation import generic_associative_scan

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(_model(layers=1), **compile_kwargs(keep))
    with torch.no_grad():
        for length in (5, 7):
            compiled(input_ids=torch.randint(0, 64, (1, length)), use_cache=False)
    return [
        (
            len(find_calls(gm.graph, torch.ops.higher_order.associative_scan)),
            len(find_calls(gm.graph, generic_associative_scan)),
        )
        for gm in graphs
    ]


def test_the_generic_scan_is_traced_as_before_for_other_backends_and_without_static_shapes():
    # another backend, and graphpass without static shapes: Dynamo unrolls the recursion (no scan node)
    assert _scan_nodes(lambda keep: {"backend": keep}) == [(0, 0), (0, 0)]
    assert _scan_nodes(lambda keep: {"backend": graphpass.backend(then=keep)}) == [(0, 0), (0, 0)]
    # graphpass with static shapes: one scan per layer, which the CPU delegate gets as the decomposition's
    # call; also through the registered name
    static = {"dims": {"input_ids": 1}, "buckets": BUCKETS}
    assert _scan_nodes(lambda keep: {"backend": graphpass.backend(then=keep, static_shapes=static)})[-1] == (0, 1)
    by_name = _scan_nodes(lambda keep: {"backend": "graphpass", "options": {"then": keep, "static_shapes": static}})
    assert by_name[-1] == (0, 1)


def test_mamba_with_the_generic_scan_is_refused_and_exact(monkeypatch):
    # a caller that is not the proven function (here: the check says so) keeps the generic recursion: refused
    from graphpass.static_shapes import scan_trace

    monkeypatch.setattr(scan_trace, "_caller_is_proven", lambda: False)
    plans, _ = _sweep(_model(layers=1), LENGTHS[:2])  # the second length is traced with a symbolic length
    refused = [str(r) for p in plans for r in (p.refused or [])]
    assert plans and not any(p.active for p in plans), refused
    assert any("mamba_selective_scan" in r and "modeling_mamba.py" in r for r in refused), refused


def test_only_the_proven_source_is_traced_as_one_op(tmp_path):
    # the check behind the switch reads the caller's file: the installed function passes, an edited copy (same
    # meaning, another digest) does not
    from graphpass.static_shapes import scan_trace

    seen = {}
    real = scan_trace._caller_is_proven

    def spy():
        seen["last"] = real()
        return seen["last"]

    static = {"dims": {"hidden_states": 2, "dt": 2, "B": 2, "C": 2, "z": 2}, "buckets": [8, 16]}
    for edit, want in [
        (None, True),
        (lambda s: s.replace("dim=2, combine_mode", "dim=2, reverse=False, combine_mode"), False),
    ]:
        mod = _copy_scan(tmp_path / str(want), edit=edit)

        def fn(hidden_states, dt, B, C, z):
            return _scan(mod, hidden_states, dt, B, C, z)

        torch._dynamo.reset()
        seen.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(scan_trace, "_caller_is_proven", spy)
            compiled = torch.compile(fn, backend=graphpass.backend(then="eager", static_shapes=static))
            with torch.no_grad():
                for n in (5, 7):
                    inputs = _inputs(n)
                    torch.testing.assert_close(
                        compiled(*inputs.values()), _scan(mod, *inputs.values()), rtol=1e-5, atol=1e-6
                    )
        assert seen.get("last") is want, (edit, seen)


def test_a_static_only_compiler_gets_the_scan_unrolled_only_at_static_sizes():
    # graphpass.delegation points a scan node off CUDA at torch's generic decomposition, so that lowering to aten
    # (a bucket's static piece for Neuron) unrolls it at that size. The whole path, through the static-only
    # stand-in: test_static_lm_buckets.py's mamba case. On CUDA the node stays (inductor generates its code)
    from graphpass.delegation import scans_off_gpu_as_generic

    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    def scan(a, b):
        return torch._higher_order_ops.associative_scan(lambda x, y: x * y + y, a * b, dim=0, combine_mode="pointwise")

    for dynamic in (True, False):
        torch._dynamo.reset()
        torch.compile(scan, backend=keep, dynamic=dynamic)(torch.rand(5, 3), torch.rand(5, 3))
    for gm, example_inputs in graphs:  # dynamic, then static
        assert scans_off_gpu_as_generic(gm, example_inputs) == 1
        assert scans_off_gpu_as_generic(gm, example_inputs) == 0  # none left
    a, b = torch.rand(5, 3), torch.rand(5, 3)
    torch.testing.assert_close(graphs[1][0](a, b)[0], scan(a, b))
    # lowered to aten at a static size: no higher-order op left
    from torch._functorch.aot_autograd import aot_module_simplified

    lowered = []
    gm, example_inputs = graphs[1]
    aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: lowered.append(g) or g.forward)
    assert lowered and not [
        n
        for n in lowered[0].graph.nodes
        if n.op == "call_function"
        and not isinstance(n.target, torch._ops.OpOverload)
        and n.target is not operator.getitem
    ]


def test_a_cache_update_with_the_final_state_is_still_refused(pointwise_scan):
    plans, _ = _sweep(_model(layers=1), LENGTHS[:3], use_cache=True)
    refused = [str(r) for p in plans for r in (p.refused or [])]
    assert plans and not any(p.active for p in plans) and refused, refused
