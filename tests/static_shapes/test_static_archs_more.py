"""Static-shape buckets for the chunked-scan families (issue 20, item 1).

Mamba-2-style state-space layers (``mamba2_chunk_scan``: Mamba-2, Bamba, Falcon-H1, GraniteMoE-hybrid,
Nemotron-H, Zamba2) and gated-delta-rule linear attention (``torch_chunk_gated_delta_rule``: Qwen3-Next,
Qwen3.5, OLMo-hybrid, ...) zero-pad the sequence to a multiple of their chunk and scan over chunks. Op by
op that is not row-wise; as a whole each function is causal along the sequence (proof in
docs/static-shapes.md, "Chunked scans"), so graphpass trusts the proven code, identified by its file, name
and source digest (``graphpass/static_shapes/causal_functions.py``), and checks only its edges.

Unit tests trace copies of the real functions placed under a path that ends like transformers' file (fast);
the model tests sweep real tiny models through the static-only stand-in, as tests/test_static_lm_buckets.py
does.
"""

import ast
import importlib.util
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

import graphpass
from graphpass.backends import NeuronDelegate
from graphpass.static_shapes.causal_functions import CAUSAL_FUNCTIONS, source_digest
from graphpass.static_shapes.padding_safety import check_padding_safety

from helpers import bench_conformance, sweep_buckets

transformers = pytest.importorskip("transformers")

conformance = bench_conformance()

_HELPERS = {
    "mamba2": ("pad_tensor_by_size", "reshape_into_chunks", "segment_sum", "mamba2_chunk_scan"),
    "qwen3_next": ("l2norm", "torch_chunk_gated_delta_rule"),
}


def _copy_module(tmp_path, model, edit=None):
    """The real functions of transformers' ``modeling_<model>.py``, copied undecorated into a file whose
    path ends like the original's (``transformers/models/<model>/modeling_<model>.py``), imported."""
    src_path = Path(transformers.__file__).parent / "models" / model / f"modeling_{model}.py"
    source = src_path.read_text()
    tree = ast.parse(source)
    parts = [
        "import torch",
        "import torch.nn.functional as F",
        "from transformers.utils import is_torchdynamo_exporting",
    ]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in _HELPERS[model]:
            node.decorator_list = []
            parts.append(ast.unparse(node))
    text = "\n\n".join(parts) + "\n"
    if edit is not None:
        text = edit(text)
    out = tmp_path / "transformers" / "models" / model / f"modeling_{model}.py"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    spec = importlib.util.spec_from_file_location(f"copied_{model}_{abs(hash(str(out)))}", out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(fn, *inputs, seq_only=False):
    """Trace ``fn`` with dynamic shapes and check padding its inputs' dim 1. ``seq_only``: only dim 1 is
    marked dynamic (the claim is about the sequence alone; symbolic head/state sizes made each Mamba-2
    trace take minutes of sympy)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for t in inputs if seq_only else ():
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            torch._dynamo.mark_dynamic(t, 1)
    compiled = torch.compile(fn, backend=keep, dynamic=None if seq_only else True)
    with torch.no_grad():
        compiled(*inputs)
    gm = graphs[0]
    x = next(
        n.meta["example_value"]
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and isinstance(n.meta.get("example_value"), torch.Tensor)
        and n.meta["example_value"].dim() >= 3
    )
    return check_padding_safety(gm, {x.shape[1].node.expr})


def _mamba2_inputs(n=11, heads=4, head_dim=3, groups=2, state=5):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, n, heads, head_dim, generator=g),
        torch.rand(2, n, heads, generator=g),
        -torch.rand(heads, generator=g) - 0.5,
        torch.randn(2, n, groups, state, generator=g),
        torch.randn(2, n, groups, state, generator=g),
    )


def test_the_recorded_digests_are_those_of_the_installed_transformers():
    for name, fn in CAUSAL_FUNCTIONS.items():
        for suffix in fn.files:
            path = Path(transformers.__file__).parent.parent / suffix
            if path.exists():
                assert source_digest(str(path), name, fn.helpers) == fn.digest, (suffix, name)


@pytest.mark.slow
def test_mamba2_chunk_scan_is_causal_and_padding_is_exact(tmp_path):
    mod = _copy_module(tmp_path, "mamba2")
    x, dt, a, b, c = _mamba2_inputs()
    assert (
        _check(
            lambda x, dt, b, c: mod.mamba2_chunk_scan(x, dt, a, b, c, chunk_size=4, D=torch.ones(4)),
            x,
            dt,
            b,
            c,
            seq_only=True,
        )
        == []
    )
    # the claim itself, numerically: real rows of a right-padded call equal the unpadded call
    want = mod.mamba2_chunk_scan(x, dt, a, b, c, chunk_size=4)
    pad = [torch.cat([t, 7 * torch.randn(t.shape[0], 5, *t.shape[2:]).abs()], dim=1) for t in (x, dt, b, c)]
    got = mod.mamba2_chunk_scan(pad[0], pad[1], a, pad[2], pad[3], chunk_size=4)[:, : x.shape[1]]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_final_state_of_a_scan_used_outside_is_refused(tmp_path):
    mod = _copy_module(tmp_path, "mamba2")
    x, dt, a, b, c = _mamba2_inputs()

    def with_state(x, dt, b, c):
        out, state = mod.mamba2_chunk_scan(x, dt, a, b, c, chunk_size=4, return_final_states=True)
        return out, state * 2  # a cache would store it: it sums over every row, the padding included

    got = _check(with_state, x, dt, b, c, seq_only=True)
    assert got and "final recurrent state" in got[0].reason, got


def test_a_sequence_not_exactly_the_padded_length_is_refused(tmp_path):
    mod = _copy_module(tmp_path, "mamba2")
    x, dt, a, b, c = _mamba2_inputs()

    def shifted(x, dt, b, c):  # a row prepended: dim 1 is L + 1, not the layout the proof assumes
        x, dt, b, c = (torch.cat([t[:, :1] * 0, t], dim=1) for t in (x, dt, b, c))
        return mod.mamba2_chunk_scan(x, dt, a, b, c, chunk_size=4)

    got = _check(shifted, x, dt, b, c, seq_only=True)
    assert got and "dim 1 of the padded length" in got[0].reason, got


@pytest.mark.parametrize(
    "edit",
    [
        # a helper edited: segment_sum's causal mask made full (diagonal=0 -> 8): the function itself is unchanged
        lambda s: s.replace("diagonal=0", "diagonal=8"),
        # the function edited: the cut of the padded chunks gone
        lambda s: s.replace("output = output[:, :sequence_length]", "output = output.flip(1)[:, :sequence_length]"),
    ],
    ids=["helper", "function"],
)
def test_an_edited_copy_is_checked_op_by_op_and_refused(tmp_path, edit):
    mod = _copy_module(tmp_path, "mamba2", edit=edit)
    x, dt, a, b, c = _mamba2_inputs()
    got = _check(lambda x, dt, b, c: mod.mamba2_chunk_scan(x, dt, a, b, c, chunk_size=4), x, dt, b, c, seq_only=True)
    assert got, "an edited copy must not be trusted"
    # the refusal says why: the pinned function changed (issue 38), naming it, the release and what to do
    assert any(
        "mamba2_chunk_scan (transformers/models/mamba2/modeling_mamba2.py)" in v.reason
        and "is not the code graphpass proved" in v.reason
        and "pin transformers==" in v.reason
        for v in got
    ), [v.reason for v in got]


def test_gated_delta_rule_is_causal_and_padding_is_exact(tmp_path):
    mod = _copy_module(tmp_path, "qwen3_next")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 11, 2, 4, generator=g) for _ in range(3))
    decay, beta = -torch.rand(2, 11, 2, generator=g), torch.rand(2, 11, 2, generator=g)

    def run(q, k, v, decay, beta):
        return mod.torch_chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=4, use_qk_l2norm_in_kernel=True)[0]

    assert _check(run, q, k, v, decay, beta) == []
    want = run(q, k, v, decay, beta)
    pad = [
        torch.cat(
            [
                t,
                torch.randn(t.shape[0], 6, *t.shape[2:]).abs().neg()
                if t is decay
                else torch.rand(t.shape[0], 6, *t.shape[2:]),
            ],
            dim=1,
        )
        for t in (q, k, v, decay, beta)
    ]
    torch.testing.assert_close(run(*pad)[:, :11], want, rtol=1e-5, atol=1e-6)


def _delta_rule_sweep(tmp_path, lengths):
    mod = _copy_module(tmp_path, "qwen3_next")

    def run(q, k, v, decay, beta):
        return mod.torch_chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=4)[0]

    gp = graphpass.backend(
        then="eager",
        traps=[],
        static_shapes={"dims": {n: 1 for n in ("q", "k", "v", "decay", "beta")}, "buckets": [8, 16]},
    )
    torch._dynamo.reset()
    compiled = torch.compile(run, backend=gp)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n in lengths:
            q, k, v = (torch.randn(1, n, 2, 4, generator=g) for _ in range(3))
            decay, beta = -torch.rand(1, n, 2, generator=g), torch.rand(1, n, 2, generator=g)
            torch.testing.assert_close(compiled(q, k, v, decay, beta), run(q, k, v, decay, beta), rtol=1e-5, atol=1e-6)
    return [gr.analysis.bucket_plan for gr in gp.graphs if getattr(gr.analysis, "bucket_plan", None) is not None]


@pytest.mark.slow
def test_a_length_guard_of_the_proven_code_is_checked_at_every_bucket(tmp_path, monkeypatch):
    # the gated delta rule loops over the chunk count (a Python int): Dynamo unrolls the loop for the traced
    # length and guards on the count. With chunk_size 4, a graph traced at 6 rows (2 chunks) is not the code's
    # trace at bucket 16 (4 chunks). That guard is listed as benign (every chunk holding a real row is processed;
    # the others hold padding only): without the listing, calls landing in bucket 16 run unpadded
    from graphpass.static_shapes import causal_functions as cf

    plans = _delta_rule_sweep(tmp_path, (5, 6, 7, 9))
    assert plans and plans[0].active and not plans[0].invalid_buckets, [(p.refused, p.invalid_buckets) for p in plans]
    strict = {n: replace(f, benign_guards={}) for n, f in cf.CAUSAL_FUNCTIONS.items()}
    monkeypatch.setattr(cf, "CAUSAL_FUNCTIONS", MappingProxyType(strict))
    plans = _delta_rule_sweep(tmp_path, (5, 6, 7, 9))
    assert plans and plans[0].active and set(plans[0].invalid_buckets) == {16}, [
        (p.refused, p.invalid_buckets) for p in plans
    ]
    assert "range(num_chunks)" in plans[0].invalid_buckets[16]


# ----------------------------------------------------------------------------- real models

BUCKETS = [16, 32, 64]
LENGTHS = [2, 5, 9, 16, 17, 23, 31, 33, 40, 47, 58, 63]  # 12 lengths over all three buckets
# Mamba-2's tiny config has chunk_size 16: a graph Dynamo traces at a multiple of the chunk (16 here) takes the other
# branch of ``if pad_size > 0``; its guard makes the length a multiple of 16, which the proof reads
# (padding_proof/guards.py), so the sweep includes the multiples (real proportions: test_chunked_real_proportions.py)
# (family, lengths, graphs per bucket): Mamba-2's ``if pad_size > 0`` makes Dynamo trace two graphs (lengths that are
# multiples of the chunk, and the others), each compiled at the buckets only
FAMILIES = [("mamba2", LENGTHS, 2), ("qwen3_next", LENGTHS, 1)]


def _sweep(model, strict, lengths):
    delegate = NeuronDelegate(registered_name="strict_aten_standin", module=None)
    gp, _, pieces = sweep_buckets(model, delegate, lengths, BUCKETS, strict=strict)
    return gp, pieces


def _assert_bucketed(gp, strict, pieces, lengths, branches=1):
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    assert plans and all(p.active for p in plans), [p.refused for p in plans]
    compiles, rest = divmod(len(strict.graphs), pieces)
    assert rest == 0 and compiles <= branches * len(BUCKETS) + 1, (len(strict.graphs), pieces)
    seq_lens = {s[1] for shapes in strict.shapes for s in shapes if len(s) == 2 and s[0] == 1}
    seq_lens.discard(conformance.MAX_POS)
    assert seq_lens <= set(BUCKETS) | {lengths[0]}, seq_lens


@pytest.mark.slow
@pytest.mark.parametrize("family,lengths,branches", FAMILIES, ids=[f for f, _, _ in FAMILIES])
def test_chunked_scan_family_pads_to_buckets_through_a_static_only_compiler(strict_backend, family, lengths, branches):
    model = conformance.build_model(family)
    gp, pieces = _sweep(model, strict_backend, lengths)
    _assert_bucketed(gp, strict_backend, pieces, lengths, branches)


def test_a_cache_update_with_the_final_state_is_still_refused():
    # use_cache=True: the scan's final state goes into the cache: not proven, the plan is refused (and exact)
    model = conformance.build_model("mamba2")
    gp = graphpass.backend(then="eager", static_shapes={"dims": {"input_ids": 1}, "buckets": [8, 16]})
    compiled = torch.compile(model, backend=gp)
    with torch.no_grad():
        for n in (5, 7, 12):
            ids = torch.randint(0, 64, (1, n))
            torch.testing.assert_close(
                compiled(input_ids=ids, use_cache=True).logits,
                model(input_ids=ids, use_cache=True).logits,
                rtol=1e-5,
                atol=1e-5,
            )
    plans = [g.analysis.bucket_plan for g in gp.graphs if getattr(g.analysis, "bucket_plan", None) is not None]
    refused = [str(r) for p in plans for r in (p.refused or [])]
    assert plans and not any(p.active for p in plans) and refused, refused


def test_a_refusal_in_a_transformers_release_not_checked_says_so(tmp_path, monkeypatch):
    """A refusal in a transformers model file of a release the pins were not checked on (issue 38) says that the
    release may be the cause, and what to do; on a checked release it does not."""
    from graphpass.static_shapes.padding_proof import drift

    out = tmp_path / "transformers" / "models" / "foo" / "modeling_foo.py"
    out.parent.mkdir(parents=True)
    out.write_text("import torch\n\n\ndef mixer(x):\n    return torch.cumsum(x.flip(1), dim=1)\n")
    spec = importlib.util.spec_from_file_location("copied_foo_mixer", out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    x = torch.randn(2, 9, 4)
    for version, said in [("99.0.0", True), (drift.CHECKED_TRANSFORMERS[-1], False)]:
        monkeypatch.setattr(drift, "_transformers_version", lambda: version)
        got = _check(mod.mixer, x, seq_only=True)
        assert got and all(
            ("transformers 99.0.0 is not a release this proof was checked on" in v.reason) == said for v in got
        ), [v.reason for v in got]
